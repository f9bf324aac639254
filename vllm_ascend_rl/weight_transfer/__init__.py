"""Weight-transfer engines on vLLM's weight-transfer API: HCCL (broadcast) and NPU-IPC. vLLM's
factories import the submodules lazily; importing this package loads nothing heavy."""
