"""hisparse inside vLLM: `HiSparseConnector` (the KV connector) and the ML4 model plugin (`plugin.register`).

vLLM loads the connector by `kv_connector_module_path="hisparse.connector"`. Everything that imports vLLM is
loaded on first use, so `hisparse` itself never needs vLLM installed.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "HiSparseConnector":
        from .connector import HiSparseConnector
        return HiSparseConnector
    raise AttributeError(f"module 'hisparse.connector' has no attribute {name!r}")
