"""Model parts and incremental decoding (ML4_SPEC §3.8, §3.9, §9.2, §9.6): chunked prefill + decode == one full
forward, batched requests == each alone, soft cap, MoE routing, dense FFN only at layer 0."""

from __future__ import annotations

import pytest
import torch

from conftest import full_forward, kv_for, random_tokens, selection_sets, tiny_model
from hisparse.kv.hisparse_kv import HiSparseKV
from hisparse.core.batch import ForwardTrace, Segment
from hisparse.core.config import ModelConfig, preset_params
from hisparse.model.ml4 import ML4
from hisparse.model.moe import MoE, SwiGLU, route

pytestmark = pytest.mark.usefixtures("single_thread")
T = 48
TOL = {torch.float64: 1e-11, torch.float32: 2e-4}   # fp32: sharpened weights amplify rounding


def run_schedule(model: ML4, tokens: dict, steps: list[list[tuple]], layout: str | None = None
                 ) -> tuple[dict, dict]:
    """Run forwards, each a list of (req, start, length) segments over one shared KV.

    Returns per request the logits [len, V] of every position and per layer the selected sets of every position.
    """
    kv = kv_for(model, layout)
    logits = {r: [] for r in tokens}
    sels = {r: {l: [] for l in range(model.cfg.n_layers)} for r in tokens}
    for step in steps:
        segs = [Segment(r, s, n) for r, s, n in step]
        trace = ForwardTrace()
        out = model(torch.cat([tokens[r][s:s + n] for r, s, n in step]), segs, kv, trace=trace)
        off = 0
        for i, (r, s, n) in enumerate(step):
            logits[r].append(out[off:off + n])
            off += n
            for l in range(model.cfg.n_layers):
                sels[r][l] += selection_sets(trace.selections[l][i])
    return {r: torch.cat(v) for r, v in logits.items()}, sels


def chunked_then_decode(req: object, n_prefill: int, chunk: int, total: int) -> list[list[tuple]]:
    steps = [[(req, s, min(chunk, n_prefill - s))] for s in range(0, n_prefill, chunk)]
    return steps + [[(req, p, 1)] for p in range(n_prefill, total)]


def assert_same(model: ML4, got_logits: torch.Tensor, got_sels: dict, ref_logits: torch.Tensor, ref_trace,
                what: str) -> None:
    err = float((got_logits - ref_logits).abs().max() / ref_logits.abs().max())
    assert err < TOL[model.dtype], f"{what}: logits differ by {err:.3e}"
    for l in range(model.cfg.n_layers):
        assert got_sels[l] == selection_sets(ref_trace.selections[l][0]), f"{what}: layer {l} selection"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_chunked_prefill_and_decode_equal_full_forward(dtype: torch.dtype, seed: int) -> None:
    """§9.2: length 48 > k = 8; several chunkings, each continued token by token."""
    model = tiny_model(seed, dtype)
    tokens = random_tokens(T, model.cfg.vocab_size, seed)
    ref_logits, ref_trace = full_forward(model, tokens)
    for n_prefill, chunk in ((0, 1), (20, 7), (32, 16), (40, 40)):
        got, sels = run_schedule(model, {0: tokens}, chunked_then_decode(0, n_prefill, chunk, T))
        assert_same(model, got[0], sels[0], ref_logits, ref_trace, f"seed {seed} {dtype} prefill {n_prefill}/{chunk}")


def test_chunked_equals_full_with_fp8_cache_layout(seed: int) -> None:
    """The served fp8_ds_mla layout quantises each row on its own, so chunking changes nothing there either (fp64
    compute: in fp32 a 1-ulp difference between chunk shapes can flip an fp8 rounding, which sharp weights amplify)."""
    model = tiny_model(seed)
    tokens = random_tokens(T, model.cfg.vocab_size, seed)
    ref_logits, ref_trace = full_forward(model, tokens, layout="fp8_ds_mla")
    got, sels = run_schedule(model, {0: tokens}, chunked_then_decode(0, 24, 10, T), layout="fp8_ds_mla")
    assert_same(model, got[0], sels[0], ref_logits, ref_trace, f"seed {seed} fp8_ds_mla")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_interleaved_requests_equal_each_alone(dtype: torch.dtype, seed: int) -> None:
    """Two requests' chunks in one flat batch (in both orders, different lengths and offsets) == each alone."""
    model = tiny_model(seed, dtype)
    a = random_tokens(T, model.cfg.vocab_size, seed)
    b = random_tokens(40, model.cfg.vocab_size, seed + 1)
    steps = [[("a", 0, 13)], [("b", 0, 9), ("a", 13, 11)], [("a", 24, 6), ("b", 9, 20)],
             [("b", 29, 3), ("a", 30, 2)]]
    pos = {"a": 32, "b": 32}
    while pos["a"] < T or pos["b"] < 40:   # decode both, one token each per forward
        step = [(r, pos[r], 1) for r, n in (("b", 40), ("a", T)) if pos[r] < n]
        steps.append(step)
        for r, _, _ in step:
            pos[r] += 1
    got, sels = run_schedule(model, {"a": a, "b": b}, steps)
    for r, toks in (("a", a), ("b", b)):
        ref_logits, ref_trace = full_forward(model, toks)
        assert_same(model, got[r], sels[r], ref_logits, ref_trace, f"seed {seed} {dtype} request {r}")


