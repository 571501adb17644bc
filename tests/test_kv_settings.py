"""KVSettings: defaults, validation (each message names the field as its source spells it), the CLI flags and
vLLM's kv_connector_extra_config giving the same settings, pickling, and the LatentKV `build` makes."""

from __future__ import annotations

import argparse
import math
import pickle
from pathlib import Path

import pytest
import torch

from hisparse.cli import main
from hisparse.kv.settings import KVSettings, KVSettingsError
from hisparse.kv.hisparse_kv import DEFAULT_WINDOW
from hisparse.kv.hisparse_kv import HiSparseKV
from hisparse.host_pool.layout import LAYOUTS
from hisparse.core.config import preset
from hisparse.kv.resident import ResidentKV

FIELDS = ("offload", "layout", "host_pool_gib", "device_kv_gib", "hot_buffer_tokens", "resident_window", "page_tokens")
FLAGS = {"offload": "--kv-offload", "layout": "--kv-layout", "host_pool_gib": "--host-pool-gib",
         "device_kv_gib": "--device-kv-gib",
         "hot_buffer_tokens": "--hot-buffer-tokens", "resident_window": "--resident-window",
         "page_tokens": "--page-tokens", "index_cache": "--index-cache"}
KEYS = {"offload": "kv_offload", "layout": "kv_layout"}

# (field, bad value, what the message says about it)
BAD = [
    ("offload", "gpu", "must be one of ['hybrid', 'hisparse', 'none'], got 'gpu'"),
    ("offload", None, "must be one of ['hybrid', 'hisparse', 'none'], got None"),
    ("layout", "fp16", f"must be one of {list(LAYOUTS)}, got 'fp16'"),
    ("host_pool_gib", -1, "must be a positive number of GiB, got -1"),
    ("host_pool_gib", 0, "must be a positive number of GiB, got 0"),
    ("host_pool_gib", "8", "must be a positive number of GiB, got '8'"),
    ("host_pool_gib", True, "must be a positive number of GiB, got True"),
    ("host_pool_gib", math.inf, "must be a positive number of GiB, got inf"),
    ("host_pool_gib", math.nan, "must be a positive number of GiB, got nan"),
    ("device_kv_gib", 0, "must be a positive number of GiB, got 0"),
    ("device_kv_gib", "2", "must be a positive number of GiB, got '2'"),
    ("enable_prefix_caching", "yes", "must be true or false, got 'yes'"),
    ("enable_prefix_caching", 1, "must be true or false, got 1"),
    ("hot_buffer_tokens", -1, "must be an integer >= 0, got -1"),
    ("hot_buffer_tokens", True, "must be an integer >= 0, got True"),
    ("hot_buffer_tokens", 2.0, "must be an integer >= 0, got 2.0"),
    ("resident_window", -3, "must be an integer >= 0, got -3"),
    ("page_tokens", 0, "must be an integer >= 1, got 0"),
    ("page_tokens", None, "must be an integer >= 1, got None"),
    ("index_cache", "fp16", "must be one of ['fp8', 'fp32'], got 'fp16'"),
]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    KVSettings.add_args(p)
    return p


def test_defaults() -> None:
    s = KVSettings()
    assert tuple(getattr(s, f) for f in FIELDS) == ("hybrid", "fp8_ds_mla", 4.0, 4.0, None, None, 64)
    assert s.index_cache == "fp32"
    cfg = preset("tiny")
    assert s.hot_buffer(cfg) == 2 * cfg.index_topk and s.window == DEFAULT_WINDOW == 64
    assert KVSettings(hot_buffer_tokens=0, resident_window=0).hot_buffer(cfg) == 0
    assert KVSettings(resident_window=0).window == 0
    assert KVSettings(host_pool_gib=8) == KVSettings(host_pool_gib=8.0)
    assert isinstance(KVSettings(host_pool_gib=8).host_pool_gib, float)


@pytest.mark.parametrize("field, value, problem", BAD)
def test_bad_value_names_the_field(field: str, value, problem: str) -> None:
    with pytest.raises(KVSettingsError) as e:
        KVSettings(**{field: value})
    assert str(e.value) == f"{field}: {problem}"
    assert (e.value.field, e.value.problem) == (field, problem) and isinstance(e.value, ValueError)


@pytest.mark.parametrize("field, text, problem", [
    ("host_pool_gib", "-1", "must be a positive number of GiB, got -1.0"),     # argparse made it a float
    ("host_pool_gib", "inf", "must be a positive number of GiB, got inf"),
    ("hot_buffer_tokens", "-1", "must be an integer >= 0, got -1"),
    ("resident_window", "-3", "must be an integer >= 0, got -3"),
    ("page_tokens", "0", "must be an integer >= 1, got 0"),
])
def test_bad_flag_names_the_flag(field: str, text: str, problem: str) -> None:
    args = parser().parse_args([FLAGS[field], text])
    with pytest.raises(KVSettingsError) as e:
        KVSettings.from_args(args)
    assert str(e.value) == f"{FLAGS[field]}: {problem}" and e.value.field == field


@pytest.mark.parametrize("field, value, problem", BAD)
def test_bad_extra_config_names_the_key(field: str, value, problem: str) -> None:
    extra = {"host_pool_gib": 1, KEYS.get(field, field): value}
    with pytest.raises(KVSettingsError) as e:
        KVSettings.from_extra_config(extra)
    assert str(e.value) == f"kv_connector_extra_config: '{KEYS.get(field, field)}' {problem}"


