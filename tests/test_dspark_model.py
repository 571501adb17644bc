"""DSpark drafter (spec §5.2) against a naive fp64 reference built from the raw `mtp_dspark.*` tensors; block
non-causality and the sliding-window edge; the bf16 window cache and its rollback; checkpoint names and loading.

The reference computes per-head K/V explicitly (kN = W_UK c, v = W_UV c), masks each block query to the context
positions max(0, t - W + 1) .. P - 1 plus every block position, and runs the gated-RNN Markov head step by step.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import random_tokens, tiny_model
from hisparse.core.batch import ForwardTrace, Segment
from hisparse.core.config import ConfigError, preset, preset_params
from hisparse.model.dspark import DraftWindowCache, DSparkDrafter
from hisparse.kv.resident import ResidentKV
from hisparse.model.ml4 import ML4
from hisparse.model.tiny import make_tiny, random_model
from hisparse.model.weights import CheckpointError, load_model, save_model
from test_model_reference import ref_frequencies, rel_err, rms_norm, rotate, ssmax, swiglu

pytestmark = pytest.mark.usefixtures("single_thread")
PROMPT = 40   # > sliding_window 16: the window really slides


@dataclass
class RefMutation:
    """Deliberate reference bugs, to show the comparison can fail."""
    causal: bool = False        # block queries see only earlier block slots
    window_extra: int = 0       # read context keys down to t - W + 1 - window_extra
    markov: bool = True         # add the Markov bias


@torch.no_grad()
def drafter_model(seed: int, ssmax_layer: int | None = None) -> ML4:
    """Sharpened fp64 tiny model whose Markov head is strong enough to move the draft logits."""
    model = tiny_model(seed)
    g = torch.Generator().manual_seed(seed + 7)
    mk = model.mtp_dspark.markov
    for p, scale in ((mk.embed.weight, 50.0), (mk.gate.weight, 50.0), (mk.proj.weight, 200.0)):
        p.mul_(scale)
    if ssmax_layer is not None:
        att = model.mtp_dspark.layers[ssmax_layer].attention
        att.enable_ssmax()
        H = model.cfg.n_heads
        att.ssmax_scaling.copy_(torch.stack((0.2 + 0.4 * torch.rand(H, generator=g), 0.5 + torch.rand(H, generator=g)),
                                            dim=1))
    return model


def prompt_taps(model: ML4, tokens: torch.Tensor) -> dict[int, torch.Tensor]:
    trace = ForwardTrace(tap_layers=model.cfg.mtp.target_layer_ids)
    model(tokens, [Segment(0, 0, len(tokens))], ResidentKV(model.cfg, None, dtype=model.dtype), trace=trace)
    return trace.taps


class Recorder:
    """Greedy draft sampler that keeps the capped logits it was shown."""

    def __init__(self):
        self.logits: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, None]:
        self.logits.append(logits.clone())
        return logits.argmax(-1), None


def draft_logits(drafter: DSparkDrafter, anchor: int, pos: int, n: int, req: object = 0) -> torch.Tensor:
    rec = Recorder()
    drafter.propose(req, anchor, pos, n, rec)
    return torch.cat(rec.logits)                                          # [n, V]


# ------------------------------------------------------------------------------------------ reference

def reference_draft(model: ML4, taps: dict[int, torch.Tensor], anchor: int, n: int,
                    mut: RefMutation = RefMutation()) -> tuple[torch.Tensor, list[int]]:
    """Context path over every tapped position 0..P-1 (rows rounded to bf16, the cache dtype), the block at
    P..P+n-1 and the Markov head: capped draft logits [n, V] and the greedy drafts."""
    cfg, mtp = model.cfg, model.cfg.mtp
    sd = {k: v.detach().double() for k, v in model.state_dict().items()}
    H, dN, dR, dV, r = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    W, pre = mtp.sliding_window, "mtp_dspark."
    omega = ref_frequencies(cfg, sd["lerope.alpha"])
    P = next(iter(taps.values())).shape[0]
    cpos, bpos = torch.arange(P), torch.arange(P, P + n)
    hcat = torch.cat([taps[l].double() for l in mtp.target_layer_ids], dim=-1)
    u = rms_norm(hcat @ sd[pre + "context_proj.weight"].T, sd[pre + "context_norm.weight"], cfg.norm_eps)
    x = torch.cat((sd["tok_embeddings.weight"][anchor][None], sd[pre + "mask_embeddings"][: n - 1]))
    for j in range(mtp.n_layers):
        lp = f"{pre}layers.{j}."
        a = u @ sd[lp + "attention.wkv_a_with_mqa.weight"].T
        c_ctx = rms_norm(a[:, :r], sd[lp + "attention.kv_a_norm.weight"], cfg.norm_eps).bfloat16().double()
        kr_ctx = rotate(a[:, r:], cpos, omega).bfloat16().double()
        xn = rms_norm(x, sd[lp + "attention_norm.weight"], cfg.norm_eps)
        q = (xn @ sd[lp + "attention.wq.weight"].T).view(n, H, dN + dR)
        qN, qR = q[..., :dN], rotate(q[..., dN:], bpos, omega)
        if lp + "attention.ssmax_scaling" in sd:
            g = ssmax(sd, lp + "attention.ssmax_scaling", bpos)
            qN, qR = qN * g, qR * g
        ab = xn @ sd[lp + "attention.wkv_a_with_mqa.weight"].T
        c = torch.cat((c_ctx, rms_norm(ab[:, :r], sd[lp + "attention.kv_a_norm.weight"], cfg.norm_eps)))
        kR = torch.cat((kr_ctx, rotate(ab[:, r:], bpos, omega)))
        Wb = sd[lp + "attention.wkv_b.weight"].view(H, dN + dV, r)
        kN, v = torch.einsum("hdc,sc->shd", Wb[:, :dN], c), torch.einsum("hvc,sc->shv", Wb[:, dN:], c)
        logits = (torch.einsum("thd,shd->ths", qN, kN) + torch.einsum("thd,sd->ths", qR, kR)) * (dN + dR) ** -0.5
        mask = torch.zeros(n, P + n, dtype=torch.bool)
        for i in range(n):
            t = P + i
            mask[i, max(0, t - W + 1 - mut.window_extra): P] = True
            mask[i, P: P + (i + 1 if mut.causal else n)] = True
        att = torch.softmax(logits.masked_fill(~mask[:, None, :], float("-inf")), dim=-1)
        x = x + torch.einsum("ths,shv->thv", att, v).flatten(1) @ sd[lp + "attention.wo.weight"].T
        x = x + swiglu(rms_norm(x, sd[lp + "ffn_norm.weight"], cfg.norm_eps), sd, lp + "feed_forward.")
    U = rms_norm(x, sd[pre + "norm.weight"], cfg.norm_eps) @ sd["output.weight"].T
    s, y, out, drafts = torch.zeros(mtp.markov_rank, dtype=torch.float64), anchor, [], []
    for i in range(n):
        e = sd[pre + "markov.embed.weight"][y]
        z = torch.sigmoid(sd[pre + "markov.gate.weight"] @ torch.cat((e, s)) + sd[pre + "markov.gate.bias"])
        s = z * s + (1 - z) * e
        ell = 30.0 * torch.tanh((U[i] + (sd[pre + "markov.proj.weight"] @ s if mut.markov else 0)) / 30.0)
        y = int(ell.argmax())
        out.append(ell)
        drafts.append(y)
    return torch.stack(out), drafts


# ------------------------------------------------------------------------------------------ tests

@pytest.mark.parametrize("ssmax_layer", [None, 1], ids=["spec", "ssmax_on_layer_1"])
def test_drafter_matches_naive_reference(seed: int, ssmax_layer: int | None) -> None:
    model = drafter_model(seed, ssmax_layer)
    tokens = random_tokens(PROMPT + 1, model.cfg.vocab_size, seed)
    taps = prompt_taps(model, tokens[:PROMPT])
    drafter = DSparkDrafter(model)
    for s in range(0, PROMPT, 11):   # chunked context path: the ring keeps the newest W positions
        e = min(s + 11, PROMPT)
        drafter.observe(0, {l: h[s:e] for l, h in taps.items()}, torch.arange(s, e))
    anchor = int(tokens[PROMPT])
    for n in (1, 2, 3):
        got = draft_logits(drafter, anchor, PROMPT, n)
        ref, drafts = reference_draft(model, taps, anchor, n)
        assert ref.abs().max() > 10
        assert rel_err(got, ref) < 1e-9, f"seed {seed}: n={n} draft logits differ by {rel_err(got, ref):.3e}"
        assert drafter.propose(0, anchor, PROMPT, n, Recorder())[0].tolist() == drafts
    assert rel_err(got, reference_draft(model, taps, anchor, 3, RefMutation(markov=False))[0]) > 1e-3


@pytest.mark.parametrize("mut", [RefMutation(causal=True), RefMutation(window_extra=1)], ids=["causal", "window+1"])
def test_reference_comparison_can_fail(seed: int, mut: RefMutation) -> None:
    """A causal block or a window one key too wide moves the draft logits far beyond the tolerance."""
    model = drafter_model(seed)
    tokens = random_tokens(PROMPT + 1, model.cfg.vocab_size, seed)
    taps = prompt_taps(model, tokens[:PROMPT])
    drafter = DSparkDrafter(model)
    drafter.observe(0, taps, torch.arange(PROMPT))
    got = draft_logits(drafter, int(tokens[PROMPT]), PROMPT, 3)
    assert rel_err(got, reference_draft(model, taps, int(tokens[PROMPT]), 3, mut)[0]) > 1e-4


def test_block_is_non_causal(seed: int) -> None:
    """Perturbing the last mask slot M[1] changes slot 0's output (its hidden state, hence its logits)."""
    model = drafter_model(seed)
    tokens = random_tokens(PROMPT + 1, model.cfg.vocab_size, seed)
    drafter = DSparkDrafter(model)
    drafter.observe(0, prompt_taps(model, tokens[:PROMPT]), torch.arange(PROMPT))
    before = draft_logits(drafter, int(tokens[PROMPT]), PROMPT, 3)
    with torch.no_grad():
        model.mtp_dspark.mask_embeddings[1].add_(torch.randn(model.cfg.dim, dtype=torch.float64))
    after = draft_logits(drafter, int(tokens[PROMPT]), PROMPT, 3)
    assert rel_err(after[0], before[0]) > 1e-6


