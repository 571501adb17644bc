"""ML4 configuration: Mistral-native params.json -> a frozen `ModelConfig` with one `LayerSpec` per layer.

Per-layer behaviour (RoPE/NoPE, KV owner/consumer, indexer owner/sharer, dense/MoE) is read from the
per-layer lists of params.json (ML4_SPEC §1.3), never from layer numbers. Presets: `full` (the real
72-layer model, for geometry only), `tiny` (§1.2, every layer kind) and `small` (a larger benchmark model).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REQUIRED_KEYS = (
    "dim", "n_layers", "n_heads", "vocab_size", "norm_eps", "kv_lora_rank", "qk_rope_head_dim",
    "qk_nope_head_dim", "v_head_dim", "no_rope_layers", "kv_source_layers", "index_source_layers",
    "index_n_heads", "index_head_dim", "index_topk", "logit_softcap", "moe", "yarn",
)
MOE_REQUIRED = ("num_experts", "num_experts_per_tok", "num_shared_experts", "first_k_dense_replace",
                "expert_hidden_dim")
YARN_REQUIRED = ("original_max_position_embeddings", "factor")
KNOWN_QUANT = {None, "fp8_e4m3"}


class ConfigError(ValueError):
    """A params.json that cannot describe a valid ML4 model; the message names the key (and layer)."""


@dataclass(frozen=True)
class YarnConfig:
    original_max_position_embeddings: int
    factor: float
    apply_scale: bool = False
    beta: float = 32.0   # beta_fast
    alpha: float = 1.0   # beta_slow


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int
    first_k_dense_replace: int
    expert_hidden_dim: int
    routed_scale: float = 1.0
    route_every_n: int = 1
    num_expert_groups: int = 1
    num_expert_groups_per_tok: int = 1
    scoring: str = "softmax"


@dataclass(frozen=True)
class MTPConfig:
    """The DSpark drafter block of params.json (`mtp`)."""
    method: str
    n_layers: int
    block_size: int
    sliding_window: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    hidden_dim: int
    kv_cache_dtype: str = "bfloat16"
    markov_head_type: str = "gated_rnn"
    sample_from_anchor: bool = True


@dataclass(frozen=True)
class QuantConfig:
    qformat_weight: str | None = None
    qscheme_weight: str | None = None
    weight_block_size: tuple[int, int] = (128, 128)
    qscheme_act: str | None = None


@dataclass(frozen=True)
class LayerSpec:
    """What one decoder layer is, derived from params.json's per-layer lists (spec §1.3)."""
    index: int
    rope: bool          # False = NoPE layer
    kv_source: int      # layer whose latent rows this layer reads (== index for a KV owner)
    index_source: int   # layer whose top-k selection this layer uses (== index for an indexer owner)
    ffn: str            # "dense" | "moe"

    @property
    def kv_owner(self) -> bool:
        return self.kv_source == self.index

    @property
    def index_owner(self) -> bool:
        return self.index_source == self.index