def test_logits_at_selects_rows(tiny64: ML4, seed: int) -> None:
    model = tiny64
    tokens = random_tokens(20, model.cfg.vocab_size, seed)
    full, _ = full_forward(model, tokens)
    rows = torch.tensor([3, 19, 0])
    part = model(tokens, [Segment(0, 0, 20)], kv_for(model), logits_at=rows)
    torch.testing.assert_close(part, full[rows], rtol=1e-13, atol=1e-13)


# tiny variants whose last layer caches nothing: a NoPE KV consumer of layer 3 that shares layer 4's selection, so
# the narrowing happens at the RoPE layer 6; with per-layer LeRoPE that layer's own rope tables are narrowed too
CONSUMER_LAST = {"kv_source_layers": [0, 1, 2, 3, 4, 5, 6, 3], "index_source_layers": [0, 1, 1, 3, 4, 4, 4, 4]}
VARIANTS = {"tiny": {}, "consumer-last": CONSUMER_LAST,
            "consumer-last-lerope": {**CONSUMER_LAST, "lerope": {"per_layer": True}}}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("store", ["resident", "hisparse"])
def test_rows_without_logits_skip_the_last_layers(dtype: torch.dtype, variant: str, store: str, seed: int) -> None:
    """With logits_at, layers from the last cache writer on compute only those rows: every step's logits equal
    the rows of a traced forward that computes every row, on a KV fed the same steps (so the caches agree too).
    Steps mix prefill chunks without logits, chunk ends, decode rows and a 3-row verify-like segment. Under
    HiSparse (hot buffer 4, window 4) the consumer-last variant's layer 7 gathers a subset of the rows its index
    group owner (layer 4) planned for every row."""
    model = tiny_model(seed, dtype, **VARIANTS[variant])
    assert model.last_writer == (7 if variant == "tiny" else 6)
    toks = {"a": random_tokens(T, model.cfg.vocab_size, seed), "b": random_tokens(40, model.cfg.vocab_size, seed + 1)}
    steps = [  # (req, start, length, logit rows at the segment's end)
        [("a", 0, 13, 0)], [("b", 0, 9, 0), ("a", 13, 11, 1)], [("a", 24, 6, 3), ("b", 9, 20, 0)],
        [("b", 29, 3, 1), ("a", 30, 2, 1)], [("a", 32, 1, 1), ("b", 32, 5, 0)], [("b", 37, 3, 3)]]
    kv_full = kv_for(model, "fp8_ds_mla")
    kv_trim = kv_for(model, "fp8_ds_mla") if store == "resident" else HiSparseKV(
        model.cfg, "fp8_ds_mla", dtype=dtype, host_pool_gib=0.002, hot_buffer_tokens=4, resident_window=4,
        sink_tokens=2, page_tokens=8)
    for step in steps:
        segs = [Segment(r, s, n) for r, s, n, _ in step]
        tokens = torch.cat([toks[r][s:s + n] for r, s, n, _ in step])
        ends = torch.tensor([n for _, _, n, _ in step]).cumsum(0).tolist()
        at = torch.tensor([e - 1 - j for e, (*_, k) in zip(ends, step) for j in reversed(range(k))], dtype=torch.long)
        got = model(tokens, segs, kv_trim, logits_at=at)
        ref = model(tokens, segs, kv_full, trace=ForwardTrace())[at]
        assert got.shape == ref.shape
        err = float((got - ref).abs().max() / ref.abs().max()) if at.numel() else 0.0
        assert err < TOL[dtype], f"seed {seed} {variant} {dtype} step {step}: logits differ by {err:.3e}"


# ------------------------------------------------------------------------------------------ soft cap

