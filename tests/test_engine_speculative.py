"""DSpark speculative decoding inside the serving engine: greedy with speculation == without
(HiSparse on, prompts several times the hot buffer, several requests, prefill chunks in the verify forwards),
an oracle drafter gets every draft accepted and counted, stop conditions cut exactly where plain decoding stops,
seeded sampling stays reproducible whatever the batch, batched drafting == per-request drafting, `hisparse serve
--speculative-config` (errors, and a real server whose greedy completions equal plain decoding, with moving
/metrics)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import openai
import pytest
import torch

from conftest import tiny_model
from hisparse.cli import main as cli_main
from hisparse.engine.cuda_graphs import DecodeGraphs
from hisparse.engine.engine import Engine, StepStats
from hisparse.engine.full_graph import FullGraphs
from hisparse.engine.generate import greedy_generate
from hisparse.engine.request import Request, SamplingParams
from hisparse.engine.scheduler import SchedulerConfig
from hisparse.engine.speculative import (OracleProposer, SpeculativeConfig, accept_greedy, accept_greedy_batch,
                                         batch_draft_sampler, draft_sampler, speculative_generate)
from hisparse.kv.hisparse_kv import HiSparseKV
from hisparse.model.dspark import DSparkDrafter
from hisparse.kv.resident import ResidentKV
from hisparse.model.tiny import builtin_tiny
from hisparse.model.tokenizer import load_tokenizer
from hisparse.model.weights import load_model
from hisparse.server.metrics import Metrics
from test_engine import assert_clean
from serving import KEY, Server, launch

pytestmark = pytest.mark.usefixtures("single_thread")
NEW, HOT, WINDOW = 64, 16, 8
SCHED = SchedulerConfig(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=40)
# tiny, cut to 4 layers that keep a KV consumer (3 reads 1) and an index follower (2 follows 1); 2 draft layers
FAST = dict(n_layers=4, no_rope_layers=[1, 0, 1, 0], kv_source_layers=[0, 1, 2, 1], index_source_layers=[0, 1, 1, 3],
            mtp={"n_layers": 2, "target_layer_ids": [1, 2, 3]})


class NoisyDrafter(DSparkDrafter):
    """The real batched DSpark drafter, with each draft replaced by the request's true next greedy token with
    probability `rate`, so partial acceptances of every length happen."""

    def __init__(self, model, sequences: dict[str, list[int]], rate: float, seed: int):
        super().__init__(model)
        self.sequences, self.rate = sequences, rate
        self.g = torch.Generator().manual_seed(seed)

    def propose_batch(self, reqs, anchors, pos, n, sample):
        drafts, q = super().propose_batch(reqs, anchors, pos, n, sample)
        truth = torch.tensor([(self.sequences[r][p + 1:p + 1 + n] + [0] * n)[:n] for r, p in zip(reqs, pos.tolist())])
        return torch.where(torch.rand(truth.shape, generator=self.g) < self.rate, truth, drafts.cpu()), q


class CheckedKV(HiSparseKV):
    """HiSparseKV that checks that every layer gathers once per step for the whole batch (a verify segment's rows
    are resolved together with every other request's), and records the highest position written per request."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.max_pos: dict[str, int] = {}
        self.gathers: Counter = Counter()

    def begin_step(self, segments, *args, **kw):
        views = super().begin_step(segments, *args, **kw)
        self.gathers.clear()
        return views

    def write(self, layer, seg, positions, rows):
        for i, req in enumerate(self.tables.reqs):
            mine = positions[seg == i]
            if mine.numel():
                self.max_pos[req] = max(self.max_pos.get(req, -1), int(mine.max()))
        super().write(layer, seg, positions, rows)

    def gather(self, layer, seg, sel):
        self.gathers[layer] += 1
        assert self.gathers[layer] == 1, f"layer {layer}: gathered twice in one step"
        return super().gather(layer, seg, sel)


def checked_kv(model) -> CheckedKV:
    return CheckedKV(model.cfg, "fp8_ds_mla", dtype=model.dtype, host_pool_gib=0.02, hot_buffer_tokens=HOT,
                     resident_window=WINDOW)


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
        ids: list[str] | None = None) -> tuple[list[Request], list[StepStats]]:
    """Submit with ids r0, r1, ... (or `ids`) and step to completion; the requests and every step's stats."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    ids = ids or [f"r{i}" for i in range(len(prompts))]
    reqs = [engine.add_request(p, sp, rid) for p, sp, rid in zip(prompts, plist, ids)]
    steps = []
    while engine.has_work() or not engine.inbox.empty():
        steps.append(engine.step())
    return reqs, steps


def random_prompts(lens: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module")
def greedy_case(seed: int):
    """fp64 sharpened 4-layer tiny model, 3 prompts of 3-6x the hot buffer, and their greedy outputs from the
    engine with speculation off (HiSparse on)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)    # module scope runs before the per-test single_thread fixture
    try:
        model = tiny_model(seed, **FAST)
        prompts = random_prompts([3 * HOT + seed % 7, 5 * HOT, 4 * HOT + 3], model.cfg.vocab_size, seed)
        reqs, _ = run(Engine(model, checked_kv(model), SCHED), prompts, SamplingParams(max_tokens=NEW, temperature=0))
    finally:
        torch.set_num_threads(prev)
    return model, prompts, {r.id: r.output for r in reqs}


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_verify_steps_through_decode_graphs_keep_the_greedy_tokens(greedy_case, mode: str) -> None:
    """Piecewise or full-step decode graphs (uncaptured on the CPU) run the verify forwards (anchor + drafts,
    every row's logits) and feed the checkpoint's drafter its tapped hidden states: the greedy outputs stay those
    without speculation."""
    model, prompts, ref = greedy_case
    spec = SpeculativeConfig.parse({"method": "dspark", "num_speculative_tokens": 3}, model.cfg)
    kv = checked_kv(model)
    graphs = (DecodeGraphs(model, SCHED.max_num_seqs * 4, capture=False) if mode == "piecewise" else
              FullGraphs(model, kv, SCHED.max_num_seqs, 4))
    engine = Engine(model, kv, SCHED, speculative=spec, graphs=graphs)
    reqs, steps = run(engine, prompts, SamplingParams(max_tokens=NEW, temperature=0))
    assert {r.id: r.output for r in reqs} == ref
    assert engine.speculator.stats.steps > 0 and graphs.steps >= NEW // 4     # verify steps ran through graphs


