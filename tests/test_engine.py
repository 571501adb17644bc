"""Engine: continuous batching == one request at a time, admission by KV capacity, abort and failure isolation,
batched sampling against an independent reference, seeded reproducibility, stop conditions and detokenization."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import tiny_model
from hisparse.engine.detokenizer import TextStream
from hisparse.engine.engine import Engine
from hisparse.engine.generate import greedy_generate
from hisparse.kv.settings import KVSettings
from hisparse.engine.request import Request, RequestError, SamplingParams
from hisparse.engine.sampling import SamplingBatch, sample
from hisparse.engine.scheduler import Scheduler, SchedulerConfig
from hisparse.kv.resident import ResidentKV
from hisparse.model.tokenizer import load_tokenizer, write_tekken

pytestmark = pytest.mark.usefixtures("single_thread")
GIB = 1 << 30


def pool_gib(kv_cfg, pages: int, page_tokens: int = 64) -> float:
    """host_pool_gib that holds exactly `pages` pages of the tiny fp8 layout."""
    probe = KVSettings(host_pool_gib=0.001).build(kv_cfg, dtype=torch.float64)
    return pages * probe.pool.page_bytes / GIB


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lens]


def assert_clean(kv) -> None:
    """Every reservation, row, key and slot is back (invariant 6): the pool holds the prefix cache's pages only."""
    assert kv.reserved == {}
    assert kv.index_cache_bytes() == 0 and not kv.pages.refs
    if hasattr(kv, "pool"):
        assert kv.pool.pages_used == kv.cached_pages() and kv.pool.tables == {}
        assert not kv.slot_of and all((h.pos[:-1] < 0).all() for h in kv.hot.values())
    else:
        assert kv.latent_bytes() == 0


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("tok")
    write_tekken(d)
    return load_tokenizer(d).instruct_tokenizer.tokenizer


def test_continuous_batching_equals_one_at_a_time(seed: int) -> None:
    """Chunked prefill interleaved with decode, admission queueing on a small HiSparse pool (hot buffer far
    smaller than the prompts): every request's greedy tokens equal a lone greedy run on all-resident KV."""
    model = tiny_model(seed)
    prompts = random_prompts(5, 5, 100, model.cfg.vocab_size, seed)
    kv = KVSettings(host_pool_gib=pool_gib(model.cfg, 4), hot_buffer_tokens=16,
                    resident_window=8).build(model.cfg, dtype=torch.float64)
    engine = Engine(model, kv, SchedulerConfig(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=40))
    params = SamplingParams(max_tokens=10, temperature=0.0)
    reqs = [engine.add_request(p, params) for p in prompts]
    seen_waiting = seen_mixed = False
    while engine.has_work() or not engine.inbox.empty():
        st = engine.step()
        seen_waiting |= st.num_waiting > 0 and st.num_running > 0
        seen_mixed |= st.prompt_tokens > 0 and st.generation_tokens > 0
        assert sum(kv.reserved.values()) <= kv.token_capacity()
    assert seen_waiting, "the pool was meant to be too small for all requests at once"
    assert seen_mixed, "prefill chunks and decode tokens were meant to share steps"
    for p, r in zip(prompts, reqs):
        ref = greedy_generate(model, ResidentKV(model.cfg, "fp8_ds_mla", dtype=torch.float64), p, 10)
        assert r.output == ref.tokens and r.finish_reason == "length"
    assert_clean(kv)


@pytest.mark.parametrize("offload", ["hisparse", "none"])
def test_admission_by_need_preempts_the_newest_and_recomputes_exactly(seed: int, offload: str) -> None:
    """Three requests whose max lengths need 9 pages share a 4-page store: all three start at once (each holds only
    what it has written), the store fills, the newest running request is preempted and later recomputes its
    prompt and outputs; every request still gets its lone greedy tokens and everything is freed at the end."""
    model = tiny_model(seed)
    prompts = random_prompts(3, 30, 50, model.cfg.vocab_size, seed + 4)
    pages = 4
    if offload == "hisparse":
        kv = KVSettings(host_pool_gib=pool_gib(model.cfg, pages), hot_buffer_tokens=16,
                        resident_window=8).build(model.cfg, dtype=torch.float64)
    else:
        kv = ResidentKV(model.cfg, "fp8_ds_mla", dtype=torch.float64, budget_tokens=pages * 64)
    engine = Engine(model, kv, SchedulerConfig(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64))
    params = SamplingParams(max_tokens=140, temperature=0.0)
    reqs = [engine.add_request(p, params) for p in prompts]
    most_running = 0
    while engine.has_work() or not engine.inbox.empty():
        st = engine.step()
        most_running = max(most_running, st.num_running)
        assert sum(kv.reserved.values()) <= kv.token_capacity()
    assert most_running == 3 and engine.scheduler.num_preemptions > 0
    for p, r in zip(prompts, reqs):
        ref = greedy_generate(model, ResidentKV(model.cfg, "fp8_ds_mla", dtype=torch.float64), p, 140)
        assert r.output == ref.tokens and r.finish_reason == "length"
    assert_clean(kv)


