"""Native CPU kernels of the working set, compiled on first use (see resolve.py)."""
