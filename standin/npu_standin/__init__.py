"""The CPU stand-in for Ascend NPUs, a test double: the device ``cpu`` behind the product's
hardware seam (``vllm_ascend_rl.devices`` entry point) and the CPU workers. Each module names
what it stands in for; the product imports none of it."""
