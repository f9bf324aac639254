"""Scheduler-side pieces. The constant lives here so the router imports no vLLM code."""

# A request bounced for lack of KV blocks finishes with this pair (no natural end has it).
BOUNCE_FINISH_REASON = "abort"
BOUNCE_STOP_REASON = "recomputed"
