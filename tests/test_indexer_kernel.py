"""The fused CPU indexer top-k (hisparse/kv/kernels) against the torch path, and the torch path against a
plain sort (spec §3.6: score descending, ties by position ascending).

The kernel must give exactly the torch path's selections (and scores), in every build (SIMD width, FMA filter on
or off, the tile filter (AMX) and the dot filters: int8 VPDPBUSD, bf16 VDPBF16PS; their error bounds case by case
in test_indexer_filters.py), including exact ties (integer-valued inputs, ReLU zeros, duplicated keys), near
ties (keys ulps apart), rows that see fewer than k keys, -1 padding, fp32 and fp64, and bf16/fp16 activations (scored in fp32 on both paths, `score_dtype`). A model built on either path must produce
bit-identical logits.
"""

from __future__ import annotations

import pytest
import torch

from conftest import full_forward, random_tokens, tiny_model
from hisparse.kv import scoring as indexer_module
from hisparse.core.batch import ForwardTrace, Segment
from hisparse.kv.scoring import index_scores, paged_topk, score_dtype, select_topk
from hisparse.kv.kernels.indexer_topk import FMA_FILTER, Build, fused_topk, fused_topk_paged
from hisparse.kv.resident import ResidentKV

pytestmark = pytest.mark.usefixtures("single_thread")
# every shape through the dot filter: int8 where the CPU has AVX512_VNNI, and bf16 where it has AVX512_BF16
DOT_ALL = Build(amx=False, dot_min_work=1)
DOT_BF16_ALL = Build(amx=False, dot_int8=False, dot_min_work=1)
# the default (AMX tiles where the CPU has them, else the int8 or bf16 dot filter, else the FMA filter), the
# FMA filter alone, the dot filter (int8, bf16) for every shape, 256-bit lanes, none
BUILDS = [Build(), FMA_FILTER, DOT_ALL, DOT_BF16_ALL, Build(vec_bytes=32), Build(filter=False)]
BUILD_IDS = ["default", "fma-filter", "dot-all", "dot-bf16-all", "256bit", "unfiltered"]


def random_case(g: torch.Generator, dtype: torch.dtype, kind: str, T: int, S: int, HI: int, dI: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, HI, dI], wr [T, HI], keys [S, dI], n_visible [T]. kind: 'normal', 'ties' (small integers: many
    exact ties and ReLU zeros, some zero or all-negative head weights), 'dup' (repeated keys) or 'near' (keys a few
    ulps apart, positive head weights)."""
    q = torch.randn(T, HI, dI, generator=g, dtype=dtype)
    keys = torch.randn(S, dI, generator=g, dtype=dtype)
    wr = torch.randn(T, HI, generator=g, dtype=dtype)
    if kind == "ties":
        q, keys = q.mul(1.5).round(), keys.mul(1.5).round()
        wr = wr.mul(2).round()
        wr[: T // 3] = -wr[: T // 3].abs()                          # rows whose scores are all <= 0
    elif kind == "dup":
        keys = keys[torch.randint(0, max(1, S // 4), (S,), generator=g)]
    elif kind == "near":   # near-duplicate keys: scores a few ulps apart, where an FMA sum and the exact one disagree
        keys = keys[torch.randint(0, max(1, S // 4), (S,), generator=g)]
        keys = keys * (1 + torch.randint(-2, 3, keys.shape, generator=g, dtype=dtype) * torch.finfo(dtype).eps)
        wr = wr.abs()
    n_visible = torch.randint(0, S + 1, (T,), generator=g)
    n_visible[0] = S
    return q, wr, keys, n_visible


def torch_topk(q: torch.Tensor, wr: torch.Tensor, keys: torch.Tensor, n_visible: torch.Tensor, k: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path: full scores, select_topk, and the scores at the selected columns."""
    scores = index_scores(q, wr, keys, n_visible - 1)
    cols = select_topk(scores, k)
    picked = scores.gather(1, cols.clamp(min=0)).masked_fill(cols < 0, float("-inf"))
    return cols, picked