@pytest.mark.parametrize("n_spec", [1, 2, 3])
def test_greedy_with_speculation_equals_without(greedy_case, n_spec: int, seed: int) -> None:
    model, prompts, ref = greedy_case
    kv = checked_kv(model)
    drafter = NoisyDrafter(model, {rid: p + ref[rid] for rid, p in zip(ref, prompts)}, 0.7, seed)
    spec = SpeculativeConfig.parse({"method": "dspark", "num_speculative_tokens": n_spec}, model.cfg)
    engine = Engine(model, kv, SCHED, speculative=spec, proposer=drafter)
    reqs, steps = run(engine, prompts, SamplingParams(max_tokens=NEW, temperature=0))
    for r in reqs:
        assert r.output == ref[r.id], f"seed {seed}: N={n_spec}: {r.id} differs from decoding without speculation"
        assert r.finish_reason == "length" and kv.max_pos[r.id] < r.max_len - 1   # drafts stay inside max_tokens
    st = engine.speculator.stats
    assert 0 < st.accepted < st.proposed and sum(st.histogram) == st.steps
    plain_decodes = len(prompts) * (NEW - 1) - (st.steps + st.accepted)   # a verify emits accepted + 1 tokens
    assert 0 <= plain_decodes <= len(prompts)       # only a request's last token may come without drafts
    assert sum(len(s.spec_accepted) for s in steps) == st.steps
    assert sum(s.spec_draft_tokens for s in steps) == st.proposed
    assert sum(s.generation_tokens for s in steps) == len(prompts) * NEW
    assert any(s.prompt_tokens and s.spec_accepted for s in steps), "prefill chunks must share verify forwards"
    assert kv.stats.misses > 0, "the context must really be served from the host pool"
    assert drafter.cache.nbytes() == 0
    assert_clean(kv)


