"""Native CPU kernels of the host pool, compiled on first use (see gather_unpack.py)."""