def test_window_edge_per_block_query(seed: int) -> None:
    """Block query t = P + i reads context positions s with t - W < s < P only: a perturbed context row at
    s = P - W + 1 + i moves the attention output of slots j <= i and of no later slot; rows at s <= P - W, at
    s >= P (stale) or in empty slots move nothing."""
    model = drafter_model(seed)
    cfg, dspark = model.cfg, model.mtp_dspark
    W, n, P, L = cfg.mtp.sliding_window, 3, 50, cfg.mtp.n_layers
    g = torch.Generator().manual_seed(seed)
    S = W + 6
    ctx_pos = torch.cat((torch.arange(P - W - 3, P), torch.tensor([P, P + 1, -1])))[None]     # [1, S]
    ctx = torch.randn(1, L, S, cfg.latent_dim, generator=g, dtype=torch.float64)
    x0 = torch.randn(1, n, cfg.dim, generator=g, dtype=torch.float64)
    positions = torch.arange(P, P + n)[None]
    drafter = DSparkDrafter(model)
    cos, sin = drafter._rope(positions)
    layer = dspark.layers[0]

    def attn(ctx_rows: torch.Tensor) -> torch.Tensor:    # layer 0 attention output [n, D]
        valid = (ctx_pos[:, None] >= 0) & (ctx_pos[:, None] < P) & (ctx_pos[:, None] > positions[..., None] - W)
        return layer.attention(layer.attention_norm(x0), positions, cos, sin, ctx_rows[:, 0], valid)[0]

    base, base_g = attn(ctx), dspark.block(x0, positions, cos, sin, ctx, ctx_pos)
    slot = {int(p): k for k, p in enumerate(ctx_pos[0]) if p >= 0}
    for i in range(n):
        bumped = ctx.clone()
        bumped[:, :, slot[P - W + 1 + i]] += 1.0
        moved = (attn(bumped) - base).abs().amax(-1)
        assert bool((moved[: i + 1] > 1e-8).all()) and bool((moved[i + 1:] == 0).all()), moved
    dead = [k for k, p in enumerate(ctx_pos[0].tolist()) if p <= P - W or p >= P]
    assert len(dead) == 7
    bumped = ctx.clone()
    bumped[:, :, dead] += 5.0
    assert torch.equal(dspark.block(x0, positions, cos, sin, bumped, ctx_pos), base_g)


