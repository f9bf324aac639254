"""The CPU stand-in for Ascend NPUs, what CI runs (each module names what it stands in for);
no product module outside ``device/`` imports it."""
