"""HiSparse settings of a vLLM deployment.

`KVSettings.from_extra_config` reads and validates `kv_transfer_config.kv_connector_extra_config` (in the API
server before any engine starts, again in the scheduler and in each worker). HiSparseConfigError reports what
those settings cannot check alone: that vLLM runs the HiSparseConnector at all, and that the host pool holds
max_model_len tokens. No vLLM import: usable anywhere.
"""

from __future__ import annotations


class HiSparseConfigError(ValueError):
    """A vLLM deployment that cannot run HiSparse; the message names the setting to change."""