def test_window_cache_ring_and_rollback() -> None:
    """Slot = position mod W; truncate empties (and zeroes) every slot holding a position >= length."""
    cache = DraftWindowCache(n_layers=2, window=8, width=4)
    rows = torch.arange(20, dtype=torch.float32)[None, :, None].expand(2, 20, 4)
    cache.write("r", torch.arange(0, 12), rows[:, :12])
    cache.write("r", torch.arange(12, 20), rows[:, 12:])
    data, pos = cache.read("r")
    assert sorted(pos.tolist()) == list(range(12, 20))
    assert torch.equal(data[0, pos % 8, 0], pos.float().bfloat16())
    assert torch.equal(pos % 8, torch.arange(8))
    cache.truncate("r", 15)
    data, pos = cache.read("r")
    assert sorted(p for p in pos.tolist() if p >= 0) == [12, 13, 14] and (pos == -1).sum() == 5
    assert bool((data[:, pos < 0] == 0).all())
    assert cache.nbytes("r") == 2 * 8 * 4 * 2
    cache.release("r")
    assert cache.nbytes() == 0


def test_draft_window_geometry_full_size() -> None:
    """§4: a bf16 draft row is 1,152 B; 3 layers x 2,048 x 1,152 B = 7,077,888 B per request."""
    cache = DraftWindowCache.for_config(preset("full"))
    assert cache.row_bytes == 1152 and cache.bytes_per_request == 7_077_888 and cache.nbytes() == 0


