"""Scheduler-side pieces. The constant lives here so the router imports no vLLM code."""

BOUNCE_STOP_REASON = "recomputed"  # stop_reason of a request bounced for lack of KV blocks
