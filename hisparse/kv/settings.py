"""KVSettings: where and how the latent KV is stored, from the command line or from vLLM's connector config.

The one place the KV options are declared, defaulted and validated: `add_args` / `from_args` for the `hisparse`
command line (`--kv-offload`, `--kv-layout`, `--host-pool-gib`, ...), `from_extra_config` for vLLM's
`kv_transfer_config.kv_connector_extra_config` (`kv_offload`, `kv_layout`, `host_pool_gib`, ...), and `build`
for the LatentKV they describe. Settings are picklable: DCP follower ranks receive them and build their own store.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch

from .hisparse_kv import DEFAULT_SINKS, DEFAULT_WINDOW, HiSparseKV
from ..core import triton_support
from ..host_pool.layout import LAYOUTS
from ..core.config import ModelConfig
from .index_cache import INDEX_CACHES
from .base import LatentKV
from .resident import ResidentKV

OFFLOADS = ("hybrid", "hisparse", "none")
KERNELS = ("auto", "triton", "torch")
EXTRA_CONFIG = "kv_connector_extra_config"

# A field's name as a flag (--kv-offload) and as a kv_connector_extra_config key: only offload and layout carry
# the kv_ prefix there.
_KEYS = {"offload": "kv_offload", "layout": "kv_layout"}


def _key(field: str) -> str:
    return _KEYS.get(field, field)


def _flag(field: str) -> str:
    return "--" + _key(field).replace("_", "-")


class KVSettingsError(ValueError):
    """An invalid KV setting. `field` is the KVSettings field (None for an unknown config key), `problem` what is
    wrong with its value; the message names the field as the settings' source spells it (field, flag or key)."""

    def __init__(self, message: str, field: str | None = None, problem: str = ""):
        super().__init__(message, field, problem)   # all three in args: the error pickles across processes
        self.message, self.field, self.problem = message, field, problem

    def __str__(self) -> str:
        return self.message


def _invalid(field: str, problem: str) -> KVSettingsError:
    return KVSettingsError(f"{field}: {problem}", field, problem)