@pytest.mark.parametrize("build", BUILDS, ids=BUILD_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["normal", "ties", "dup", "near"])
def test_fused_equals_torch_path(seed: int, dtype: torch.dtype, kind: str, build: Build) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(12):
        T, S = int(torch.randint(1, 40, (1,), generator=g)), int(torch.randint(1, 1500, (1,), generator=g))
        HI, dI = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 24, (1,), generator=g))
        k = int(torch.randint(1, 48, (1,), generator=g))
        q, wr, keys, n_visible = random_case(g, dtype, kind, T, S, HI, dI)
        cols, scores = fused_topk(q, wr, keys, n_visible, k, with_scores=True, build=build)
        want_cols, want_scores = torch_topk(q, wr, keys, n_visible, k)
        case = f"T={T} S={S} HI={HI} dI={dI} k={k}"
        assert torch.equal(cols, want_cols), case
        assert torch.equal(scores, want_scores), case                  # bit-identical scores
        assert torch.equal((cols >= 0).sum(1), n_visible.clamp(max=k)), case


@pytest.mark.parametrize("k", [8, 200])
def test_fused_long_context(seed: int, k: int) -> None:
    """Many key blocks and heap replacements; rows at the end of a 40k-token context, as in chunked prefill."""
    g = torch.Generator().manual_seed(seed)
    S, T = 40_000, 6
    q, wr, keys, _ = random_case(g, torch.float32, "normal", T, S, 2, 16)
    n_visible = torch.arange(S - T + 1, S + 1)
    assert torch.equal(fused_topk(q, wr, keys, n_visible, k)[0], torch_topk(q, wr, keys, n_visible, k)[0])



@pytest.mark.parametrize("build", BUILDS, ids=BUILD_IDS)
def test_filters_keep_non_finite_inputs_exact(seed: int, build: Build) -> None:
    """Keys or queries with inf or NaN entries: every filter (whose bounds are then not finite, so those rows or
    blocks take exact scoring) selects what the unfiltered kernel selects, with the same scores."""
    g = torch.Generator().manual_seed(seed)
    for it in range(6):
        q, wr, keys, n_visible = random_case(g, torch.float32, "normal", 30, 2000, 4, 32)
        rows = torch.randint(0, 2000, (3,), generator=g)
        if it % 3 == 0:
            keys[rows[0], 3], keys[rows[1], 0] = float("inf"), float("-inf")
        elif it % 3 == 1:
            keys[rows[0], 5], keys[rows[1]] = float("nan"), 1e30
        else:
            q[3, 1, 2], q[7, 0, 0] = float("inf"), float("nan")
        want_cols, want_scores = fused_topk(q, wr, keys, n_visible, 16, with_scores=True, build=Build(filter=False))
        cols, scores = fused_topk(q, wr, keys, n_visible, 16, with_scores=True, build=build)
        assert torch.equal(cols, want_cols), it
        assert torch.equal(scores.nan_to_num(), want_scores.nan_to_num()), it


