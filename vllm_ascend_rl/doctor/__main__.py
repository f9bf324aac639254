from vllm_ascend_rl.doctor import console

console()
