"""The retrieval model and its training recipe: params.json of the tiny ML4 that `train-needle` trains, and the
stage schedule (what is trained at which lengths, for how many steps)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TOKENIZER_WORDS = 1256     # 1000 special slots + the 256 byte tokens: one token per character of ASCII text


def retrieval_params(rope_theta: float, yarn_factor: int) -> dict[str, Any]:
    """A 4-layer, dim-128 ML4 (~1.3M parameters): RoPE layers 0-2 and NoPE layer 3, each with its own latent KV
    and lightning indexer (top-64), SSMax in attention and indexers, YaRN over an original length of 64 with the
    given theta and factor (`Recipe` holds the choice); dense SwiGLU FFNs (first_k_dense_replace covers every
    layer, so the MoE block is inert)."""
    n = 4
    return {
        "dim": 128, "n_layers": n, "n_heads": 4, "n_kv_heads": 4, "vocab_size": TOKENIZER_WORDS, "norm_eps": 1e-6,
        "tied_embeddings": False, "hidden_dim": 384, "max_position_embeddings": 1 << 20, "rope_theta": rope_theta,
        "q_lora_rank": None, "kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
        "yarn": {"original_max_position_embeddings": 64, "factor": yarn_factor, "apply_scale": False, "beta": 32,
                 "alpha": 1},
        "no_rope_layers": [0 if i % 4 == 3 else 1 for i in range(n)], "kv_source_layers": list(range(n)),
        "index_n_heads": 4, "index_head_dim": 32, "index_topk": 64, "index_source_layers": list(range(n)),
        "indexer_rope_interleave": True, "ssmax": {"attention": True, "indexer": True},
        "lerope": {"per_layer": False}, "logit_softcap": 30.0,
        "moe": {"num_experts": 2, "num_experts_per_tok": 1, "num_shared_experts": 1, "first_k_dense_replace": n,
                "route_every_n": 1, "expert_hidden_dim": 32, "routed_scale": 1.0, "num_expert_groups": 1,
                "num_expert_groups_per_tok": 1, "scoring": "softmax"},
    }


@dataclass(frozen=True)
class Gate:
    """When a stage is done: the mean teacher-forced answer exact match over its last `window` steps reaches
    `target`. Until then the stage runs another round of `retry_steps` (fresh optimizer, warm-up and cosine, from
    the round's checkpoint), at most `retries` more. Grokking is a chance event (the shipped run's sparse-copy
    retrieved after ~300 steps, a re-run's after ~550), so fixed step counts leave a late run unconverged."""
    target: float
    window: int
    retry_steps: int
    retries: int = 2

    def met(self, exact: list[float]) -> bool:
        """Whether a stage whose steps scored `exact` (in order) is done."""
        last = exact[-self.window:]
        return len(last) == self.window and sum(last) / self.window >= self.target


@dataclass(frozen=True)
class Stage:
    name: str
    steps: int
    min_chars: int          # haystack length range, sampled log-uniformly (characters = byte tokens)
    max_chars: int
    sparse: bool            # attend over each layer's top-k (else dense causal)
    lr: float
    echoes: tuple[int, ...] = (0,)   # extra needle copies per sequence, drawn from these (see sample_prompt)
    warmup: int | None = None        # linear warm-up steps (None: the recipe's)
    topk_only: bool = False          # sparse via topk_forward: O(T k), indexer KL over Sel(t) + recent keys
    threads: int = 1                 # torch threads: part of the recipe, because the thread count changes how
                                     # torch splits reductions, hence the weights (the long stages ran on 2)
    gate: Gate | None = None         # None: one round of `steps`
    lerope_alpha: tuple[float, ...] | None = None   # LeRoPE alpha [dR/2] set by each step of the stage's first
                                     # round (a LongRoPE-style rescale of the slowest pairs), then kept from its
                                     # checkpoint: training never updates alpha
    lerope_ramp: int = 0             # > 0: alpha moves linearly over the first round's first `lerope_ramp` steps,
                                     # from the previous stages' setting to `lerope_alpha`, so the model follows it
    answer_kl: float = 0.0           # topk_only, frozen: weight of the answer queries' mean indexer KL, added to
                                     # the all-query mean (which gives the ~10 answer queries of a 128k sequence
                                     # ~1e-4)
    frozen: bool = False             # each round caches one haystack of max_chars characters and each step trains
                                     # a needle, the question and the answer live in it (prefix_forward): the
                                     # answer's queries select among a haystack no full forward could train on
    replay: Stage | None = None      # frozen: a short-prompt stage, one batch of which each step also trains on
                                     # (its loss added), so what the short prompts need stays while the answer
                                     # learns a million keys


FIRST_STAGES = (
    Stage("copy", 600, 16, 384, False, 2e-3, (1, 2, 3)),
    Stage("sparse-copy", 700, 48, 1024, True, 1.5e-3, (0, 1, 2), gate=Gate(0.97, 100, 300)),
    Stage("sparse-long", 300, 256, 3072, True, 7e-4, (0, 0, 1), gate=Gate(0.97, 100, 200)),
    Stage("sparse-8k", 30, 2048, 8192, True, 5e-4, warmup=6, gate=Gate(0.875, 8, 16)),
    Stage("sparse-32k", 40, 8192, 32768, True, 5e-4, warmup=6, topk_only=True, threads=2, gate=Gate(0.875, 8, 20)),
    Stage("sparse-36k", 24, 16384, 36864, True, 3e-4, warmup=4, topk_only=True, threads=2, gate=Gate(0.875, 8, 12)),
    Stage("sparse-40k", 30, 24576, 40960, True, 2e-4, warmup=4, topk_only=True, threads=2, gate=Gate(0.875, 8, 15)),
)   # the shipped checkpoint (checkpoints/needle-ml4) is these stages

# Pairs 4-7 (wavelengths 157, 447, 795 and 1,413 tokens) stretched to ~850, 3.9k, 15k and 69k: the margin
# benchmarks/needle/rope_margin.py allows at 128k grows from 0.044 to 0.175, while pairs 0-3 (6-64 tokens) keep the
# local copying the short stages taught. It is 3/4 of the way (in alpha) to ~1.5k, 8k, 40k and 256k (margin 0.240),
# as far as a ramp of those four kept every answer exact (docs/needle-model.md, "A ramped stretch"). Values are
# exact in bf16, the checkpoint's dtype.
RAMPED_ALPHA = (0.0, 0.0, 0.0, 0.0, -1.6875, -2.15625, -2.9375, -3.890625)

# the slow pairs stretched step by step at up to 16k, settled at up to 40k, then 128k and its longer part
LEROPE_RAMP = (
    Stage("ramp-16k", 60, 2048, 16384, True, 2e-4, warmup=6, topk_only=True, threads=2,
          gate=Gate(0.875, 8, 20), lerope_alpha=RAMPED_ALPHA, lerope_ramp=30),
    Stage("ramped-40k", 40, 8192, 40960, True, 2e-4, warmup=4, topk_only=True, threads=2,
          gate=Gate(0.875, 8, 15)),
    Stage("ramped-128k", 30, 32768, 131072, True, 2e-4, warmup=4, topk_only=True, threads=2,
          gate=Gate(0.875, 8, 15)),
    # the longer part of 128k (48k-128k characters, log-uniform), where ramped-128k's misses are
    Stage("held-128k", 30, 49152, 131072, True, 2e-4, warmup=4, topk_only=True, threads=2,
          gate=Gate(0.875, 8, 15)),
    # at 128k the answer queries' local indexer (layer 2) fills its top-k with far keys and drops the newest
    # ones the copy needs (docs/needle-model.md, "The missing newest keys are the cause"): their indexer KL
    # weighted as much as all other queries together
    Stage("answer-128k", 24, 98304, 139264, True, 1.5e-4, warmup=3, topk_only=True, threads=2,
          gate=Gate(0.875, 8, 12), answer_kl=1.0),
)

# what a frozen stage's steps also train on: prompts of 6k-40k characters, as ramped-40k's with answer_kl
REPLAY_40K = Stage("replay-40k", 1, 6144, 40960, True, 1e-4, topk_only=True, threads=2, answer_kl=1.0)

LONG_STAGES: dict[str, tuple[Stage, ...]] = {
    # one stage at up to 128k on the shipped frequencies
    "sparse-128k": (
        Stage("sparse-128k", 30, 32768, 131072, True, 2e-4, warmup=4, topk_only=True, threads=2,
              gate=Gate(0.875, 8, 15)),
    ),
    "lerope-ramp": LEROPE_RAMP,
    # then the answer's queries trained among half a million, then a million tokens of haystack, one haystack
    # cached per round (docs/needle-model.md, "Frozen-haystack training"): rounds of 8 steps, so that a stage reads
    # many haystacks (24 steps on one 1M haystack gained little on the next one)
    "frozen-1m": LEROPE_RAMP + (
        Stage("frozen-512k", 8, 524_000, 524_000, True, 1e-4, warmup=2, threads=2, gate=Gate(0.875, 8, 8, 15),
              answer_kl=1.0, frozen=True),
        Stage("frozen-1m", 8, 1_048_000, 1_048_000, True, 1e-4, warmup=2, threads=2, gate=Gate(0.875, 8, 8, 3),
              answer_kl=1.0, frozen=True),
        # the rounds above cost the short prompts a few answers (teacher-forced at 8k and 32k: 14 and 13 of 16,
        # against 15 and 16 for the weights they start from); from here each step also trains one batch of
        # 6k-40k characters
        Stage("frozen-1m-replay", 8, 1_048_000, 1_048_000, True, 1e-4, warmup=2, threads=2,
              gate=Gate(0.875, 8, 8, 15), answer_kl=1.0, frozen=True, replay=REPLAY_40K),
    ),
}


@dataclass(frozen=True)
class Recipe:
    seed: int = 0
    stages: tuple[Stage, ...] = FIRST_STAGES + LONG_STAGES["sparse-128k"]
    tokens_per_batch: int = 3072       # sequences of one length per batch, as many as fit
    answer_weight: float = 2.0         # the answer's mean CE is added to the all-token mean CE with this weight
    index_weight: float = 1.0
    kl_recent_keys: int = 64           # topk_only stages: the newest keys the indexer KL adds to Sel(t)
    warmup: int = 100                  # linear warm-up steps of a stage (unless it sets its own)
    clip: float = 1.0
    # RoPE frequencies (8 pairs). theta 100, x4 keeps every wavelength (6 .. 1,413 tokens) inside the training
    # lengths, so no rotation angle is new at 128k, but with 8 short wavelengths far distances repeat the phases
    # of near ones (docs/needle-model.md, "Why 128k breaks"). benchmarks/needle/rope_margin.py rates a choice by
    # how far an indexer can rank the 16 newest keys above every far one.
    rope_theta: float = 100.0
    yarn_factor: int = 4

    def params(self) -> dict[str, Any]:
        """params.json of the model this recipe trains."""
        return retrieval_params(self.rope_theta, self.yarn_factor)