def _is_int(v: Any, least: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


class KernelUser(Protocol):
    """A model whose own kernels (the MoE's routed experts) follow the store's kernel path (the ML4 model)."""
    cfg: ModelConfig
    device: torch.device
    dtype: torch.dtype

    def use_kernels(self, path: str) -> None:
        """Run the model's kernels on `path` ('triton' | 'torch')."""


@dataclass(frozen=True)
class KVSettings:
    offload: str = "hybrid"                # 'hybrid': rows in the host pool, and on the device while
                                           # device_kv_gib has room (resident pages; the rest via hot slots);
                                           # 'hisparse': rows in the host pool, hot working set on the device;
                                           # 'none': all rows resident on the device (reference)
    layout: str = "fp8_ds_mla"             # stored row format (hisparse.host_pool.layout.LAYOUTS)
    host_pool_gib: float = 4.0             # host memory for latent rows (offload 'hybrid' and 'hisparse')
    device_kv_gib: float = 4.0             # device memory for latent rows (offload 'hybrid' and 'hisparse'):
                                           # every running request's working set (window + hot slots; a request
                                           # waits while its own does not fit) and, hybrid, resident pages in the
                                           # rest (kv.device_budget)
    hot_buffer_tokens: int | None = None   # hot slots per (index group, request): the floor every request gets
                                           # (hybrid spends the rest of the budget on resident pages); None:
                                           # 2 x index_topk
    resident_window: int | None = None     # newest tokens per request kept on the device; None: 64
    page_tokens: int = 64                  # tokens per page: the allocation unit of the host pool (or of the
                                           # device store with offload 'none')
    kernels: str = "auto"                  # 'triton': miss path, indexer scoring, sparse MLA and the MoE's routed
                                           # experts as Triton kernels;
                                           # 'torch': torch ops (+ the C++ CPU kernels); 'auto': triton on CUDA
    index_cache: str = "fp32"              # indexer keys on the device: 'fp8' 132-B records (spec §4, scored
                                           # dequantised), 'fp32' exact keys in the compute dtype (reference)
    enable_prefix_caching: bool = True     # full pages stay cached after their request ends; a request starting
                                           # with cached pages skips their prefill (vLLM's flag name)

    def __post_init__(self) -> None:
        """Validate every field; KVSettingsError names the first bad one."""
        if self.offload not in OFFLOADS:
            raise _invalid("offload", f"must be one of {list(OFFLOADS)}, got {self.offload!r}")
        if self.layout not in LAYOUTS:
            raise _invalid("layout", f"must be one of {list(LAYOUTS)}, got {self.layout!r}")
        for name in ("host_pool_gib", "device_kv_gib"):
            gib = getattr(self, name)
            if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not 0 < gib < math.inf:
                raise _invalid(name, f"must be a positive number of GiB, got {gib!r}")
            object.__setattr__(self, name, float(gib))    # 8 and 8.0 are the same setting
        for name in ("hot_buffer_tokens", "resident_window"):
            v = getattr(self, name)
            if v is not None and not _is_int(v, 0):
                raise _invalid(name, f"must be an integer >= 0, got {v!r}")
        if not _is_int(self.page_tokens, 1):
            raise _invalid("page_tokens", f"must be an integer >= 1, got {self.page_tokens!r}")
        if self.kernels not in KERNELS:
            raise _invalid("kernels", f"must be one of {list(KERNELS)}, got {self.kernels!r}")
        if self.index_cache not in INDEX_CACHES:
            raise _invalid("index_cache", f"must be one of {list(INDEX_CACHES)}, got {self.index_cache!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise _invalid("enable_prefix_caching", f"must be true or false, got {self.enable_prefix_caching!r}")

    # ---- resolved defaults ----
    def hot_buffer(self, cfg: ModelConfig) -> int:
        """Hot slots per (index group, request) for a model of `cfg`."""
        return 2 * cfg.index_topk if self.hot_buffer_tokens is None else self.hot_buffer_tokens

    @property
    def window(self) -> int:
        """Newest tokens per request kept on the device."""
        return DEFAULT_WINDOW if self.resident_window is None else self.resident_window

    def kernel_path(self, device: torch.device | str) -> str:
        """'triton' or 'torch' on `device`: auto takes Triton on CUDA when it is installed. An explicit 'triton'
        needs Triton and a CUDA device (or, on the CPU, Triton's interpreter: TRITON_INTERPRET=1)."""
        cuda = torch.device(device).type == "cuda"
        if self.kernels == "auto":
            return "triton" if cuda and triton_support.available() else "torch"
        if self.kernels == "triton" and not triton_support.available():
            raise _invalid("kernels", "'triton' needs the triton package (pip install 'hisparse[gpu]')")
        if self.kernels == "triton" and not (cuda or triton_support.interpreted()):
            raise _invalid("kernels", f"'triton' runs on CUDA (device is {device}; on the CPU only under "
                                      "TRITON_INTERPRET=1)")
        return self.kernels

    def attach(self, model: KernelUser) -> LatentKV:
        """The LatentKV for `model` (on its device, in its dtype), and the model's own kernels set to the store's
        kernel path: the one call that starts a model's KV, so the model and its store never disagree."""
        model.use_kernels(self.kernel_path(model.device))
        return self.build(model.cfg, model.device, model.dtype)

    def build(self, cfg: ModelConfig, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32) -> LatentKV:
        """The LatentKV these settings describe, for a model of `cfg` computing in `dtype` on `device`."""
        kernels = self.kernel_path(device)
        if self.offload == "none":
            return ResidentKV(cfg, self.layout, device, dtype, page_tokens=self.page_tokens, kernels=kernels,
                              index_cache=self.index_cache, prefix_caching=self.enable_prefix_caching)
        return HiSparseKV(cfg, self.layout, device, dtype, host_pool_gib=self.host_pool_gib,
                          hot_buffer_tokens=self.hot_buffer(cfg), resident_window=self.window,
                          sink_tokens=DEFAULT_SINKS, page_tokens=self.page_tokens, kernels=kernels,
                          index_cache=self.index_cache,
                          device_kv_gib=self.device_kv_gib, hybrid=self.offload == "hybrid",
                          prefix_caching=self.enable_prefix_caching)

    # ---- sources ----
    @staticmethod
    def add_args(parser: argparse.ArgumentParser, names: Collection[str] | None = None) -> None:
        """Add the flags of the fields in `names` (default: all) to `parser`; `from_args` reads them back."""
        default = {f.name: f.default for f in fields(KVSettings)}
        flags: dict[str, dict[str, Any]] = {
            "offload": dict(choices=OFFLOADS, help="hybrid: latent rows in the host pool and, while --device-kv-gib "
                                                   "has room, in resident device pages; hisparse: always offload "
                                                   "(hot working set on the device); none: all resident "
                                                   "(default: %(default)s)"),
            "layout": dict(choices=LAYOUTS, help="stored row format (default: %(default)s)"),
            "host_pool_gib": dict(type=float, help="GiB of host memory for latent rows (default: %(default)s)"),
            "device_kv_gib": dict(type=float, help="GiB of device memory for latent rows with --kv-offload hybrid "
                                                   "or hisparse: every running request's working set (resident "
                                                   "window + hot slots; a request waits while its own does not fit) "
                                                   "and, with hybrid, resident pages in the rest "
                                                   "(default: %(default)s)"),
            "hot_buffer_tokens": dict(type=int, help="hot slots per request and index group, the floor every request "
                                                     "gets (default: 2 x the model's index_topk)"),
            "resident_window": dict(type=int, help="newest tokens kept on the device "
                                                   f"(default: {DEFAULT_WINDOW})"),
            "page_tokens": dict(type=int, help="tokens per page of the host pool (of the device store with "
                                               "--kv-offload none) (default: %(default)s)"),
            "kernels": dict(choices=KERNELS, help="miss path, indexer scoring, sparse attention and the routed "
                                                  "experts as Triton kernels or torch ops; auto: triton on CUDA, "
                                                  "torch elsewhere (default: %(default)s)"),
            "index_cache": dict(choices=INDEX_CACHES, help="indexer keys on the device: fp8 = 132-B records "
                                                           "(128 x e4m3 + a power-of-two fp32 scale), fp32 = exact "
                                                           "(default: %(default)s)"),
            "enable_prefix_caching": dict(action=argparse.BooleanOptionalAction,
                                          help="keep full pages of latent rows and indexer keys cached after a "
                                               "request ends, so a request that starts with the same tokens skips "
                                               "their prefill (default: on)"),
        }
        for name in default if names is None else names:
            parser.add_argument(_flag(name), default=default[name], **flags[name])

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> KVSettings:
        """The settings of the flags `add_args` added (a field without its flag keeps its default); a
        KVSettingsError names the bad flag."""
        values = {f.name: getattr(args, _key(f.name)) for f in fields(cls) if hasattr(args, _key(f.name))}
        try:
            return cls(**values)
        except KVSettingsError as e:
            raise KVSettingsError(f"{_flag(e.field)}: {e.problem}", e.field, e.problem) from None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> KVSettings:
        """The settings of vLLM's `kv_connector_extra_config` (host_pool_gib required, no unknown keys); a
        KVSettingsError names the bad key. Checked in the API server before any engine starts, again in the
        scheduler and in each worker, so a bad value fails startup once, with one message."""
        extra = dict(extra or {})
        field_of = {_key(f.name): f.name for f in fields(cls)}
        unknown = sorted(set(extra) - set(field_of))
        if unknown:
            raise KVSettingsError(f"{EXTRA_CONFIG}: unknown key(s) {unknown}; HiSparseConnector accepts "
                                  f"{sorted(field_of)}")
        if "host_pool_gib" not in extra:
            raise KVSettingsError(f"{EXTRA_CONFIG}: 'host_pool_gib' is required (GiB of host memory for latent "
                                  "rows, e.g. {\"host_pool_gib\": 8})", "host_pool_gib", "is required")
        try:
            return cls(**{field_of[k]: v for k, v in extra.items()})
        except KVSettingsError as e:
            raise KVSettingsError(f"{EXTRA_CONFIG}: '{_key(e.field)}' {e.problem}", e.field, e.problem) from None
