"""Pallas kernels (flash attention forward/backward); filled by the attention-kernels issue."""