def test_a_short_request_is_not_held_behind_a_long_max_tokens(seed: int) -> None:
    """A request asking for nearly the whole store does not hold it: a short request submitted while it decodes
    finishes long before it does."""
    model = tiny_model(seed)
    kv = KVSettings(host_pool_gib=pool_gib(model.cfg, 4)).build(model.cfg, dtype=torch.float64)
    engine = Engine(model, kv, SchedulerConfig(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64))
    long = engine.add_request([5] * 20, SamplingParams(max_tokens=230, temperature=0.0, ignore_eos=True))
    for _ in range(5):
        engine.step()
    short = engine.add_request([7] * 10, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    steps = 0
    while short.finish_reason is None:
        engine.step()
        steps += 1
    assert steps <= 6 and long.finish_reason is None and len(long.output) < 30
    while engine.has_work():
        engine.step()
    assert len(long.output) == 230
    assert_clean(kv)


def test_rejects_what_can_never_fit(seed: int) -> None:
    model = tiny_model(seed)
    kv = KVSettings(host_pool_gib=pool_gib(model.cfg, 2)).build(model.cfg, dtype=torch.float64)
    engine = Engine(model, kv, SchedulerConfig(max_model_len=1000))
    with pytest.raises(RequestError, match=r"maximum context length is 1000 tokens.*1010 tokens") as e:
        engine.add_request([1] * 10, SamplingParams(max_tokens=1000))
    assert e.value.field == "max_tokens"
    with pytest.raises(RequestError, match=r"needs 300 tokens.*at most 128 tokens"):
        engine.add_request([1] * 200, SamplingParams(max_tokens=100))
    with pytest.raises(RequestError, match="prompt"):
        engine.add_request([model.cfg.vocab_size], SamplingParams())
    with pytest.raises(RequestError, match="prompt"):
        engine.add_request([], SamplingParams())
    for bad, name in [(dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"),
                      (dict(max_tokens=0), "max_tokens"), (dict(stop_token_ids=(-1,)), "stop_token_ids")]:
        with pytest.raises(RequestError, match=name) as e:
            engine.add_request([1, 2], SamplingParams(**bad))
        assert e.value.field == name
    assert engine.inbox.empty() and not engine.has_work()


class FaultyKV(ResidentKV):
    """Fault injection: writing position `at` of request `bad` raises (as an exhausted device would)."""

    def __init__(self, *a, bad: str, at: int, **k):
        super().__init__(*a, **k)
        self.bad, self.at = bad, at

    def write(self, layer, seg, positions, rows):
        bad = [i for i, r in enumerate(self.tables.reqs) if r == self.bad]
        if bad and bool(((seg == bad[0]) & (positions >= self.at)).any()):
            raise RuntimeError("injected device failure")
        super().write(layer, seg, positions, rows)


def test_abort_and_failure_touch_no_neighbour(seed: int) -> None:
    model = tiny_model(seed)
    prompts = random_prompts(4, 10, 40, model.cfg.vocab_size, seed + 1)
    kv = FaultyKV(model.cfg, "fp8_ds_mla", dtype=torch.float64, bad="bad", at=len(prompts[0]) + 3)
    engine = Engine(model, kv, SchedulerConfig(max_model_len=512, max_num_seqs=3, max_num_batched_tokens=64))
    finals: dict[str, object] = {}
    params = SamplingParams(max_tokens=10, temperature=0.0)
    ids = ["bad", "keep-1", "abort-running", "abort-waiting"]
    reqs = [engine.add_request(p, params, rid, lambda o: finals.__setitem__(o.request_id, o) if o.finished else None)
            for p, rid in zip(prompts, ids)]
    for _ in range(4):
        engine.step()
    engine.abort("abort-running")
    engine.abort("abort-waiting")
    while engine.has_work() or not engine.inbox.empty():
        engine.step()
    assert finals["bad"].finish_reason == "error" and "injected device failure" in finals["bad"].error
    assert finals["abort-running"].finish_reason == "abort" and finals["abort-waiting"].finish_reason == "abort"
    assert 0 < len(reqs[2].output) < 10 and reqs[3].output == []
    ref = greedy_generate(model, ResidentKV(model.cfg, "fp8_ds_mla", dtype=torch.float64), prompts[1], 10)
    assert reqs[1].output == ref.tokens and finals["keep-1"].finish_reason == "length"
    assert_clean(kv)


def reference_distribution(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Independent numpy reference (vLLM/HF order): softmax(l / T) over the k largest, then the smallest prefix
    (by descending probability) of that distribution whose mass reaches top_p, renormalised."""
    z = logits / temperature
    order = np.argsort(-z, kind="stable")
    p = np.zeros_like(z)
    p[order[:top_k]] = np.exp(z[order[:top_k]] - z.max())
    p /= p.sum()
    keep = np.zeros_like(p, dtype=bool)
    mass = 0.0
    for i in order[:top_k]:
        if mass >= top_p:
            break
        keep[i] = True
        mass += p[i]
    q = np.where(keep, p, 0.0)
    return q / q.sum()


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, -1, 1.0), (0.7, 4, 1.0), (1.3, -1, 0.6),
                                                             (0.9, 5, 0.8)])
def test_sampling_matches_reference_distribution(seed: int, temperature: float, top_k: int, top_p: float) -> None:
    g = torch.Generator().manual_seed(seed)
    vocab, n = 8, 20000
    logits = torch.randn(vocab, generator=g) * 1.5
    reqs = [Request(str(i), [0], SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
            for i in range(n)]
    torch.manual_seed(seed)
    out = sample(logits.expand(n, vocab).clone(), SamplingBatch.from_requests(reqs, vocab, torch.device("cpu")))
    freq = np.bincount(out.numpy(), minlength=vocab) / n
    expected = reference_distribution(logits.double().numpy(), temperature, top_k if top_k > 0 else vocab, top_p)
    assert np.all(freq[expected == 0] == 0)
    sigma = np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(freq - expected) <= 5 * sigma + 1e-12), (freq, expected)


def test_sampling_greedy_forced_and_seeded_rows(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    vocab = 50
    logits = torch.randn(5, vocab, generator=g)
    ps = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=seed),
          SamplingParams(temperature=1.0, forced_token_ids=(7, 9)), SamplingParams(temperature=1.0),
          SamplingParams(temperature=1.0, seed=seed)]
    reqs = [Request(str(i), [0], p, generator=torch.Generator().manual_seed(p.seed) if p.seed is not None else None)
            for i, p in enumerate(ps)]
    reqs[2].output = [7]
    out = sample(logits, SamplingBatch.from_requests(reqs, vocab, torch.device("cpu"))).tolist()
    assert out[0] == int(logits[0].argmax()) and out[2] == 9
    # the seeded row's draw depends only on its own generator: alone, at another batch position, same token
    alone = Request("x", [0], ps[1], generator=torch.Generator().manual_seed(seed))
    assert sample(logits[1:2], SamplingBatch.from_requests([alone], vocab, torch.device("cpu"))).item() == out[1]
    alone = Request("y", [0], ps[4], generator=torch.Generator().manual_seed(seed))
    assert sample(logits[4:5], SamplingBatch.from_requests([alone], vocab, torch.device("cpu"))).item() == out[4]


def test_seeded_request_reproducible_regardless_of_batch(seed: int) -> None:
    model = tiny_model(seed, sharp=False)
    prompts = random_prompts(5, 4, 30, model.cfg.vocab_size, seed + 2)
    seeded = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.95, seed=seed)

    def run(batch_prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
        engine = Engine(model, ResidentKV(model.cfg, "fp8_ds_mla", dtype=torch.float64),
                        SchedulerConfig(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=16))
        return [r.output for r in engine.generate(batch_prompts, params)]

    alone = run(prompts[:1], [seeded])[0]
    crowd = run(prompts, [SamplingParams(max_tokens=7, temperature=1.0)] * 2 + [seeded] +
                [SamplingParams(max_tokens=12, temperature=0.5)] * 2)
    moved = [prompts[1], prompts[2], prompts[0], prompts[3], prompts[4]]
    assert run(moved, [SamplingParams(max_tokens=7, temperature=1.0)] * 2 + [seeded] +
               [SamplingParams(max_tokens=12, temperature=0.5)] * 2)[2] == alone
    other_seed = run(prompts[:1], [SamplingParams(max_tokens=10, temperature=1.0, top_p=0.95, seed=seed + 1)])[0]
    assert alone != other_seed
    assert len(crowd[0]) == 7 and len(crowd[3]) == 12


def test_stop_conditions(seed: int, tok) -> None:
    model = tiny_model(seed, dtype=torch.float32, sharp=False, vocab_size=tok.n_words)
    words = tok.encode("one two three four five", bos=False, eos=False)
    engine = Engine(model, ResidentKV(model.cfg, "fp8_ds_mla"), SchedulerConfig(max_model_len=256),
                    eos_id=tok.eos_id, decode=tok.decode)
    texts: dict[str, str] = {}

    def add(rid: str, **kw) -> Request:
        def sink(o):
            texts[rid] = texts.get(rid, "") + o.text_delta
        return engine.add_request(tok.encode("hi", bos=True, eos=False), SamplingParams(
            temperature=0.0, forced_token_ids=tuple(words) + (tok.eos_id,), **kw), rid, sink)

    reqs = {"string": add("string", max_tokens=20, stop=("three",)),
            "token": add("token", max_tokens=20, stop_token_ids=(words[1],)),
            "eos": add("eos", max_tokens=20),
            "ignore": add("ignore", max_tokens=len(words) + 3, ignore_eos=True),
            "length": add("length", max_tokens=2)}
    while engine.has_work() or not engine.inbox.empty():
        engine.step()
    assert texts["string"] == "one two " and reqs["string"].finish_reason == "stop"
    assert reqs["token"].output == words[:2] and reqs["token"].finish_reason == "stop"
    assert texts["eos"] == "one two three four five" and reqs["eos"].output[-1] == tok.eos_id
    assert reqs["eos"].finish_reason == "stop"
    assert len(reqs["ignore"].output) == len(words) + 3 and reqs["ignore"].finish_reason == "length"
    assert texts["length"] == tok.decode(words[:2]) and reqs["length"].finish_reason == "length"


def test_a_request_whose_detokenising_fails_fails_alone(seed: int, tok) -> None:
    """An error in one request's own output handling (here its text stream) ends that request with 'error'; the
    requests decoding beside it in the same steps finish normally, with their reference tokens."""
    model = tiny_model(seed, dtype=torch.float32, sharp=False, vocab_size=tok.n_words)
    kv = ResidentKV(model.cfg, "fp8_ds_mla")
    engine = Engine(model, kv, SchedulerConfig(max_model_len=256), eos_id=tok.eos_id, decode=tok.decode)
    prompts = random_prompts(3, 5, 20, model.cfg.vocab_size, seed + 3)
    finals: dict[str, object] = {}
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(p, params, f"r{i}", lambda o: finals.__setitem__(o.request_id, o) if o.finished
                               else None) for i, p in enumerate(prompts)]
    engine.step()   # admitted: each request has its text stream now

    def broken(tokens: list[int]) -> str:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
    engine.streams["r1"].push = broken
    while engine.has_work() or not engine.inbox.empty():
        engine.step()
    assert finals["r1"].finish_reason == "error" and "injected" in finals["r1"].error
    for i in (0, 2):
        ref = greedy_generate(model, ResidentKV(model.cfg, "fp8_ds_mla"), prompts[i], 6)
        assert reqs[i].output == ref.tokens and finals[f"r{i}"].finish_reason == "length"
    assert_clean(kv)


def test_sampling_vanishing_top_p_and_temperature_are_greedy(seed: int) -> None:
    """top_p and temperature that round to 0 in fp32 (1e-50, 1e-39) sample the argmax, never an empty set."""
    g = torch.Generator().manual_seed(seed)
    vocab = 64
    logits = torch.randn(4, vocab, generator=g) * 3
    ps = [SamplingParams(top_p=1e-50), SamplingParams(temperature=1e-39), SamplingParams(temperature=1e-6),
          SamplingParams(top_k=2**70)]
    reqs = [Request(str(i), [0], p) for i, p in enumerate(ps)]
    out = sample(logits, SamplingBatch.from_requests(reqs, vocab, torch.device("cpu")))
    assert out[:3].tolist() == logits[:3].argmax(-1).tolist()
    assert 0 <= int(out[3]) < vocab


def test_text_stream_utf8_and_stop_holdback(tok) -> None:
    text = "caf\u00e9 \u4e2d\u6587 \U0001f600 end of the story, and more"
    ids = tok.encode(text, bos=False, eos=False)
    # one id at a time: the deltas never show a broken character and add up to the whole text
    stream = TextStream(tok.decode)
    deltas = [stream.push([i]) for i in ids] + [stream.flush()]
    assert "".join(deltas) == text and all("\ufffd" not in d for d in deltas)
    # a stop string is cut off, and no prefix of it is ever shown
    stream = TextStream(tok.decode, stop=("story,", "zzz"))
    shown = ""
    for i in ids:
        shown += stream.push([i])
        assert "story"[:3] not in shown[len("caf\u00e9 \u4e2d\u6587 \U0001f600 end of the "):]
        if stream.stopped:
            break
    shown += stream.flush()
    assert stream.stopped and shown == "caf\u00e9 \u4e2d\u6587 \U0001f600 end of the "


def test_text_stream_shows_text_as_soon_as_it_is_safe() -> None:
    """Byte-level ids decoded by a toy decoder: text no stop string can start is shown at once; invalid bytes are
    committed as U+FFFD once 4 ids hold no whole character; a request ending mid-character commits what
    is pending at flush."""
    def decode(ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    stream = TextStream(decode, stop=("xyz",))
    assert [stream.push([b]) for b in b"ab"] == ["a", "b"]          # no suffix can start "xyz": nothing held
    assert stream.push([ord("x")]) == "" and stream.push([ord("q")]) == "xq"
    bad = TextStream(decode)
    # a UTF-8 character has at most 4 bytes: 4 ids without one are invalid, not a character still arriving
    assert [bad.push([0xF0]) for _ in range(4)] == ["", "", "", "\ufffd" * 4]
    cut = TextStream(decode)
    assert cut.push(list("é".encode())[:1]) == "" and cut.flush() == "\ufffd"


def test_limits_admit_their_boundary_and_refuse_one_past_it(seed: int) -> None:
    """max_num_seqs >= 1, max_num_batched_tokens >= max_num_seqs, prompt + max_tokens <= max_model_len: each holds at
    its boundary and fails one past it; a run without KV pressure preempts nothing."""
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1, got 0"):
        SchedulerConfig(max_model_len=64, max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=1)
    SchedulerConfig(max_model_len=64, max_num_seqs=1, max_num_batched_tokens=1)
    model = tiny_model(seed)
    engine = Engine(model, ResidentKV(model.cfg, "fp8_ds_mla", dtype=torch.float64),
                    SchedulerConfig(max_model_len=40, max_num_seqs=2, max_num_batched_tokens=16))
    with pytest.raises(RequestError, match="maximum context length is 40 tokens") as e:
        engine.add_request([1] * 30, SamplingParams(max_tokens=11))
    assert e.value.field == "max_tokens"
    reqs = engine.generate([[1] * 30, [2] * 5], SamplingParams(max_tokens=10, temperature=0.0))
    assert [len(r.output) for r in reqs] == [10, 10] and engine.scheduler.num_preemptions == 0


@pytest.mark.parametrize("groups, budget", [(3, 1), (2, 2), (2, 5)])
def test_fair_prefill_shares_each_step_between_groups(groups: int, budget: int) -> None:
    """Prefills of several groups share `fair_prefill_tokens` each step: the groups in turn (starting one later every
    step) get equal parts of what is left, the first at least one token, so every group progresses."""
    model = tiny_model(0)
    sched = Scheduler(SchedulerConfig(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
                                      fair_prefill_tokens=budget), ResidentKV(model.cfg, "fp8_ds_mla"))
    reqs = [Request(f"r{g}", [1] * 50, SamplingParams(max_tokens=4), group=f"g{g}") for g in range(groups)]
    for r in reqs:
        sched.add(r)
    for turn in range(2 * groups):
        step = sched.schedule()
        got = {r.id: s.length for r, s in zip(step.reqs, step.segments)}
        want, left = {}, budget                   # the groups in rotated order, each an equal part of what is left
        for k in range(groups):
            g = (turn + k) % groups
            n = left // (groups - k) or (1 if k == 0 else 0)
            if n:
                want[f"r{g}"] = n
            left -= n
        assert got == want, f"step {turn}"
        for r, s in zip(step.reqs, step.segments):
            r.num_computed += s.length
