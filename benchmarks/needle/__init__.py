"""Needle in a haystack over any OpenAI-compatible endpoint (`python -m benchmarks.needle`) and the
million-token run (`python -m benchmarks.needle.million`); see docs/benchmarks.md."""