def test_extra_config_requires_the_pool_and_lists_unknown_keys() -> None:
    with pytest.raises(KVSettingsError, match=r"^kv_connector_extra_config: 'host_pool_gib' is required \(GiB"):
        KVSettings.from_extra_config(None)
    with pytest.raises(KVSettingsError) as e:
        KVSettings.from_extra_config({"host_pool_gib": 1, "pool": 2, "offload": "none"})
    assert str(e.value) == ("kv_connector_extra_config: unknown key(s) ['offload', 'pool']; HiSparseConnector "
                            "accepts ['device_kv_gib', 'enable_prefix_caching', 'host_pool_gib', 'hot_buffer_tokens', 'index_cache', "
                            "'kernels', 'kv_layout', 'kv_offload', 'page_tokens', 'resident_window']")
    with pytest.raises(KVSettingsError) as e:
        KVSettings.from_extra_config({"host_pool_gib": -1})
    assert str(e.value) == "kv_connector_extra_config: 'host_pool_gib' must be a positive number of GiB, got -1"


@pytest.mark.parametrize("values", [
    {"host_pool_gib": 4.0},
    {"offload": "none", "layout": "bf16", "host_pool_gib": 2, "hot_buffer_tokens": 16, "resident_window": 0,
     "page_tokens": 8},
    {"host_pool_gib": 0.5, "hot_buffer_tokens": 0, "resident_window": 128, "page_tokens": 256},
    {"host_pool_gib": 1.0, "index_cache": "fp8"},
])
def test_flags_and_extra_config_agree(values: dict) -> None:
    argv = [a for f, v in values.items() for a in (FLAGS[f], str(v))]
    from_flags = KVSettings.from_args(parser().parse_args(argv))
    from_extra = KVSettings.from_extra_config({KEYS.get(f, f): v for f, v in values.items()})
    assert from_flags == from_extra == KVSettings(**values)


def test_flags_default_to_the_fields_and_say_so() -> None:
    p = parser()
    assert KVSettings.from_args(p.parse_args([])) == KVSettings()
    helps = {a.option_strings[0]: a.help for a in p._actions}
    for flag in FLAGS.values():
        assert "(default: " in helps[flag], flag
    text = " ".join(p.format_help().split())
    for default in ("hybrid", "fp8_ds_mla", "4.0", "2 x the model's index_topk", "64"):
        assert f"(default: {default})" in text, default


def test_add_args_subset_keeps_the_other_defaults() -> None:
    p = argparse.ArgumentParser()
    KVSettings.add_args(p, ("layout", "page_tokens"))
    args = p.parse_args(["--kv-layout", "bf16", "--page-tokens", "32"])
    assert not hasattr(args, "host_pool_gib")
    assert KVSettings.from_args(args) == KVSettings(layout="bf16", page_tokens=32)


def test_pickles() -> None:
    s = KVSettings("none", "bf16", 2.5, 16, 8, 32)
    assert pickle.loads(pickle.dumps(s)) == s
    with pytest.raises(KVSettingsError) as e:
        KVSettings.from_extra_config({"host_pool_gib": 0})
    err = pickle.loads(pickle.dumps(e.value))
    assert (type(err), str(err), err.field, err.problem) == (KVSettingsError, str(e.value), "host_pool_gib",
                                                            e.value.problem)


def test_build_hisparse_resolves_the_defaults() -> None:
    cfg = preset("tiny")
    kv = KVSettings(host_pool_gib=0.01).build(cfg)
    assert isinstance(kv, HiSparseKV)
    assert (kv.n_slots, kv.window, kv.page_tokens, kv.pool.page_tokens) == (2 * cfg.index_topk, 64, 64, 64)
    assert kv.layout.name == "fp8_ds_mla" and kv.device == torch.device("cpu") and kv.dtype == torch.float32
    assert 0 < kv.pool.nbytes <= 0.01 * 2**30 < kv.pool.nbytes + kv.pool.page_bytes


def test_build_hisparse_with_values() -> None:
    cfg = preset("tiny")
    kv = KVSettings(layout="bf16", host_pool_gib=0.005, hot_buffer_tokens=5, resident_window=3,
                    page_tokens=16).build(cfg, "cpu", torch.float64)
    assert isinstance(kv, HiSparseKV)
    assert (kv.n_slots, kv.window, kv.page_tokens, kv.layout.name, kv.dtype) == (5, 3, 16, "bf16", torch.float64)
    assert kv.pool.page_tokens == 16 and kv.pool.nbytes <= 0.005 * 2**30


def test_build_resident() -> None:
    cfg = preset("tiny")
    kv = KVSettings(offload="none", layout="bf16", page_tokens=8).build(cfg, torch.device("cpu"), torch.float64)
    assert isinstance(kv, ResidentKV) and not isinstance(kv, HiSparseKV)
    assert (kv.page_tokens, kv.layout.name, kv.dtype, kv.token_capacity()) == (8, "bf16", torch.float64, None)


@pytest.mark.parametrize("cmd", ["generate", "serve"])
def test_cli_rejects_a_bad_kv_flag_before_loading(cmd: str, tiny_ckpt: Path) -> None:
    argv = [cmd, "--model", str(tiny_ckpt), "--resident-window", "-2"]
    with pytest.raises(SystemExit) as e:
        main(argv + (["--prompt-ids", "1"] if cmd == "generate" else []))
    assert str(e.value) == "--resident-window: must be an integer >= 0, got -2"
