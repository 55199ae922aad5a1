"""The public Python API (check_attention, check_kernel, check_moe, Verdict), the pytest plugin over it, and the utilities tfmoe's own tests use."""