def final_z(model: ML4, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Model logits and the pre-cap logits z = W_out RMSNorm(h) from the tapped last hidden state."""
    last = model.cfg.n_layers - 1
    trace = ForwardTrace(tap_layers=(last,))
    logits = model(tokens, [Segment(0, 0, len(tokens))], kv_for(model), trace=trace)
    h = trace.taps[last]
    x = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + model.cfg.norm_eps) * model.norm.weight
    return logits, x @ model.output.weight.T


def test_soft_cap(tiny64: ML4, seed: int) -> None:
    """§3.1: logits = 30 tanh(z / 30), |logits| < 30 even when |z| is far above 30."""
    model = tiny64
    tokens = random_tokens(T, model.cfg.vocab_size, seed)
    with torch.no_grad():   # put max |z| at 90: deep in the cap's range, yet tanh(3) < 1 so the bound is strict
        model.output.weight.mul_(90 / final_z(model, tokens)[1].abs().max())
    logits, z = final_z(model, tokens)
    assert z.abs().max() > 89 and (z.abs() > 30).float().mean() > 0.01
    assert logits.abs().max() < 30
    torch.testing.assert_close(logits, 30 * torch.tanh(z / 30), rtol=1e-12, atol=1e-12)


def test_no_cap_when_softcap_zero(seed: int) -> None:
    model = tiny_model(seed, logit_softcap=0)
    logits, z = final_z(model, random_tokens(12, model.cfg.vocab_size, seed))
    assert z.abs().max() > 30
    torch.testing.assert_close(logits, z, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------ MoE

def brute_route(logits: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
    ids, gates = [], []
    for row in torch.softmax(logits.double(), -1).tolist():
        top = sorted(range(len(row)), key=lambda e: (-row[e], e))[:k]
        ids.append(top)
        gates.append([row[e] / sum(row[i] for i in top) for e in top])
    return ids, gates


@pytest.mark.parametrize("k", [1, 2, 4])
def test_route_topk_renormalised(k: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(64, 8, generator=g, dtype=torch.float64) * 3
    ids, gates = route(logits, k)
    want_ids, want_gates = brute_route(logits, k)
    assert ids.tolist() == want_ids
    torch.testing.assert_close(gates, torch.tensor(want_gates, dtype=torch.float64), rtol=1e-12, atol=0)
    torch.testing.assert_close(gates.sum(-1), torch.ones(64, dtype=torch.float64), rtol=1e-14, atol=0)


def test_route_ties_go_to_lower_expert_id() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, 0.0, 0.0, 0.0],
                           [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0, 0.0]])
    ids, gates = route(logits, 2)
    assert ids.tolist() == [[1, 3], [0, 1], [6, 0]]
    assert torch.allclose(gates[:2], torch.full((2, 2), 0.5))
    assert torch.allclose(gates.sum(-1), torch.ones(3))


def test_moe_module_equals_per_token_routing(seed: int) -> None:
    """MoE.forward (grouped by expert) == token-by-token sum of its top-k experts' SwiGLU + the shared expert."""
    cfg = ModelConfig.from_params(preset_params("tiny"))
    torch.manual_seed(seed)
    moe = MoE(cfg).double()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    y = torch.randn(40, cfg.dim, dtype=torch.float64)
    out = moe(y)
    ids, gates = brute_route(y @ moe.gate.weight.T, cfg.moe.num_experts_per_tok)
    for t in range(40):
        want = moe.shared_experts(y[t:t + 1]) + sum(g * moe.experts[e](y[t:t + 1]) for e, g in zip(ids[t], gates[t]))
        torch.testing.assert_close(out[t:t + 1], want, rtol=1e-12, atol=1e-12)
    assert len({tuple(i) for i in ids}) > 5   # tokens really route to different experts


@pytest.mark.parametrize("first_k_dense", [1, 3])
def test_dense_ffn_only_before_first_k_dense_replace(first_k_dense: int) -> None:
    """Module structure follows LayerSpec.ffn: dense SwiGLU (feed_forward.*) before first_k_dense_replace, MoE after."""
    p = preset_params("tiny")
    p["moe"]["first_k_dense_replace"] = first_k_dense
    model = ML4(ModelConfig.from_params(p))
    for i, layer in enumerate(model.layers):
        dense = i < first_k_dense
        assert layer.spec.ffn == ("dense" if dense else "moe")
        assert isinstance(getattr(layer, "feed_forward", None), SwiGLU) == dense
        assert isinstance(getattr(layer, "moe", None), MoE) == (not dense)
        names = {n.split(".")[2] for n, _ in model.named_parameters() if n.startswith(f"layers.{i}.")}
        assert ("feed_forward" in names) == dense and ("moe" in names) == (not dense)
    assert model.layers[0].feed_forward.w1.weight.shape == (p["hidden_dim"], p["dim"])
