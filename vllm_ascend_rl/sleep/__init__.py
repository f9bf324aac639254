"""Sleep mode on CANN virtual memory (host virtual memory on CPU): the allocator and the vLLM
sleep-mode backend ``camem``."""