@dataclass(frozen=True)
class ModelConfig:
    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    norm_eps: float
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    logit_softcap: float | None
    hidden_dim: int
    max_position_embeddings: int
    rope_theta: float
    tied_embeddings: bool
    indexer_rope_interleave: bool
    ssmax_attention: bool
    ssmax_indexer: bool
    lerope_per_layer: bool
    yarn: YarnConfig
    moe: MoEConfig
    no_rope_layers: tuple[int, ...]
    kv_source_layers: tuple[int, ...]
    index_source_layers: tuple[int, ...]
    mtp: MTPConfig | None = None
    quantization: QuantConfig | None = None
    layers: tuple[LayerSpec, ...] = field(default=(), compare=False)

    # ---- derived geometry ----
    @property
    def latent_dim(self) -> int:
        """Width of one cached latent row: c (kv_lora_rank) || k_rope (qk_rope_head_dim)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def q_head_dim(self, spec: LayerSpec) -> int:
        return self.qk_nope_head_dim + (self.qk_rope_head_dim if spec.rope else 0)

    def softmax_scale(self, spec: LayerSpec) -> float:
        """tau_l = (dN + dR_l)^-1/2 (spec §3.7, §8 A2), times mscale^2 only when yarn.apply_scale (§3.3)."""
        import math
        tau = self.q_head_dim(spec) ** -0.5
        if self.yarn.apply_scale:
            tau *= (0.1 * math.log(self.yarn.factor) + 1.0) ** 2
        return tau

    @property
    def kv_owner_layers(self) -> list[int]:
        return [s.index for s in self.layers if s.kv_owner]

    @property
    def index_owner_layers(self) -> list[int]:
        return [s.index for s in self.layers if s.index_owner]

    # ---- params.json ----
    @classmethod
    def from_params(cls, params: dict[str, Any]) -> "ModelConfig":
        """Validate a params.json dict and build the config; errors name the key and layer."""
        for key in REQUIRED_KEYS:
            if key not in params:
                raise ConfigError(f"params.json: missing required key '{key}'")
        moe_d, yarn_d = params["moe"], params["yarn"]
        for key in MOE_REQUIRED:
            if key not in moe_d:
                raise ConfigError(f"params.json: missing required key 'moe.{key}'")
        for key in YARN_REQUIRED:
            if key not in yarn_d:
                raise ConfigError(f"params.json: missing required key 'yarn.{key}'")
        if moe_d.get("scoring", "softmax") != "softmax":
            raise ConfigError(f"params.json: 'moe.scoring' = {moe_d['scoring']!r} is not supported (softmax only)")
        n = int(params["n_layers"])
        lists = {}
        for key in ("no_rope_layers", "kv_source_layers", "index_source_layers"):
            val = params[key]
            if not isinstance(val, list) or len(val) != n:
                got = len(val) if isinstance(val, list) else type(val).__name__
                raise ConfigError(f"params.json: '{key}' must be a list of n_layers={n} ints, got {got}")
            lists[key] = tuple(int(v) for v in val)
        moe = MoEConfig(**{k: moe_d[k] for k in MoEConfig.__dataclass_fields__ if k in moe_d})
        if moe.first_k_dense_replace > 0 and "hidden_dim" not in params:
            raise ConfigError("params.json: missing key 'hidden_dim' (needed by the dense FFN of layer 0)")
        yarn = YarnConfig(
            original_max_position_embeddings=int(yarn_d["original_max_position_embeddings"]),
            factor=float(yarn_d["factor"]), apply_scale=bool(yarn_d.get("apply_scale", False)),
            beta=float(yarn_d.get("beta", 32.0)), alpha=float(yarn_d.get("alpha", 1.0)))
        mtp = None
        if params.get("mtp"):
            m = dict(params["mtp"])
            m["target_layer_ids"] = tuple(m["target_layer_ids"])
            try:
                mtp = MTPConfig(**{k: m[k] for k in MTPConfig.__dataclass_fields__ if k in m})
            except TypeError as e:
                raise ConfigError(f"params.json: bad 'mtp' block: {e}") from None
            for t in mtp.target_layer_ids:
                if not 0 <= t < n:
                    raise ConfigError(f"params.json: 'mtp.target_layer_ids' names layer {t}, outside 0..{n - 1}")
        quant = None
        if params.get("quantization"):
            q = params["quantization"]
            if q.get("qformat_weight") not in KNOWN_QUANT:
                raise ConfigError(f"params.json: 'quantization.qformat_weight' = {q.get('qformat_weight')!r} is "
                                  "not supported (only fp8_e4m3 block-scaled checkpoints can be loaded)")
            quant = QuantConfig(qformat_weight=q.get("qformat_weight"), qscheme_weight=q.get("qscheme_weight"),
                                weight_block_size=tuple(q.get("weight_block_size", (128, 128))),
                                qscheme_act=q.get("qscheme_act"))
        ssmax = params.get("ssmax", {"attention": True, "indexer": True})
        softcap = params["logit_softcap"]
        cfg = cls(
            dim=int(params["dim"]), n_layers=n, n_heads=int(params["n_heads"]),
            vocab_size=int(params["vocab_size"]), norm_eps=float(params["norm_eps"]),
            kv_lora_rank=int(params["kv_lora_rank"]), qk_rope_head_dim=int(params["qk_rope_head_dim"]),
            qk_nope_head_dim=int(params["qk_nope_head_dim"]), v_head_dim=int(params["v_head_dim"]),
            index_n_heads=int(params["index_n_heads"]), index_head_dim=int(params["index_head_dim"]),
            index_topk=int(params["index_topk"]), logit_softcap=float(softcap) if softcap else None,
            hidden_dim=int(params.get("hidden_dim", 0)),
            max_position_embeddings=int(params.get(
                "max_position_embeddings", yarn.original_max_position_embeddings * yarn.factor)),
            rope_theta=float(params.get("rope_theta", 10000.0)),
            tied_embeddings=bool(params.get("tied_embeddings", False)),
            indexer_rope_interleave=bool(params.get("indexer_rope_interleave", True)),
            ssmax_attention=bool(ssmax.get("attention", True)), ssmax_indexer=bool(ssmax.get("indexer", True)),
            lerope_per_layer=bool(params.get("lerope", {}).get("per_layer", False)),
            yarn=yarn, moe=moe, mtp=mtp, quantization=quant, **lists)
        object.__setattr__(cfg, "layers", build_layer_specs(cfg))
        if cfg.index_head_dim < cfg.qk_rope_head_dim:
            raise ConfigError("params.json: 'index_head_dim' must be >= 'qk_rope_head_dim' (rope on its first dims)")
        return cfg

    def to_params(self) -> dict[str, Any]:
        """The params.json dict this config was built from (round-trips through from_params)."""
        d = asdict(self)
        d.pop("layers")
        d["ssmax"] = {"attention": d.pop("ssmax_attention"), "indexer": d.pop("ssmax_indexer")}
        d["lerope"] = {"per_layer": d.pop("lerope_per_layer")}
        for key in ("no_rope_layers", "kv_source_layers", "index_source_layers"):
            d[key] = list(d[key])
        if d["mtp"] is None:
            d.pop("mtp")
        else:
            d["mtp"]["target_layer_ids"] = list(d["mtp"]["target_layer_ids"])
        if d["quantization"] is None:
            d.pop("quantization")
        else:
            d["quantization"]["weight_block_size"] = list(d["quantization"]["weight_block_size"])
        return d

    @classmethod
    def load(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "params.json"
        if not path.exists():
            raise ConfigError(f"{path}: params.json not found")
        return cls.from_params(json.loads(path.read_text()))

    def save(self, model_dir: str | Path) -> None:
        (Path(model_dir) / "params.json").write_text(json.dumps(self.to_params(), indent=2))


def build_layer_specs(cfg: ModelConfig) -> tuple[LayerSpec, ...]:
    """One LayerSpec per layer, validated by the rules of spec §1.3."""
    specs = []
    for i in range(cfg.n_layers):
        rope_flag = cfg.no_rope_layers[i]
        if rope_flag not in (0, 1):
            raise ConfigError(f"params.json: 'no_rope_layers'[{i}] = {rope_flag}, must be 0 (NoPE) or 1 (RoPE)")
        ffn = "dense" if i < cfg.moe.first_k_dense_replace else "moe"
        specs.append(LayerSpec(i, bool(rope_flag), cfg.kv_source_layers[i], cfg.index_source_layers[i], ffn))
    for s in specs:
        i = s.index
        for key, src in (("kv_source_layers", s.kv_source), ("index_source_layers", s.index_source)):
            if not 0 <= src <= i:
                raise ConfigError(f"params.json: '{key}'[{i}] = {src}: a source layer must be in 0..{i} "
                                  "(not after the layer that reads it)")
        if not specs[s.kv_source].kv_owner:
            raise ConfigError(f"params.json: 'kv_source_layers'[{i}] = {s.kv_source}: layer {s.kv_source} is "
                              "itself a KV consumer, not a KV owner")
        if not specs[s.index_source].index_owner:
            raise ConfigError(f"params.json: 'index_source_layers'[{i}] = {s.index_source}: layer "
                              f"{s.index_source} does not own an indexer")
        if not s.kv_owner and (s.rope or specs[s.kv_source].rope):
            raise ConfigError(f"params.json: 'kv_source_layers'[{i}] = {s.kv_source}: a KV consumer and its "
                              "source must both be NoPE layers ('no_rope_layers' = 0)")
    return tuple(specs)


# ---------------------------------------------------------------------------------------------- presets

def _full_params() -> dict[str, Any]:
    n = 72
    owner = [i < 16 or i % 4 in (0, 3) for i in range(n)]
    index_src, last = [], 0
    for i in range(n):
        last = i if owner[i] else last
        index_src.append(last)
    return {
        "dim": 6144, "n_layers": n, "n_heads": 64, "n_kv_heads": 64, "vocab_size": 204800, "norm_eps": 1e-6,
        "tied_embeddings": False, "hidden_dim": 16384, "max_position_embeddings": 1048576, "rope_theta": 10000.0,
        "q_lora_rank": None, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "yarn": {"original_max_position_embeddings": 512, "factor": 2048, "apply_scale": False,
                 "beta": 32, "alpha": 1},
        "no_rope_layers": [0 if i % 4 == 3 else 1 for i in range(n)],
        "kv_source_layers": [35 if (i >= 39 and i % 4 == 3) else i for i in range(n)],
        "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048, "index_source_layers": index_src,
        "indexer_rope_interleave": True, "ssmax": {"attention": True, "indexer": True},
        "lerope": {"per_layer": False}, "logit_softcap": 30.0,
        "moe": {"num_experts": 128, "num_experts_per_tok": 4, "num_shared_experts": 1, "first_k_dense_replace": 1,
                "route_every_n": 1, "expert_hidden_dim": 6144, "routed_scale": 1.0, "num_expert_groups": 1,
                "num_expert_groups_per_tok": 1, "scoring": "softmax"},
        "quantization": {"qformat_weight": "fp8_e4m3", "qscheme_weight": "BLOCK", "weight_block_size": [128, 128],
                         "qscheme_act": "NO_SCALES"},
        "mtp": {"method": "dspark", "n_layers": 3, "block_size": 3, "sliding_window": 2048,
                "kv_cache_dtype": "bfloat16", "target_layer_ids": [1, 18, 36, 54, 71], "markov_rank": 512,
                "markov_head_type": "gated_rnn", "hidden_dim": 16384, "sample_from_anchor": True},
    }


def _tiny_params() -> dict[str, Any]:
    return {
        "dim": 64, "n_layers": 8, "n_heads": 4, "n_kv_heads": 4, "vocab_size": 512, "norm_eps": 1e-6,
        "tied_embeddings": False, "hidden_dim": 128, "max_position_embeddings": 256, "rope_theta": 10000.0,
        "q_lora_rank": None, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
        "yarn": {"original_max_position_embeddings": 64, "factor": 4, "apply_scale": False, "beta": 32, "alpha": 1},
        "no_rope_layers": [1, 1, 1, 0, 1, 1, 1, 0], "kv_source_layers": [0, 1, 2, 3, 4, 5, 6, 3],
        "index_n_heads": 2, "index_head_dim": 16, "index_topk": 8, "index_source_layers": [0, 1, 1, 3, 4, 4, 4, 7],
        "indexer_rope_interleave": True, "ssmax": {"attention": True, "indexer": True},
        "lerope": {"per_layer": False}, "logit_softcap": 30.0,
        "moe": {"num_experts": 8, "num_experts_per_tok": 2, "num_shared_experts": 1, "first_k_dense_replace": 1,
                "route_every_n": 1, "expert_hidden_dim": 32, "routed_scale": 1.0, "num_expert_groups": 1,
                "num_expert_groups_per_tok": 1, "scoring": "softmax"},
        "mtp": {"method": "dspark", "n_layers": 3, "block_size": 3, "sliding_window": 16,
                "kv_cache_dtype": "bfloat16", "target_layer_ids": [1, 2, 4, 6, 7], "markov_rank": 16,
                "markov_head_type": "gated_rnn", "hidden_dim": 128, "sample_from_anchor": True},
    }


def _small_params() -> dict[str, Any]:
    p = _tiny_params()
    p.update({"dim": 256, "n_heads": 8, "n_kv_heads": 8, "hidden_dim": 512, "kv_lora_rank": 128,
              "qk_rope_head_dim": 32, "qk_nope_head_dim": 64, "v_head_dim": 64, "index_n_heads": 4,
              "index_head_dim": 64, "index_topk": 64, "max_position_embeddings": 1048576})
    p["moe"] = dict(p["moe"], expert_hidden_dim=128)
    p["mtp"] = dict(p["mtp"], sliding_window=128, markov_rank=64, hidden_dim=512)
    return p


PRESETS = {"full": _full_params, "tiny": _tiny_params, "small": _small_params}


def preset_params(name: str) -> dict[str, Any]:
    """A fresh params.json dict for a named preset."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()


def preset(name: str) -> ModelConfig:
    return ModelConfig.from_params(preset_params(name))
