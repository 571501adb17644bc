"""ML4 against an independent naive fp64 reference written from ML4_SPEC §3 (spec §9 items 1 and 3).

The reference below uses only the config's raw per-layer lists and the weights (model.state_dict()); none of
hisparse.model's math. It computes per-head K/V explicitly (kN = W_UK c, v = W_UV c), rotates with complex
numbers, picks the indexer top-k with a plain Python sort on (score desc, position asc), attends densely with a
mask of the selected set and routes the MoE token by token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from conftest import full_forward, random_tokens, selection_sets, sharpen, tiny_model
from hisparse.core.config import ModelConfig
from hisparse.model.ml4 import ML4

pytestmark = pytest.mark.usefixtures("single_thread")
T = 48   # > index_topk = 8: every indexer really selects


# ------------------------------------------------------------------------------------------ reference math

def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def ref_frequencies(cfg: ModelConfig, alpha: torch.Tensor) -> torch.Tensor:
    """omega_j of §3.3 (YaRN + LeRoPE), fp64 [dR/2]."""
    d, theta, y = cfg.qk_rope_head_dim, cfg.rope_theta, cfg.yarn

    def corr(n: float) -> float:
        return d * math.log(y.original_max_position_embeddings / (2 * math.pi * n)) / (2 * math.log(theta))

    lo = max(math.floor(corr(y.beta)), 0)
    hi = min(math.ceil(corr(y.alpha)), d - 1)
    hi = hi + 0.001 if lo == hi else hi
    out = []
    for j in range(d // 2):
        w0 = theta ** (-2 * j / d)
        rho = min(max((j - lo) / (hi - lo), 0.0), 1.0)
        out.append(((1 - rho) * w0 + rho * w0 / y.factor) * math.exp(float(alpha[j])))
    return torch.tensor(out, dtype=torch.float64)


def rotate(u: torch.Tensor, pos: torch.Tensor, omega: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    """R(p) u on the last dim as complex multiplication: pair j is (u_2j, u_2j+1) or (u_j, u_j+d/2) (NeoX)."""
    d = u.shape[-1]
    if interleaved:
        z = torch.complex(u[..., 0::2], u[..., 1::2])
    else:
        z = torch.complex(u[..., : d // 2], u[..., d // 2:])
    phase = torch.polar(torch.ones_like(omega), pos.double()[:, None] * omega[None, :])   # [T, d/2]
    z = z * phase.view(phase.shape[0], *([1] * (u.dim() - 2)), d // 2)
    if interleaved:
        return torch.stack((z.real, z.imag), dim=-1).flatten(-2)
    return torch.cat((z.real, z.imag), dim=-1)


def swiglu(y: torch.Tensor, sd: dict, prefix: str) -> torch.Tensor:
    a = y @ sd[prefix + "w1.weight"].T
    return (a * torch.sigmoid(a) * (y @ sd[prefix + "w3.weight"].T)) @ sd[prefix + "w2.weight"].T


def ssmax(sd: dict, name: str, pos: torch.Tensor) -> torch.Tensor:
    """g_h(p) = s_h ln(p + 1) + b_h: [T, H, 1]."""
    s, b = sd[name][:, 0], sd[name][:, 1]
    return (s[None, :] * torch.log(pos.double() + 1)[:, None] + b[None, :])[..., None]


@dataclass
class Mutation:
    """Deliberate reference bugs, to show the comparison can fail."""
    lerope_sign: float = 1.0       # -1: divide by exp(alpha) instead of multiplying
    ssmax: bool = True
    absorbed_scale: float = 1.0    # multiplies tau


@dataclass
class RefOut:
    logits: torch.Tensor                                            # [T, V]
    selections: dict[int, list[list[int]]] = field(default_factory=dict)


def ref_latents(cfg: ModelConfig, sd: dict, l: int, x: torch.Tensor, pos: torch.Tensor, omega: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KV owner l: c = RMSNorm(a[:r]) [T, r], kR = R(p) a[r:] [T, dR] (None on NoPE)."""
    r = cfg.kv_lora_rank
    a = x @ sd[f"layers.{l}.attention.wkv_a_with_mqa.weight"].T
    c = rms_norm(a[:, :r], sd[f"layers.{l}.attention.kv_a_norm.weight"], cfg.norm_eps)
    return c, (rotate(a[:, r:], pos, omega) if cfg.no_rope_layers[l] == 1 else None)