def test_fused_threads_agree(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    q, wr, keys, n_visible = random_case(g, torch.float32, "ties", 33, 3000, 3, 16)
    one = fused_topk(q, wr, keys, n_visible, 16)[0]
    torch.set_num_threads(2)
    assert torch.equal(fused_topk(q, wr, keys, n_visible, 16)[0], one)


def test_fused_rejects_bad_inputs() -> None:
    q, wr, keys = torch.zeros(2, 2, 4), torch.zeros(2, 2), torch.zeros(5, 4)
    with pytest.raises(ValueError, match="n_visible"):
        fused_topk(q, wr, keys, torch.tensor([1, 6]), 3)
    with pytest.raises(ValueError, match="keys"):
        fused_topk(q, wr, torch.zeros(5, 3), torch.tensor([1, 2]), 3)
    with pytest.raises(RuntimeError, match="fp32/fp64"):
        fused_topk(q.bfloat16(), wr.bfloat16(), keys.bfloat16(), torch.tensor([1, 2]), 3)


def paged_case(g: torch.Generator, dtype: torch.dtype, kind: str, page_tokens: int, grouped: bool
               ) -> tuple[torch.Tensor, ...]:
    """A batch over several segments whose pages lie shuffled in one arena (with unused pages between them):
    q [T, HI, dI], wr [T, HI], arena [N, dI], table [n_seg, P] (-1 past a segment's pages, never read),
    row_seg [T] (interleaved in random order, or grouped in runs), n_visible [T] (0 .. the segment's keys; 0 and
    the full length for some rows of every segment; one segment fills the whole table, so some row sees S)."""
    n_seg = int(torch.randint(1, 6, (1,), generator=g))
    P = int(torch.randint(1, max(2, 1000 // page_tokens), (1,), generator=g))
    HI = int(torch.randint(1, 6, (1,), generator=g))
    dI = [8, 16, int(torch.randint(1, 24, (1,), generator=g))][int(torch.randint(0, 3, (1,), generator=g))]
    pages = torch.randint(0, P + 1, (n_seg,), generator=g)
    pages[0] = P
    n_pages = int(pages.sum()) + int(torch.randint(0, 4, (1,), generator=g))   # spare pages: never read
    ids = torch.randperm(n_pages, generator=g)
    table = torch.full((n_seg, P), -1, dtype=torch.int64)
    for s, start in enumerate((torch.cumsum(pages, 0) - pages).tolist()):
        table[s, : pages[s]] = ids[start:start + pages[s]]
    T = int(torch.randint(1, 300 if grouped else 60, (1,), generator=g))
    q, wr, arena, _ = random_case(g, dtype, kind, T, n_pages * page_tokens, HI, dI)
    row_seg = torch.randint(0, n_seg, (T,), generator=g)
    row_seg[: min(T, 2 * n_seg)] = torch.arange(min(T, 2 * n_seg)) % n_seg
    row_seg = row_seg.sort().values if grouped else row_seg[torch.randperm(T, generator=g)]
    length = pages[row_seg] * page_tokens
    n_visible = (torch.rand(T, generator=g, dtype=torch.float64) * (length + 1)).long().clamp(max=length)
    for s in range(n_seg):   # the first row of a segment sees nothing, the second all its keys
        rows = (row_seg == s).nonzero().flatten()
        n_visible[rows[:1]] = 0
        n_visible[rows[1:2]] = length[rows[1:2]]
    return q, wr, arena, table, row_seg, n_visible


@pytest.mark.parametrize("build", BUILDS, ids=BUILD_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("page_tokens", [1, 8, 12, 16, 64])
def test_paged_equals_contiguous(seed: int, page_tokens: int, dtype: torch.dtype, build: Build) -> None:
    """fused_topk_paged gives, row by row, what fused_topk gives on the row's segment's keys gathered in logical
    order (pages padded to the table's S, so the output widths agree): columns and bit-identical scores."""
    g = torch.Generator().manual_seed(seed)
    for it in range(4):
        kind = ["normal", "ties"][it % 2]
        q, wr, arena, table, row_seg, n_visible = paged_case(g, dtype, kind, page_tokens, grouped=it >= 2)
        k = int(torch.randint(1, 48, (1,), generator=g))
        cols, scores = fused_topk_paged(q, wr, arena, table, page_tokens, row_seg, n_visible, k, with_scores=True,
                                        build=build)
        S = table.shape[1] * page_tokens
        assert cols.shape == scores.shape == (q.shape[0], min(k, S))
        pages = arena.view(-1, page_tokens, arena.shape[1])
        for s in range(table.shape[0]):
            rows = (row_seg == s).nonzero().flatten()
            keys = pages[table[s].clamp(min=0)].reshape(S, -1)   # pages past the segment's: arbitrary, unseen
            want_cols, want_scores = fused_topk(q[rows], wr[rows], keys, n_visible[rows], k, with_scores=True,
                                                build=build)
            case = f"{kind} segment {s} rows {rows.tolist()} S={S} k={k} dI={q.shape[2]} HI={q.shape[1]}"
            assert torch.equal(cols[rows], want_cols), case
            assert torch.equal(scores[rows], want_scores), case
        assert torch.equal((cols >= 0).sum(1), n_visible.clamp(max=k))


def test_paged_threads_and_torch_path(seed: int) -> None:
    """Two threads select what one does on interleaved segments, and that is the torch path's selection on
    each segment's gathered keys."""
    g = torch.Generator().manual_seed(seed)
    q, wr, arena, table, row_seg, n_visible = paged_case(g, torch.float32, "ties", 16, grouped=False)
    one = fused_topk_paged(q, wr, arena, table, 16, row_seg, n_visible, 16)[0]
    torch.set_num_threads(2)
    assert torch.equal(fused_topk_paged(q, wr, arena, table, 16, row_seg, n_visible, 16)[0], one)
    S = table.shape[1] * 16
    for s in range(table.shape[0]):
        rows = (row_seg == s).nonzero().flatten()
        keys = arena.view(-1, 16, arena.shape[1])[table[s].clamp(min=0)].reshape(S, -1)
        assert torch.equal(one[rows], torch_topk(q[rows], wr[rows], keys, n_visible[rows], 16)[0]), f"segment {s}"


def test_paged_rejects_bad_inputs() -> None:
    q, wr, arena = torch.zeros(2, 2, 4), torch.zeros(2, 2), torch.zeros(12, 4)
    table, row_seg, n_vis = torch.tensor([[2, 0], [1, -1]]), torch.tensor([0, 1]), torch.tensor([8, 4])
    fused_topk_paged(q, wr, arena, table, 4, row_seg, n_vis, 3)   # valid: -1 lies past segment 1's keys
    bad = {
        "table": dict(table=table.int()),
        "row_seg": dict(row_seg=torch.tensor([0, 2])),
        "n_visible": dict(n_visible=torch.tensor([9, 4])),
        "wr": dict(wr=torch.zeros(2, 3)),
        "keys": dict(keys=torch.zeros(12, 3)),
        "page_tokens": dict(page_tokens=0),
    }
    args = dict(q=q, wr=wr, keys=arena, table=table, page_tokens=4, row_seg=row_seg, n_visible=n_vis, k=3)
    for name, change in bad.items():
        with pytest.raises(ValueError, match=name):
            fused_topk_paged(**{**args, **change})
    with pytest.raises(ValueError, match=r"table\[1, 1\]"):   # segment 1 reads its second page
        fused_topk_paged(**{**args, "n_visible": torch.tensor([8, 5])})
    with pytest.raises(ValueError, match=r"table\[0, 0\]"):   # page 2 = arena rows 8..11: too few rows
        fused_topk_paged(**{**args, "keys": torch.zeros(11, 4)})
    with pytest.raises(ValueError, match="float32 or float64"):
        fused_topk_paged(**{**args, "q": q.bfloat16(), "wr": wr.bfloat16(), "keys": arena.bfloat16()})


def test_torch_path_against_sort_and_spec(seed: int) -> None:
    """select_topk(index_scores) picks what a plain sort on (-score, position) picks, and index_scores is the
    §3.6 formula (fp64 einsum reference, up to rounding)."""
    g = torch.Generator().manual_seed(seed)
    q, wr, keys, n_visible = random_case(g, torch.float32, "ties", 24, 300, 2, 8)
    scores = index_scores(q, wr, keys, n_visible - 1)
    cols = select_topk(scores, 10)
    for t in range(scores.shape[0]):
        ranked = sorted(range(int(n_visible[t])), key=lambda s: (-float(scores[t, s]), s))
        assert [c for c in cols[t].tolist() if c >= 0] == sorted(ranked[:10])
    q, wr, keys, n_visible = random_case(g, torch.float32, "normal", 24, 300, 2, 8)
    ref = torch.einsum("th,ths->ts", wr.double(), torch.relu(torch.einsum("thd,sd->ths", q.double(), keys.double())))
    got = index_scores(q, wr, keys, torch.full((24,), 299))
    # fp32 rounding bound: each dot has dI roundings, the weighted head sum HI more, all relative to the sum of
    # the magnitudes of what they add (a near-zero score after cancellation can carry an error far above atol)
    mag = torch.einsum("th,ths->ts", wr.double().abs(),
                       torch.einsum("thd,sd->ths", q.double().abs(), keys.double().abs()))
    bound = 2 * (q.shape[2] + q.shape[1]) * torch.finfo(torch.float32).eps * mag
    assert bool(((got.double() - ref).abs() <= bound).all())


def test_select_paths_and_chunks_identical(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Indexer.select: the fused and torch paths agree, and a chunk's selection does not depend on how many
    later keys the cache holds."""
    model = tiny_model(seed, dtype=torch.float32)
    ix = model.layers[0].attention.indexer
    g = torch.Generator().manual_seed(seed)
    S, T = 700, 64
    q, w, keys = torch.randn(T, 2, 16, generator=g), torch.randn(T, 2, generator=g), torch.randn(S, 16, generator=g)
    pos = torch.arange(S - 2 * T, S - T)
    monkeypatch.setattr(indexer_module, "FUSED_MIN_PAIRS", 1 << 62)
    torch_sel = ix.select(q, w, keys[: S - T], pos)
    monkeypatch.setattr(indexer_module, "FUSED_MIN_PAIRS", 0)
    assert torch.equal(ix.select(q, w, keys[: S - T], pos), torch_sel)
    assert torch.equal(ix.select(q, w, keys, pos), torch_sel)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_activations_score_in_fp32_on_both_paths(seed: int, dtype: torch.dtype,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16/fp16 queries, head weights and keys are scored as their fp32 values: Indexer.select and paged_topk
    give the same selections (and fp32 score bits) on the fused and the torch path as on fp32 inputs."""
    ix = tiny_model(seed, dtype=torch.float32).layers[0].attention.indexer
    g = torch.Generator().manual_seed(seed)
    kernel = indexer_module.indexer_topk
    calls = []
    for name in ("fused_topk", "fused_topk_paged"):
        fn = getattr(kernel, name)
        monkeypatch.setattr(kernel, name, lambda *a, fn=fn, **kw: calls.append(a[0].dtype) or fn(*a, **kw))
    for kind in ("ties", "near"):
        q, w, keys, _ = random_case(g, dtype, kind, 48, 300, 3, 16)
        pos = torch.randint(0, 300, (48,), generator=g)
        sels = {}
        for pairs in (1 << 62, 0):   # the torch path, then the fused kernel
            monkeypatch.setattr(indexer_module, "FUSED_MIN_PAIRS", pairs)
            sels[pairs] = ix.select(q, w, keys, pos), ix.select(q.float(), w.float(), keys.float(), pos)
        assert all(torch.equal(a, sels[0][0]) for pair in sels.values() for a in pair), kind
        q, w, arena, table, row_seg, n_visible = paged_case(g, dtype, kind, 8, grouped=False)
        L = table.shape[1] * 8
        out = []
        for pairs in (1 << 62, 0):
            monkeypatch.setattr(indexer_module, "FUSED_MIN_PAIRS", pairs)
            for args in ((q, w, arena), (q.float(), w.float(), arena.float())):
                out.append(paged_topk(ix, *args, table, 8, row_seg, n_visible, L, with_scores=True))
        for cols, scores in out:
            assert scores.dtype == score_dtype(dtype) == torch.float32, kind
            assert torch.equal(cols, out[0][0]) and torch.equal(scores, out[0][1]), kind
    assert calls == [torch.float32] * 8   # the fused path ran, on fp32 inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_model_bit_identical_on_both_paths(seed: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny model's full forward gives bit-identical logits and selections on the torch and the fused path."""
    model = tiny_model(seed, dtype=dtype)
    tokens = random_tokens(96, model.cfg.vocab_size, seed)
    monkeypatch.setattr(indexer_module, "FUSED_MIN_PAIRS", 1 << 62)
    ref_logits, ref_trace = full_forward(model, tokens)
    monkeypatch.setattr(indexer_module, "FUSED_MIN_PAIRS", 0)
    logits, trace = full_forward(model, tokens)
    assert torch.equal(logits, ref_logits)
    for layer, sels in ref_trace.selections.items():
        assert torch.equal(trace.selections[layer][0], sels[0]), f"layer {layer}"


def test_chunked_prefill_on_fused_path(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunked prefill on the fused path selects what one full forward on the torch path selects (fp64: chunk
    shapes then cannot move a score by an ulp)."""
    model = tiny_model(seed)
    tokens = random_tokens(96, model.cfg.vocab_size, seed)
    monkeypatch.setattr(indexer_module, "FUSED_MIN_PAIRS", 1 << 62)
    ref_logits, ref_trace = full_forward(model, tokens)
    monkeypatch.setattr(indexer_module, "FUSED_MIN_PAIRS", 0)
    kv, chunks, sels = ResidentKV(model.cfg, layout=None, dtype=model.dtype), [], {}
    for start in range(0, 96, 40):
        n = min(40, 96 - start)
        trace = ForwardTrace()
        chunks.append(model(tokens[start:start + n], [Segment(0, start, n)], kv, trace=trace))
        for layer, s in trace.selections.items():
            sels.setdefault(layer, []).append(s[0])
    for layer, ref in ref_trace.selections.items():
        assert torch.equal(torch.cat(sels[layer]), ref[0]), f"layer {layer}"
    assert torch.allclose(torch.cat(chunks), ref_logits, rtol=0, atol=1e-9 * float(ref_logits.abs().max()))