def test_preemption_with_speculation_keeps_the_greedy_tokens(greedy_case, seed: int) -> None:
    """A host pool with room for the longest request alone: the first two requests start together and fill it
    with their prompts, so the first one's growth preempts the second mid-run (its drafter state dropped with its
    KV) whatever the drafts accepted; it recomputes and continues, and every request still produces the tokens of
    decoding without speculation."""
    model, prompts, ref = greedy_case
    probe = checked_kv(model)
    page_bytes, page_tokens = probe.pool.page_bytes, probe.pool.page_tokens
    pages = -(-max(len(p) + NEW for p in prompts) // page_tokens)
    kv = CheckedKV(model.cfg, "fp8_ds_mla", dtype=model.dtype, host_pool_gib=pages * page_bytes / 2**30,
                   hot_buffer_tokens=HOT, resident_window=WINDOW)
    first_two = sum(-(-(len(p) + 3) // page_tokens) for p in prompts[:2])
    assert kv.token_capacity() == pages * page_tokens and first_two == pages    # the premise of the test
    drafter = NoisyDrafter(model, {rid: p + ref[rid] for rid, p in zip(ref, prompts)}, 0.7, seed)
    spec = SpeculativeConfig.parse({"method": "dspark", "num_speculative_tokens": 3}, model.cfg)
    engine = Engine(model, kv, SCHED, speculative=spec, proposer=drafter)
    reqs, _ = run(engine, prompts, SamplingParams(max_tokens=NEW, temperature=0))
    assert engine.scheduler.num_preemptions > 0
    for r in reqs:
        assert r.output == ref[r.id] and r.finish_reason == "length"
    assert drafter.cache.nbytes() == 0
    assert_clean(kv)


def test_oracle_drafter_every_draft_accepted(greedy_case) -> None:
    model, prompts, ref = greedy_case
    engine = Engine(model, checked_kv(model), SCHED, speculative=SpeculativeConfig(num_speculative_tokens=3),
                    proposer=OracleProposer({rid: p + ref[rid] for rid, p in zip(ref, prompts)}))
    reqs, steps = run(engine, prompts, SamplingParams(max_tokens=NEW, temperature=0))
    assert [r.output for r in reqs] == list(ref.values())
    st = engine.speculator.stats
    per_req = -(-(NEW - 1) // 4)                                      # 63 tokens after the first, 4 per verify
    assert st.accepted == st.proposed and st.steps == len(prompts) * per_req
    assert st.histogram == [0, 0, len(prompts), len(prompts) * (per_req - 1)]   # the last verify: 2 drafts
    assert [n for s in steps for n in s.spec_accepted].count(3) == len(prompts) * (per_req - 1)


class RecordingDrafter(DSparkDrafter):
    """The real drafter, logging every proposal as (request, position, drafts)."""

    def __init__(self, model):
        super().__init__(model)
        self.log: list[tuple[str, int, list[int]]] = []

    def propose_batch(self, reqs, anchors, pos, n, sample):
        drafts, q = super().propose_batch(reqs, anchors, pos, n, sample)
        self.log += list(zip(reqs, pos.tolist(), drafts.tolist()))
        return drafts, q


def test_engine_feeds_the_drafter_like_the_single_request_decoder(greedy_case) -> None:
    """The engine's context path (taps of prefill chunks split by the token budget, of plain decode rows and of
    each verify's kept rows) fills the draft window exactly as the single-request decoder does: with the
    checkpoint's drafter, every proposal of every request equals."""
    model, prompts, ref = greedy_case
    spec = SpeculativeConfig(num_speculative_tokens=3)
    drafter = RecordingDrafter(model)
    reqs, _ = run(Engine(model, checked_kv(model), SCHED, speculative=spec, proposer=drafter), prompts,
                  SamplingParams(max_tokens=20, temperature=0))
    for r, prompt in zip(reqs, prompts):
        single = RecordingDrafter(model)
        out, _ = speculative_generate(model, ResidentKV(model.cfg, "fp8_ds_mla", dtype=model.dtype), single, prompt,
                                      20, spec, req=r.id)
        assert r.output == out == ref[r.id][:20]
        assert [(p, d) for rid, p, d in drafter.log if rid == r.id] == [(p, d) for _, p, d in single.log]


def test_batched_drafting_equals_per_request(seed: int) -> None:
    """observe_batch / propose_batch over 3 requests at different positions == one request at a time (greedy
    drafts, and the probabilistic q with each request's own generator)."""
    model = tiny_model(seed)
    D, W = model.cfg.dim, model.cfg.mtp.sliding_window
    g = torch.Generator().manual_seed(seed)
    lens = [W + 5, 7, 2 * W]
    taps = {l: torch.randn(sum(lens), D, generator=g, dtype=model.dtype) for l in model.cfg.mtp.target_layer_ids}
    positions = torch.cat([torch.arange(n) for n in lens])
    ids, anchors, pos = ["a", "b", "c"], torch.randint(0, 512, (3,), generator=g), torch.tensor(lens)
    batched, single = DSparkDrafter(model), DSparkDrafter(model)
    batched.observe_batch(ids, taps, positions, lens)
    for i, (rid, sl) in enumerate(zip(ids, torch.arange(sum(lens)).split(lens))):
        single.observe(rid, {l: t[sl] for l, t in taps.items()}, positions[sl])
        assert torch.equal(batched.cache.read(rid)[1], single.cache.read(rid)[1])
        assert torch.equal(batched.cache.read(rid)[0], single.cache.read(rid)[0])
    greedy = batch_draft_sampler("greedy", [SamplingParams()] * 3, [None] * 3)
    d, q = batched.propose_batch(ids, anchors, pos, 3, greedy)
    assert q is None
    for i, rid in enumerate(ids):
        one, _ = single.propose(rid, int(anchors[i]), lens[i], 3, draft_sampler("greedy", SamplingParams(), None))
        assert one.tolist() == d[i].tolist()
    params = [SamplingParams(temperature=t, top_k=k) for t, k in ((1.0, -1), (0.7, 20), (1.3, -1))]
    d, q = batched.propose_batch(ids, anchors, pos, 3, batch_draft_sampler(
        "probabilistic", params, [torch.Generator().manual_seed(seed + i) for i in range(3)]))
    for i, rid in enumerate(ids):
        one, q1 = single.propose(rid, int(anchors[i]), lens[i], 3,
                                 draft_sampler("probabilistic", params[i], torch.Generator().manual_seed(seed + i)))
        assert one.tolist() == d[i].tolist() and torch.allclose(q1, q[i], atol=1e-12)
    # greedy acceptance, batched, equals the single-segment helper on random segments
    logits = [torch.randn(n + 1, 9, generator=g) for n in (0, 3, 2, 3)]
    drafts = [lg[:-1].argmax(-1).tolist() for lg in logits]
    drafts[1][2] = (drafts[1][2] + 1) % 9
    drafts[3][0] = (drafts[3][0] + 1) % 9
    n_acc, nxt = accept_greedy_batch(logits, drafts)
    assert n_acc == [0, 2, 2, 0]
    assert list(zip(n_acc, nxt)) == [accept_greedy(lg, torch.tensor(d, dtype=torch.long))
                                     for lg, d in zip(logits, drafts)]


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_seeded_sampling_reproducible_with_speculation(method: str, seed: int) -> None:
    model = tiny_model(seed, sharp=False, **FAST)
    prompts = random_prompts([20, 9, 30, 14], model.cfg.vocab_size, seed + 3)
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=seed)
    others = [SamplingParams(max_tokens=9, temperature=0.0), SamplingParams(max_tokens=12, temperature=0.8),
              SamplingParams(max_tokens=14, temperature=1.0, top_k=30, seed=seed + 5)]
    spec = SpeculativeConfig(num_speculative_tokens=3, draft_sample_method=method)

    def go(ps: list[list[int]], params: list[SamplingParams]) -> tuple[list[list[int]], Engine]:
        engine = Engine(model, ResidentKV(model.cfg, "fp8_ds_mla", dtype=model.dtype),
                        SchedulerConfig(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=24), speculative=spec)
        reqs, _ = run(engine, ps, params)
        return [r.output for r in reqs], engine

    (alone,), engine = go(prompts[:1], [seeded])
    st = engine.speculator.stats
    if method == "probabilistic":   # near-uniform target and drafter: sampled drafts are mostly accepted
        assert st.accepted > 0
    else:                           # argmax drafts of a random drafter: rejected, corrections from the generator
        assert 0 < st.steps and st.accepted < st.proposed
    crowd, engine = go(prompts[1:3] + prompts[:1] + prompts[3:], others[:2] + [seeded] + others[2:])
    assert crowd[2] == alone and engine.speculator.stats.steps > 0
    assert go(prompts[:1], [SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=seed + 1)])[0][0] != alone
    assert [len(c) for c in crowd] == [9, 12, 16, 14]


@pytest.fixture(scope="module")
def tok():
    """The Tekken tokenizer of the built-in tiny checkpoint (the one `hisparse serve` serves by default)."""
    return load_tokenizer(builtin_tiny()).instruct_tokenizer.tokenizer


def test_stop_conditions_cut_where_plain_decoding_stops(seed: int, tok) -> None:
    """The oracle makes every step emit 4 tokens; eos, a stop id, a stop string and max_tokens chosen to end
    mid-step must give exactly the tokens, text and finish reason of decoding without speculation."""
    prompt = tok.encode("one two three", bos=True, eos=False)
    # Not sharpened: over the 131k-token vocabulary a sharpened model's logits saturate the soft cap, so greedy
    # ties are broken by the last bit of a logit, which a batched forward need not reproduce bit for bit.
    for s in range(seed, seed + 16):   # a random model may fall into a loop of few tokens: then draw the next one
        model = tiny_model(s, dtype=torch.float32, sharp=False, vocab_size=tok.n_words, **FAST)
        free = greedy_generate(model, ResidentKV(model.cfg, "fp8_ds_mla"), prompt, 24).tokens
        texts = [tok.decode(free[:i]) for i in range(len(free) + 1)]
        mid = [k for k in range(2, 22) if (k - 1) % 4 != 3 and free[k] not in free[:k]]   # not a step's last token
        strs = [k for k in mid[1:] if texts[k + 1].startswith(texts[k]) and texts[k + 1] != texts[k]
                and texts[k + 1][len(texts[k]):] not in texts[k]]
        if strs:
            break
    else:
        pytest.fail(f"seeds {seed}..{seed + 15}: no greedy generation has two new tokens mid-step and a stop string")
    k_eos, k_id, k_str = mid[0], mid[1], strs[0]
    cases = {"eos": SamplingParams(max_tokens=24, temperature=0),
             "id": SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=(free[k_id],)),
             "string": SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                      stop=(texts[k_str + 1][len(texts[k_str]):],)),
             "length": SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
             "ignore": SamplingParams(max_tokens=23, temperature=0, ignore_eos=True)}

    def go(spec: SpeculativeConfig | None):
        shown: dict[str, str] = {}
        engine = Engine(model, ResidentKV(model.cfg, "fp8_ds_mla"), SchedulerConfig(max_model_len=256),
                        eos_id=free[k_eos], decode=tok.decode, speculative=spec,
                        proposer=OracleProposer(prompt + free) if spec else None)
        reqs = {rid: engine.add_request(prompt, sp, rid, lambda o: shown.__setitem__(
            o.request_id, shown.get(o.request_id, "") + o.text_delta)) for rid, sp in cases.items()}
        while engine.has_work() or not engine.inbox.empty():
            engine.step()
        return {rid: (r.output, r.finish_reason, shown[rid]) for rid, r in reqs.items()}, engine

    plain, _ = go(None)
    spec, engine = go(SpeculativeConfig(num_speculative_tokens=3))
    assert spec == plain
    assert engine.speculator.stats.accepted == engine.speculator.stats.proposed > 0
    want = {"eos": (k_eos + 1, "stop"), "id": (k_id + 1, "stop"), "string": (k_str + 1, "stop"),
            "length": (7, "length"), "ignore": (23, "length")}
    assert {rid: (len(out), why) for rid, (out, why, _) in plain.items()} == want
    piece = cases["string"].stop[0]
    assert plain["string"][2] == texts[k_str + 1][:texts[k_str + 1].find(piece)] and plain["ignore"][0] == free[:23]


