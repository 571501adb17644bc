"""params.json -> ModelConfig/LayerSpec (ML4_SPEC §1.1-1.3): presets, the full layer map, and validation errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hisparse.core.config import (MOE_REQUIRED, REQUIRED_KEYS, YARN_REQUIRED, ConfigError, ModelConfig, preset,
                                  preset_params)


def tiny_with(**changes) -> dict:
    p = preset_params("tiny")
    p.update(changes)
    return p


@pytest.mark.parametrize("name", ["full", "tiny", "small"])
def test_presets_validate_and_round_trip(name: str, tmp_path: Path) -> None:
    cfg = preset(name)
    assert len(cfg.layers) == cfg.n_layers
    again = ModelConfig.from_params(cfg.to_params())
    assert again == cfg and again.layers == cfg.layers
    cfg.save(tmp_path)
    assert ModelConfig.load(tmp_path) == cfg
    assert json.loads((tmp_path / "params.json").read_text()) == cfg.to_params()


def test_spec_required_keys_are_the_loaders() -> None:
    """§1.1's list of required keys, verbatim."""
    spec = ("dim, n_layers, n_heads, vocab_size, norm_eps, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, "
            "v_head_dim, no_rope_layers, kv_source_layers, index_source_layers, index_n_heads, index_head_dim, "
            "index_topk, logit_softcap, moe, yarn")
    assert set(REQUIRED_KEYS) == set(spec.split(", "))


def test_full_layer_map() -> None:
    """§1.3: 54 RoPE + 18 NoPE, 63 KV owners + 9 consumers reading 35, 44 indexer owners + 28 sharers reading the
    nearest earlier owner, dense FFN only at layer 0."""
    cfg = preset("full")
    L = cfg.layers
    assert [s.index for s in L if not s.rope] == [i for i in range(72) if i % 4 == 3]
    assert sum(s.rope for s in L) == 54
    consumers = [s.index for s in L if not s.kv_owner]
    assert consumers == list(range(39, 72, 4)) and len(consumers) == 9
    assert all(L[i].kv_source == 35 for i in consumers)
    assert len(cfg.kv_owner_layers) == 63
    owners = cfg.index_owner_layers
    assert owners == [i for i in range(72) if i < 16 or i % 4 in (0, 3)] and len(owners) == 44
    sharers = [s for s in L if not s.index_owner]
    assert len(sharers) == 28
    assert all(s.index_source == max(o for o in owners if o < s.index) for s in sharers)
    assert all(L[i].index_owner for i in consumers) and all(s.index_owner for s in L if not s.rope)
    assert [s.index for s in L if s.ffn == "dense"] == [0]
    assert cfg.index_source_layers[16:24] == (16, 16, 16, 19, 20, 20, 20, 23)
    assert cfg.index_source_layers[-4:] == (68, 68, 68, 71)


def test_tiny_layer_map() -> None:
    """§1.2: tiny keeps every layer kind."""
    cfg = preset("tiny")
    L = cfg.layers
    assert [s.rope for s in L] == [True, True, True, False, True, True, True, False]
    assert [s.kv_source for s in L] == [0, 1, 2, 3, 4, 5, 6, 3]
    assert cfg.index_owner_layers == [0, 1, 3, 4, 7]
    assert [s.index_source for s in L if not s.index_owner] == [1, 4, 4]
    assert [s.ffn for s in L] == ["dense"] + ["moe"] * 7
    assert cfg.q_head_dim(L[0]) == 24 and cfg.q_head_dim(L[3]) == 16
    assert cfg.softmax_scale(L[0]) == pytest.approx(24 ** -0.5) and cfg.softmax_scale(L[3]) == pytest.approx(0.25)


def test_apply_scale_multiplies_tau_by_mscale_squared() -> None:
    p = preset_params("full")
    p["yarn"]["apply_scale"] = True
    cfg = ModelConfig.from_params(p)
    assert cfg.softmax_scale(cfg.layers[0]) == pytest.approx(192 ** -0.5 * 3.1061, rel=1e-4)   # §3.3: x3.106
    assert preset("full").softmax_scale(cfg.layers[3]) == pytest.approx(128 ** -0.5)


