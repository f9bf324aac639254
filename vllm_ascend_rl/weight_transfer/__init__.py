"""Weight-transfer engines on vLLM's weight-transfer API: HCCL (broadcast) and NPU-IPC. vLLM's
factories import the submodules lazily; importing this package loads nothing heavy."""


class TransportError(RuntimeError):
    """A weight transfer's link failed: the HCCL channel, an NPU-IPC doorbell, or the engine's
    side of an update (the sync's own error, ``WeightSyncError``, is one too)."""