def servable(folder: Path, params: dict, weights: Path) -> Path:
    """A checkpoint folder `serve` accepts: `params`, a link to `weights` and an empty tekken.json (never read:
    a bad --speculative-config is refused before the tokenizer and the weights load)."""
    folder.mkdir()
    (folder / "params.json").write_text(json.dumps(params))
    (folder / "consolidated.safetensors").symlink_to(weights)
    (folder / "tekken.json").touch()
    return folder


def test_serve_speculative_config_errors(tmp_path: Path, tiny_ckpt: Path) -> None:
    """Refused before any weight loads, naming the field; a checkpoint without an `mtp` block is refused."""
    params = json.loads((tiny_ckpt / "params.json").read_text())
    ckpt = servable(tmp_path / "mtp", params, tiny_ckpt / "consolidated.safetensors")
    for spec, field in [('{"method": "eagle"}', "speculative_config.method"),
                        ('{"num_speculative_tokens": 4}', "speculative_config.num_speculative_tokens"),
                        ('{"num_speculative_tokens": 0}', "speculative_config.num_speculative_tokens"),
                        ('{"num_speculative_tokens": "3"}', "speculative_config.num_speculative_tokens"),
                        ('{"draft_sample_method": "top1"}', "speculative_config.draft_sample_method"),
                        ('{"num_speculative_token": 3}', "num_speculative_token"), ("{nope", "not valid JSON")]:
        with pytest.raises(SystemExit, match="--speculative-config") as e:
            cli_main(["serve", "--model", str(ckpt), "--speculative-config", spec])
        assert field in str(e.value)
    del params["mtp"]
    ckpt = servable(tmp_path / "no-mtp", params, tiny_ckpt / "consolidated.safetensors")
    with pytest.raises(SystemExit, match="no 'mtp' block"):
        cli_main(["serve", "--model", str(ckpt), "--speculative-config", '{"method": "dspark"}'])