def ref_indexer(cfg: ModelConfig, sd: dict, l: int, x: torch.Tensor, pos: torch.Tensor, omega: torch.Tensor
                ) -> list[list[int]]:
    """Lightning indexer of owner layer l (§3.6) and its top-k by a plain sort: per query, sorted positions."""
    p = f"layers.{l}.attention.indexer."
    HI, dI, dR = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    Q = (layer_norm(x, sd[p + "q_norm.weight"], sd[p + "q_norm.bias"]) @ sd[p + "wq_b.weight"].T).view(-1, HI, dI)
    K = layer_norm(x @ sd[p + "wk.weight"].T, sd[p + "k_norm.weight"], sd[p + "k_norm.bias"])
    if cfg.no_rope_layers[l] == 1:
        il = cfg.indexer_rope_interleave
        Q = torch.cat((rotate(Q[..., :dR], pos, omega, il), Q[..., dR:]), dim=-1)
        K = torch.cat((rotate(K[..., :dR], pos, omega, il), K[..., dR:]), dim=-1)
    if cfg.ssmax_indexer:
        Q = Q * ssmax(sd, p + "ssmax_scaling", pos)
    w = x @ sd[p + "weights_proj.weight"].T                                           # [T, HI]
    scores = torch.einsum("th,ths->ts", w / math.sqrt(HI),
                          torch.relu(torch.einsum("thd,sd->ths", Q, K) / math.sqrt(dI)))
    sels = []
    for t in range(x.shape[0]):
        cand = sorted(range(int(pos[t]) + 1), key=lambda s: (-float(scores[t, s]), s))
        sels.append(sorted(cand[: cfg.index_topk]))
    return sels


def ref_attention(cfg: ModelConfig, sd: dict, l: int, x: torch.Tensor, c: torch.Tensor, kR: torch.Tensor | None,
                  pos: torch.Tensor, omega: torch.Tensor, sel: list[list[int]], mut: Mutation = Mutation()
                  ) -> torch.Tensor:
    """Naive MLA (§3.5, §3.7) of layer l over latents (c, kR) of its KV source, masked to `sel`: [T, D]."""
    H, dN, dR, dV = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    rope = cfg.no_rope_layers[l] == 1
    p = f"layers.{l}.attention."
    q = (x @ sd[p + "wq.weight"].T).view(x.shape[0], H, -1)
    qN, qR = q[..., :dN], (rotate(q[..., dN:], pos, omega) if rope else None)
    if cfg.ssmax_attention and mut.ssmax:
        g = ssmax(sd, p + "ssmax_scaling", pos)
        qN, qR = qN * g, (qR * g if rope else None)
    W = sd[p + "wkv_b.weight"].view(H, dN + dV, cfg.kv_lora_rank)
    kN = torch.einsum("hdc,sc->shd", W[:, :dN], c)                                   # [S, H, dN]
    v = torch.einsum("hvc,sc->shv", W[:, dN:], c)                                    # [S, H, dV]
    logits = torch.einsum("thd,shd->ths", qN, kN)
    if rope:
        logits = logits + torch.einsum("thd,sd->ths", qR, kR)
    tau = (dN + (dR if rope else 0)) ** -0.5 * mut.absorbed_scale
    if cfg.yarn.apply_scale:
        tau *= (0.1 * math.log(cfg.yarn.factor) + 1) ** 2
    mask = torch.zeros(x.shape[0], c.shape[0], dtype=torch.bool)
    for t, s in enumerate(sel):
        mask[t, s] = True
    P = torch.softmax((tau * logits).masked_fill(~mask[:, None, :], float("-inf")), dim=-1)
    o = torch.einsum("ths,shv->thv", P, v)
    return o.flatten(1) @ sd[p + "wo.weight"].T


def ref_moe(cfg: ModelConfig, sd: dict, l: int, y: torch.Tensor) -> torch.Tensor:
    """Softmax router, top-k by (prob desc, id asc), renormalised gates, routed + shared experts; token by token."""
    m, p = cfg.moe, f"layers.{l}.moe."
    out = []
    for t in range(y.shape[0]):
        probs = torch.softmax(sd[p + "gate.weight"] @ y[t], dim=0).tolist()
        top = sorted(range(m.num_experts), key=lambda e: (-probs[e], e))[: m.num_experts_per_tok]
        total = sum(probs[e] for e in top)
        routed = sum(probs[e] / total * swiglu(y[t:t + 1], sd, f"{p}experts.{e}.") for e in top)
        out.append(m.routed_scale * routed + swiglu(y[t:t + 1], sd, p + "shared_experts."))
    return torch.cat(out)


