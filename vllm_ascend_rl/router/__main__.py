"""``python -m vllm_ascend_rl.router``."""

from vllm_ascend_rl.router import main

main()