def test_spec_decode_metrics() -> None:
    """Steps with verify segments move the vLLM-style spec_decode counters, histogram and mean gauge."""
    from prometheus_client.parser import text_string_to_metric_families
    m = Metrics()
    m.observe(StepStats(2, 0, spec_draft_tokens=8, spec_accepted=[3, 0, 2]))
    m.observe(StepStats(1, 0, generation_tokens=1))                          # a step without verifies
    m.observe(StepStats(1, 0, spec_draft_tokens=3, spec_accepted=[1]))
    got = {s.name + "".join(f"{{{v}}}" for v in s.labels.values()): s.value
           for fam in text_string_to_metric_families(m.render().decode()) for s in fam.samples}
    assert got["hisparse_spec_decode_num_drafts_total"] == 4
    assert got["hisparse_spec_decode_num_draft_tokens_total"] == 11
    assert got["hisparse_spec_decode_num_accepted_tokens_total"] == 6
    assert [got[f"hisparse_spec_decode_num_accepted_tokens_per_pos_total{{{i}}}"] for i in range(3)] == [3, 2, 1]
    hist = "hisparse_spec_decode_acceptance_length"
    assert got[f"{hist}_count"] == 4 and got[f"{hist}_sum"] == 10
    assert [got[f"{hist}_bucket{{{le}}}"] for le in ("1.0", "2.0", "3.0", "4.0")] == [1, 2, 3, 4]
    assert got["hisparse_spec_decode_mean_accepted_tokens_per_step"] == 1.5


