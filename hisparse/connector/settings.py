"""HiSparse settings of a vLLM deployment, read from `kv_transfer_config.kv_connector_extra_config`.

Parsed (and validated) in the API server before any engine starts, again in the scheduler and in each worker,
so a bad value fails startup once, with one message that names the field. No vLLM import: usable anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

OFFLOADS = ("hisparse", "none")
LAYOUTS = ("fp8_ds_mla", "bf16")


class HiSparseConfigError(ValueError):
    """A missing or invalid HiSparse setting; the message names the key of kv_connector_extra_config."""


@dataclass(frozen=True)
class HiSparseSettings:
    host_pool_gib: float                 # host memory for latent rows (required)
    kv_offload: str = "hisparse"         # 'hisparse': rows in the host pool; 'none': all rows resident (reference)
    kv_layout: str = "fp8_ds_mla"        # stored row format
    hot_buffer_tokens: int | None = None # hot slots per (index group, request); None: 2 x index_topk
    resident_window: int | None = None   # newest tokens per request kept on the device; None: HiSparse default

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> "HiSparseSettings":
        """Validate `kv_connector_extra_config`; raises HiSparseConfigError naming the first bad key."""
        where = "kv_connector_extra_config"
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise HiSparseConfigError(f"{where}: unknown key(s) {unknown}; HiSparseConnector accepts {sorted(known)}")
        if "host_pool_gib" not in extra:
            raise HiSparseConfigError(f"{where}: 'host_pool_gib' is required (GiB of host memory for latent rows, "
                                      "e.g. {\"host_pool_gib\": 8})")
        gib = extra["host_pool_gib"]
        if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not gib > 0:
            raise HiSparseConfigError(f"{where}: 'host_pool_gib' must be a positive number of GiB, got {gib!r}")
        for key, choices in (("kv_offload", OFFLOADS), ("kv_layout", LAYOUTS)):
            if key in extra and extra[key] not in choices:
                raise HiSparseConfigError(f"{where}: '{key}' must be one of {list(choices)}, got {extra[key]!r}")
        for key in ("hot_buffer_tokens", "resident_window"):
            v = extra.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise HiSparseConfigError(f"{where}: '{key}' must be an integer >= 0, got {v!r}")
        extra["host_pool_gib"] = float(gib)
        return cls(**extra)
