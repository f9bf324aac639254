"""The test kit, shared by tests and benchmarks (not installed: the package keeps only what users
import). What the examples stand on too, the tiny random-weight models, the vLLM server launcher,
the token-counting request helpers, the device profile and the engine flags, is defined in
``examples/plumbing`` and re-exported here; the stand-in trainer process, the scheduler harness
and the other test-only helpers are defined in this package."""

from examples.plumbing import (  # noqa: F401  (re-exported)
    PLUGIN_SCHEDULER,
    ServerStartError,
    StreamingCompletion,
    TinyModelSpec,
    VLLMServer,
    build_model_pair,
    build_tiny_model,
    complete,
    completion_body,
    engine_args,
    free_port,
    greedy_token_ids,
    load_hf_model,
    rl_engine_args,
    serving,
)
