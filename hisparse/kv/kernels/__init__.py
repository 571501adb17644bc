"""Native CPU kernels, compiled on first use (see indexer_topk.py)."""