def test_optional_keys_defaults() -> None:
    p = preset_params("tiny")
    for key in ("tied_embeddings", "quantization", "mtp", "rope_theta", "ssmax", "lerope", "indexer_rope_interleave"):
        p.pop(key, None)
    p["yarn"].pop("apply_scale")
    cfg = ModelConfig.from_params(p)
    assert (cfg.tied_embeddings, cfg.quantization, cfg.mtp, cfg.yarn.apply_scale) == (False, None, None, False)
    assert cfg.rope_theta == 1e4 and cfg.indexer_rope_interleave
    for cap in (0, None):
        assert ModelConfig.from_params(tiny_with(logit_softcap=cap)).logit_softcap is None


# ------------------------------------------------------------------------------------------ invalid params.json

def raises(params: dict, *fragments: str) -> None:
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_params(params)
    for f in fragments:
        assert f in str(e.value), f"{f!r} not in {str(e.value)!r}"


@pytest.mark.parametrize("key", REQUIRED_KEYS)
def test_missing_required_key(key: str) -> None:
    p = preset_params("tiny")
    del p[key]
    raises(p, f"'{key}'")


@pytest.mark.parametrize("block,key", [("moe", k) for k in MOE_REQUIRED] + [("yarn", k) for k in YARN_REQUIRED])
def test_missing_required_subkey(block: str, key: str) -> None:
    p = preset_params("tiny")
    del p[block][key]
    raises(p, f"'{block}.{key}'")


def test_missing_hidden_dim_with_dense_layer() -> None:
    p = preset_params("tiny")
    del p["hidden_dim"]
    raises(p, "'hidden_dim'")


@pytest.mark.parametrize("key", ["kv_source_layers", "index_source_layers"])
def test_source_after_reader(key: str) -> None:
    p = preset_params("tiny")
    p[key][5] = 6
    raises(p, f"'{key}'[5]")


def test_consumer_of_consumer() -> None:
    """Layer 6 made a NoPE consumer of 3; layer 7 reading 6 reads a consumer."""
    p = tiny_with(no_rope_layers=[1, 1, 1, 0, 1, 1, 0, 0], kv_source_layers=[0, 1, 2, 3, 4, 5, 3, 6])
    raises(p, "'kv_source_layers'[7]", "layer 6", "consumer")


def test_sharer_of_sharer() -> None:
    p = tiny_with(index_source_layers=[0, 1, 1, 3, 4, 4, 5, 7])
    raises(p, "'index_source_layers'[6]", "layer 5", "indexer")


def test_rope_consumer() -> None:
    raises(tiny_with(kv_source_layers=[0, 1, 2, 3, 4, 3, 6, 3]), "'kv_source_layers'[5]", "NoPE")


def test_consumer_of_rope_layer() -> None:
    raises(tiny_with(kv_source_layers=[0, 1, 2, 3, 4, 5, 6, 4]), "'kv_source_layers'[7]", "NoPE")


@pytest.mark.parametrize("key", ["no_rope_layers", "kv_source_layers", "index_source_layers"])
def test_wrong_list_length(key: str) -> None:
    p = preset_params("tiny")
    p[key] = p[key][:-1]
    raises(p, f"'{key}'", "n_layers=8", "7")


def test_bad_rope_flag() -> None:
    raises(tiny_with(no_rope_layers=[1, 1, 2, 0, 1, 1, 1, 0]), "'no_rope_layers'[2]")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "int4"])
def test_unknown_quantization(fmt: str) -> None:
    p = tiny_with(quantization={"qformat_weight": fmt, "qscheme_weight": "BLOCK"})
    raises(p, "'quantization.qformat_weight'", fmt)


def test_unknown_preset_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="huge"):
        preset("huge")
    with pytest.raises(ConfigError, match="params.json"):
        ModelConfig.load(tmp_path)