def spec_drafter_names(n_layers: int) -> set[str]:
    names = {"context_proj.weight", "context_norm.weight", "mask_embeddings", "norm.weight", "markov.embed.weight",
             "markov.gate.weight", "markov.gate.bias", "markov.proj.weight"}
    for j in range(n_layers):
        names |= {f"layers.{j}.{k}.weight" for k in ("attention_norm", "ffn_norm")}
        names |= {f"layers.{j}.attention.{k}.weight" for k in ("wq", "wkv_a_with_mqa", "kv_a_norm", "wkv_b", "wo")}
        names |= {f"layers.{j}.feed_forward.w{k}.weight" for k in (1, 2, 3)}
    return {"mtp_dspark." + n for n in names}


def test_checkpoint_names_shapes_and_round_trip(tiny_ckpt) -> None:
    """make-tiny writes exactly the §5.2 tensors (bf16, spec init); load_model reads them back unchanged."""
    cfg = preset("tiny")
    D, V, R = cfg.dim, cfg.vocab_size, cfg.mtp.markov_rank
    tensors = load_file(str(tiny_ckpt / "consolidated.safetensors"))
    drafter = {k: v for k, v in tensors.items() if k.startswith("mtp_dspark.")}
    assert set(drafter) == spec_drafter_names(3)
    assert all(v.dtype == torch.bfloat16 for v in drafter.values())
    shapes = {"context_proj.weight": [D, 5 * D], "mask_embeddings": [2, D], "markov.embed.weight": [V, R],
              "markov.gate.weight": [R, 2 * R], "markov.gate.bias": [R], "markov.proj.weight": [V, R],
              "layers.2.attention.wkv_a_with_mqa.weight": [cfg.latent_dim, D],
              "layers.0.feed_forward.w1.weight": [cfg.mtp.hidden_dim, D]}
    for k, shape in shapes.items():
        assert list(drafter["mtp_dspark." + k].shape) == shape, k
    assert bool((drafter["mtp_dspark.layers.1.attention.kv_a_norm.weight"] == 1).all())
    assert 0.015 < float(drafter["mtp_dspark.context_proj.weight"].float().std()) < 0.025
    model = load_model(tiny_ckpt)
    fresh = random_model(preset_params("tiny"), seed=0)
    for k, v in fresh.mtp_dspark.state_dict().items():
        assert torch.equal(model.mtp_dspark.state_dict()[k], v), k