def alpha_of(sd: dict, l: int) -> torch.Tensor:
    """LeRoPE alpha of layer l: its own `layers.l.attention.lerope.alpha` if present, else the global one."""
    return sd.get(f"layers.{l}.attention.lerope.alpha", sd["lerope.alpha"])


def reference_forward(model: ML4, tokens: torch.Tensor, mut: Mutation = Mutation()) -> RefOut:
    """The whole ML4 forward (§3.1) of one sequence at positions 0..T-1, in fp64."""
    cfg = model.cfg
    sd = {k: v.detach().double() for k, v in model.state_dict().items()}
    pos = torch.arange(len(tokens))
    h = sd["tok_embeddings.weight"][tokens]
    latents: dict[int, tuple] = {}
    out = RefOut(torch.empty(0))
    for l in range(cfg.n_layers):
        omega = ref_frequencies(cfg, mut.lerope_sign * alpha_of(sd, l))
        x = rms_norm(h, sd[f"layers.{l}.attention_norm.weight"], cfg.norm_eps)
        if cfg.kv_source_layers[l] == l:
            latents[l] = ref_latents(cfg, sd, l, x, pos, omega)
        if cfg.index_source_layers[l] == l:
            out.selections[l] = ref_indexer(cfg, sd, l, x, pos, omega)
        else:
            out.selections[l] = out.selections[cfg.index_source_layers[l]]
        c, kR = latents[cfg.kv_source_layers[l]]
        h = h + ref_attention(cfg, sd, l, x, c, kR, pos, omega, out.selections[l], mut)
        y = rms_norm(h, sd[f"layers.{l}.ffn_norm.weight"], cfg.norm_eps)
        h = h + (swiglu(y, sd, f"layers.{l}.feed_forward.") if l < cfg.moe.first_k_dense_replace
                 else ref_moe(cfg, sd, l, y))
    w_out = sd["tok_embeddings.weight"] if cfg.tied_embeddings else sd["output.weight"]
    z = rms_norm(h, sd["norm.weight"], cfg.norm_eps) @ w_out.T
    cap = cfg.logit_softcap
    out.logits = cap * torch.tanh(z / cap) if cap else z
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# ------------------------------------------------------------------------------------------ tests

