from vllm_ascend_rl.doctor.cli import console

console()