def test_loader_drafter_rules(tmp_path, tiny_ckpt) -> None:
    """A missing drafter tensor is an error naming it; an optional ssmax_scaling is loaded and applied; an fp8
    checkpoint keeps the drafter in bf16; without an `mtp` block the drafter tensors are skipped."""
    tensors = load_file(str(tiny_ckpt / "consolidated.safetensors"))
    params = (tiny_ckpt / "params.json").read_text()
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "params.json").write_text(params)
    save_file({k: v for k, v in tensors.items() if k != "mtp_dspark.markov.gate.bias"},
              str(cut / "consolidated.safetensors"))
    with pytest.raises(CheckpointError, match="mtp_dspark.markov.gate.bias"):
        load_model(cut)

    base = load_model(tiny_ckpt)
    sc = torch.tensor([[0.3, 0.9], [0.1, 1.1], [0.2, 1.0], [0.4, 0.8]])
    save_model(base, tmp_path / "ssmax", extra={"mtp_dspark.layers.2.attention.ssmax_scaling": sc})
    with_ssmax = load_model(tmp_path / "ssmax")
    atts = [layer.attention for layer in with_ssmax.mtp_dspark.layers]
    assert [a.ssmax_scaling is not None for a in atts] == [False, False, True]
    assert torch.equal(atts[2].ssmax_scaling.data, sc)
    tokens = random_tokens(PROMPT + 1, base.cfg.vocab_size, 0)
    outs = []
    for m in (base, with_ssmax):
        d = DSparkDrafter(m)
        d.observe(0, prompt_taps(m, tokens[:PROMPT]), torch.arange(PROMPT))
        outs.append(draft_logits(d, int(tokens[PROMPT]), PROMPT, 3))
    assert rel_err(outs[1], outs[0]) > 1e-6

    fp8 = make_tiny(tmp_path / "fp8", fp8=True, with_tokenizer=False)
    names = load_file(str(fp8 / "consolidated.safetensors"))
    assert not any(k.startswith("mtp_dspark.") and k.endswith("qscale_weight") for k in names)
    assert "layers.0.attention.wq.weight.qscale_weight" in names

    no_mtp = preset_params("tiny")
    del no_mtp["mtp"]
    plain = random_model(no_mtp, seed=0)
    assert plain.mtp_dspark is None
    save_model(plain, tmp_path / "plain", extra={k: v for k, v in tensors.items() if k.startswith("mtp_dspark.")})
    assert load_model(tmp_path / "plain").mtp_dspark is None
    with pytest.raises(ConfigError, match="no drafter"):
        DSparkDrafter(plain)