VARIANTS = {
    "spec": {},
    "apply_scale": {"yarn": {"apply_scale": True}},
    "neox_indexer": {"indexer_rope_interleave": False},
    "lerope_per_layer_tied": {"lerope": {"per_layer": True}, "tied_embeddings": True},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_matches_naive_reference(variant: str, seed: int) -> None:
    model = tiny_model(seed, **VARIANTS[variant])
    tokens = random_tokens(T, model.cfg.vocab_size, seed)
    logits, trace = full_forward(model, tokens)
    ref = reference_forward(model, tokens)
    err = rel_err(logits, ref.logits)
    print(f"[seed {seed}] {variant}: max relative logit error vs naive fp64 reference = {err:.3e}")
    assert logits.dtype == torch.float64
    assert ref.logits.abs().max() > 10, "logits must reach the soft cap's non-linear range"
    assert err < 1e-10, f"seed {seed}: {variant} logits differ from the reference by {err:.3e}"
    for l in range(model.cfg.n_layers):
        assert selection_sets(trace.selections[l][0]) == ref.selections[l], f"seed {seed}: layer {l} selection"
    # T > k: every owner layer really chooses (k of t + 1 keys, not a fixed window)
    for l in model.cfg.index_owner_layers:
        sels = ref.selections[l]
        assert all(len(s) == 8 for s in sels[8:])
        assert any(s != list(range(t - 7, t + 1)) for t, s in enumerate(sels) if t >= 8)


@pytest.mark.parametrize("mut", [Mutation(lerope_sign=-1.0), Mutation(ssmax=False), Mutation(absorbed_scale=1.1)],
                         ids=["lerope_divide", "no_ssmax", "tau_x1.1"])
def test_reference_comparison_can_fail(mut: Mutation, seed: int) -> None:
    """The test set-up is sensitive: a plausible bug in the reference moves the logits far beyond tolerance."""
    model = tiny_model(seed)
    tokens = random_tokens(T, model.cfg.vocab_size, seed)
    logits, _ = full_forward(model, tokens)
    assert rel_err(logits, reference_forward(model, tokens, mut).logits) > 1e-3


def capture_attention(model: ML4, tokens: torch.Tensor) -> tuple[dict, dict]:
    """Run the model and record each layer's attention input x [T, D] and output [T, D] (forward hooks)."""
    io: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = [layer.attention.register_forward_hook(
        lambda mod, args, out, l=l: io.__setitem__(l, (args[0].clone(), out.clone())))
        for l, layer in enumerate(model.layers)]
    try:
        _, trace = full_forward(model, tokens)
    finally:
        for hk in hooks:
            hk.remove()
    return io, trace.selections


# layer kinds of the tiny preset (§1.2): RoPE owner, NoPE owner, NoPE consumer 7 reading 3, sharers 2 / 5 (RoPE)
KINDS = {"rope_owner": 1, "nope_owner": 3, "consumer_7_reads_3": 7, "sharer_2_of_1": 2, "sharer_5_of_4": 5}


@pytest.mark.parametrize("kind", list(KINDS))
def test_absorbed_mla_equals_naive_per_layer_kind(kind: str, seed: int) -> None:
    """§9.1: the model's absorbed attention == naive per-head K/V attention on the same input and selection."""
    model = tiny_model(seed)
    cfg, l = model.cfg, KINDS[kind]
    sd = {k: v.double() for k, v in model.state_dict().items()}
    tokens = random_tokens(T, cfg.vocab_size, seed)
    io, sels = capture_attention(model, tokens)
    src = cfg.kv_source_layers[l]
    assert (src != l) == kind.startswith("consumer")
    assert cfg.no_rope_layers[l] == (0 if kind.startswith(("nope", "consumer")) else 1)
    pos = torch.arange(T)
    omega = ref_frequencies(cfg, sd["lerope.alpha"])
    c, kR = ref_latents(cfg, sd, src, io[src][0], pos, omega)          # latents from the source layer's input
    sel = selection_sets(sels[l][0])
    naive = ref_attention(cfg, sd, l, io[l][0], c, kR, pos, omega, sel)
    err = rel_err(io[l][1], naive)
    assert err < 1e-11, f"seed {seed}: layer {l} ({kind}) absorbed vs naive {err:.3e}"
    # a consumer that computed latents from its own input (as if it owned KV) would fail the same check
    if src != l:
        c_own, _ = ref_latents(cfg, sd, src, io[l][0], pos, omega)
        assert rel_err(io[l][1], ref_attention(cfg, sd, l, io[l][0], c_own, None, pos, omega, sel)) > 1e-3


def test_index_sharers_attend_over_owner_selection(seed: int) -> None:
    """§9.3: sharers 2, 5, 6 reuse Sel_1, Sel_4, Sel_4 (the same object) and carry no indexer of their own; their
    attention equals naive attention over exactly that set and differs from attention over another set."""
    model = tiny_model(seed)
    cfg = model.cfg
    sd = {k: v.double() for k, v in model.state_dict().items()}
    tokens = random_tokens(T, cfg.vocab_size, seed)
    io, sels = capture_attention(model, tokens)
    for sharer, owner in ((2, 1), (5, 4), (6, 4)):
        assert sels[sharer] is sels[owner]
        assert model.layers[sharer].attention.indexer is None
        assert not any(k.startswith(f"layers.{sharer}.attention.indexer.") for k in sd)
    assert sels[7] is not sels[3] and sels[4] is not sels[1]
    pos = torch.arange(T)
    omega = ref_frequencies(cfg, sd["lerope.alpha"])
    c, kR = ref_latents(cfg, sd, 2, io[2][0], pos, omega)
    owner_sel = selection_sets(sels[1][0])
    assert rel_err(io[2][1], ref_attention(cfg, sd, 2, io[2][0], c, kR, pos, omega, owner_sel)) < 1e-11
    other_sel = selection_sets(sels[0][0])
    assert other_sel != owner_sel
    assert rel_err(io[2][1], ref_attention(cfg, sd, 2, io[2][0], c, kR, pos, omega, other_sel)) > 1e-6


def test_unsharpened_spec_init_matches_reference(seed: int) -> None:
    """The plain spec init (§1.2, as make-tiny writes it) also matches: nothing depends on the sharpening."""
    model = tiny_model(seed, sharp=False)
    tokens = random_tokens(T, model.cfg.vocab_size, seed)
    logits, trace = full_forward(model, tokens)
    ref = reference_forward(model, tokens)
    assert rel_err(logits, ref.logits) < 1e-10
    for l in model.cfg.index_owner_layers:
        assert selection_sets(trace.selections[l][0]) == ref.selections[l]