# ------------------------------------------------------------------------------------------ a real server

@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory):
    with launch(tmp_path_factory.mktemp("logs") / "serve.log",
                "--speculative-config", '{"method": "dspark", "num_speculative_tokens": 3}') as s:
        yield s


def test_server_with_speculation(spec_server: Server, tok, seed: int) -> None:
    """Concurrent greedy completions (one prompt 8x the hot buffer) equal plain greedy decoding of each prompt
    alone (what the server without --speculative-config returns, tests/test_server_completions.py); the draft
    counters move; seeded sampling is reproducible."""
    log = spec_server.log.read_text()
    assert "Speculative decoding: dspark, 3 draft tokens per step (draft_sample_method greedy)" in log
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1000, 131072, (n,), generator=g).tolist() for n in (8 * HOT, 21, 9)]
    torch.set_num_threads(1)
    model = load_model(spec_server.ckpt)
    refs = [tok.decode(greedy_generate(model, ResidentKV(model.cfg, "fp8_ds_mla"), p, 12).tokens) for p in prompts]
    before = spec_server.wait_idle()
    client = openai.AsyncOpenAI(base_url=f"{spec_server.url}/v1", api_key=KEY, max_retries=0, timeout=120)

    async def one(p: list[int]) -> str:
        return (await client.completions.create(model=spec_server.name, prompt=p, max_tokens=12,
                                                temperature=0)).choices[0].text

    async def all_of():
        return await asyncio.gather(*[one(p) for p in prompts])
    assert asyncio.run(all_of()) == refs
    m = spec_server.wait_idle()
    d = {k: m[k] - before.get(k, 0.0) for k in m}
    steps = d["hisparse_spec_decode_num_drafts_total"]
    assert steps >= len(prompts) and d["hisparse_spec_decode_num_draft_tokens_total"] >= steps
    assert 0 <= d["hisparse_spec_decode_num_accepted_tokens_total"] <= d["hisparse_spec_decode_num_draft_tokens_total"]
    assert d["hisparse_spec_decode_acceptance_length_count"] == steps
    assert (d["hisparse_spec_decode_acceptance_length_sum"]
            == steps + d["hisparse_spec_decode_num_accepted_tokens_total"])
    assert d["hisparse_generation_tokens_total"] == 3 * 12 and "hisparse_spec_decode_mean_accepted_tokens_per_step" in m
    sync = spec_server.client()

    def sampled(s: int) -> str:
        return sync.completions.create(model=spec_server.name, prompt="Once upon a time", max_tokens=10,
                                       temperature=1.0, top_p=0.9, seed=s).choices[0].text
    a = sampled(seed)
    assert sampled(seed) == a and sampled(seed + 1) != a
