"""The examples. Each runs as a script from a checkout (``python examples/<name>.py``) and
imports from the repository root (``examples.<name>``); what they stand on, and the tests and
benchmarks import too, is :mod:`examples.plumbing`. Nothing here imports ``tests``."""
