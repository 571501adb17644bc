"""Speculative decoding with DSpark (spec §5.3, §6): greedy output == plain greedy decoding (ResidentKV and
HiSparseKV), an oracle drafter gets every draft accepted, rollback leaves no stale row readable, and rejection
sampling preserves the target distribution (chi-square, on synthetic distributions and end to end)."""

from __future__ import annotations

import pytest
import torch

from conftest import random_tokens, tiny_model
from hisparse.engine.generate import greedy_generate
from hisparse.kv.settings import KVSettings
from hisparse.engine.request import SamplingParams
from hisparse.engine.speculative import (OracleProposer, SpecState, SpeculativeConfig, SpeculativeDecoder,
                                         accept_rejection, processed_probs, speculative_generate)
from hisparse.core.batch import Segment
from hisparse.core.config import preset
from hisparse.model.dspark import DSparkDrafter
from hisparse.kv.resident import ResidentKV

pytestmark = pytest.mark.usefixtures("single_thread")
PROMPT, NEW = 40, 64


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells expecting < 5 are pooled. P(X >= stat) = Q(df/2, stat/2)."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    expected = probs / probs.sum() * counts.sum()
    big = expected >= 5
    obs = torch.cat((counts[big], counts[~big].sum()[None]))
    exp = torch.cat((expected[big], expected[~big].sum()[None]))
    if exp[-1] < 1e-12:
        if obs[-1] > 0:
            return 0.0
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2.0, dtype=torch.float64), stat / 2))


class NoisyOracle(DSparkDrafter):
    """The real DSpark drafter (context path, window cache, block, Markov head), with each draft replaced by the
    target's true next greedy token with probability `rate`: partial acceptances of every length happen."""

    def __init__(self, model, sequence: list[int], rate: float, seed: int):
        super().__init__(model)
        self.sequence, self.rate = sequence, rate
        self.g = torch.Generator().manual_seed(seed)

    def propose(self, req, anchor, pos, n, sample):
        drafts, q = super().propose(req, anchor, pos, n, sample)
        truth = torch.tensor((self.sequence[pos + 1: pos + 1 + n] + [0] * n)[:n])
        return torch.where(torch.rand(n, generator=self.g) < self.rate, truth, drafts), q


@pytest.fixture(scope="module")
def greedy_case(seed: int):
    """fp64 sharpened tiny model, a prompt longer than the draft window, and its plain greedy continuation."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)    # module scope runs before the per-test single_thread fixture
    try:
        model = tiny_model(seed)
        prompt = random_tokens(PROMPT, model.cfg.vocab_size, seed).tolist()
        ref = greedy_generate(model, ResidentKV(model.cfg, None, dtype=model.dtype), prompt, NEW).tokens
    finally:
        torch.set_num_threads(prev)
    return model, prompt, ref


@pytest.mark.parametrize("n_spec", [1, 2, 3])
def test_greedy_equals_plain_greedy(greedy_case, n_spec: int, seed: int) -> None:
    model, prompt, ref = greedy_case
    cfg = SpeculativeConfig.parse({"method": "dspark", "num_speculative_tokens": n_spec}, model.cfg)
    proposer = NoisyOracle(model, prompt + ref, 0.7, seed)
    out, stats = speculative_generate(model, ResidentKV(model.cfg, None, dtype=model.dtype), proposer, prompt,
                                      NEW, cfg)
    assert out == ref, f"seed {seed}: N={n_spec}: speculative greedy differs from plain greedy"
    assert 0 < stats.accepted < stats.proposed and sum(stats.histogram) == stats.steps
    assert stats.steps + stats.accepted == NEW - 1                # every step emits accepted + 1 tokens
    assert proposer.cache.nbytes() == 0                           # released with the request


def test_checkpoint_drafter_greedy_equals_plain_greedy(greedy_case, seed: int) -> None:
    """The (random) DSpark drafter itself, N = 3: same tokens; its acceptance length is reported."""
    model, prompt, ref = greedy_case
    cfg = SpeculativeConfig.parse('{"method": "dspark", "num_speculative_tokens": 3}', model.cfg)
    out, stats = speculative_generate(model, ResidentKV(model.cfg, None, dtype=model.dtype), DSparkDrafter(model),
                                      prompt, NEW, cfg)
    print(f"[seed {seed}] random tiny drafter: acceptance length {stats.acceptance_length:.3f}, "
          f"histogram {stats.histogram}")
    assert out == ref


def test_oracle_drafter_gets_every_draft_accepted(greedy_case) -> None:
    model, prompt, ref = greedy_case
    out, stats = speculative_generate(model, ResidentKV(model.cfg, None, dtype=model.dtype),
                                      OracleProposer(prompt + ref), prompt, NEW, SpeculativeConfig())
    assert out == ref
    assert stats.accepted == stats.proposed and stats.steps == -(-(NEW - 1) // 4)
    assert stats.histogram[3] == (NEW - 1) // 4


def test_greedy_equals_plain_greedy_with_hisparse(seed: int) -> None:
    """HiSparse on, a prompt several times the hot buffer (and the resident window): speculative greedy with
    partial acceptances gives the tokens of plain greedy decoding on ResidentKV with the same row layout."""
    model = tiny_model(seed)
    prompt = random_tokens(96, model.cfg.vocab_size, seed).tolist()

    def kv(offload: str):
        return KVSettings(offload, "fp8_ds_mla", host_pool_gib=0.01, hot_buffer_tokens=16,
                          resident_window=8).build(model.cfg, dtype=model.dtype)
    ref = greedy_generate(model, kv("none"), prompt, NEW).tokens
    hs = kv("hisparse")
    out, stats = speculative_generate(model, hs, NoisyOracle(model, prompt + ref, 0.7, seed), prompt, NEW,
                                      SpeculativeConfig(num_speculative_tokens=3))
    assert out == ref
    assert 0 < stats.accepted < stats.proposed
    assert hs.stats.misses > 0, "the context must really be served from the host pool"


@pytest.mark.parametrize("offload", ["none", "hisparse"])
def test_rollback_leaves_no_stale_row_readable(offload: str, seed: int) -> None:
    """Verify [a, x1, x2, x3] (all rejected), roll back to P + 1, then continue with other tokens: every later
    logit equals a run that never saw x1..x3 (bit-exact: the same rows, never the stale ones)."""
    model = tiny_model(seed)
    cfg = model.cfg
    toks = random_tokens(80, cfg.vocab_size, seed).tolist()
    prompt, a, stale, cont = toks[:60], toks[60], toks[61:64], toks[64:72]
    P = len(prompt)

    def kv():
        return KVSettings(offload, "fp8_ds_mla", host_pool_gib=0.01, hot_buffer_tokens=16,
                          resident_window=2).build(cfg, dtype=model.dtype)

    def run(kv_, first: list[int]) -> list[torch.Tensor]:
        out = [model(torch.tensor(first), [Segment(0, P + 1, len(first))], kv_)]
        for i, t in enumerate(cont[len(first):]):
            out.append(model(torch.tensor([t]), [Segment(0, P + 1 + len(first) + i, 1)], kv_))
        return out

    spec_kv, ref_kv = kv(), kv()
    for k in (spec_kv, ref_kv):
        model(torch.tensor(prompt), [Segment(0, 0, P)], k)
    model(torch.tensor([a] + stale), [Segment(0, P, 4)], spec_kv)
    spec_kv.truncate(0, P + 1)
    model(torch.tensor([a]), [Segment(0, P, 1)], ref_kv)
    for got, want in zip(run(spec_kv, cont[:2]), run(ref_kv, cont[:2])):
        assert torch.equal(got, want)


def test_speculative_config_errors() -> None:
    cfg = preset("tiny")
    assert SpeculativeConfig.parse("{}", cfg) == SpeculativeConfig("dspark", 3, "greedy")
    bad = {'{"method": "eagle"}': "method", '{"num_speculative_tokens": 4}': "num_speculative_tokens",
           '{"num_speculative_tokens": 0}': "num_speculative_tokens", '{"draft_sample_method": "topk"}':
           "draft_sample_method", '{"model": "x"}': "unknown", "{": "JSON"}
    for spec, field in bad.items():
        with pytest.raises(ValueError, match=field):
            SpeculativeConfig.parse(spec, cfg)
    from dataclasses import replace
    with pytest.raises(ValueError, match="no 'mtp' block"):
        SpeculativeConfig.parse("{}", replace(cfg, mtp=None, layers=cfg.layers))


# ------------------------------------------------------------------------------------------ distribution

def random_dist(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.softmax(1.5 * torch.randn(*shape, generator=g, dtype=torch.float64), dim=-1)


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_rejection_sampling_preserves_target_joint(method: str, seed: int) -> None:
    """A two-token world: target pi(x1), pi(x2 | x1), drafter q(x1), q(x2 | x1). Each trial drafts two tokens
    (argmax of q, or samples of q), runs accept_rejection, and completes the pair with the target if only one
    token came out. The pairs must follow pi(x1) pi(x2 | x1); the raw drafts must not."""
    V, trials = 5, 4000
    g = torch.Generator().manual_seed(seed)
    pi1, pi2, pi3 = random_dist(g, V), random_dist(g, V, V), random_dist(g, V, V, V)
    q1, q2 = random_dist(g, V), random_dist(g, V, V)
    counts, raw = torch.zeros(V, V), torch.zeros(V, V)
    for _ in range(trials):
        if method == "greedy":
            d1 = int(q1.argmax())
            d2 = int(q2[d1].argmax())
            q = None
        else:
            d1 = int(torch.multinomial(q1, 1, generator=g))
            d2 = int(torch.multinomial(q2[d1], 1, generator=g))
            q = torch.stack((q1, q2[d1]))
        p = torch.stack((pi1, pi2[d1], pi3[d1, d2]))
        n_acc, y = accept_rejection(p, torch.tensor([d1, d2]), q, g)
        out = [d1, d2][:n_acc] + [y]
        if len(out) == 1:
            out.append(int(torch.multinomial(pi2[out[0]], 1, generator=g)))
        counts[out[0], out[1]] += 1
        raw[d1, d2] += 1
    joint = pi1[:, None] * pi2
    pval = chi2_pvalue(counts, joint)
    assert pval > 1e-4, f"seed {seed}: {method} drafts: emitted pairs do not follow the target (p = {pval:.2e})"
    assert chi2_pvalue(raw, joint) < 1e-6, "the test must be able to tell the drafter's distribution apart"


SMALL = dict(sharp=False, vocab_size=16, n_layers=2, no_rope_layers=[1, 0], kv_source_layers=[0, 1],
             index_source_layers=[0, 1], mtp={"n_layers": 1, "target_layer_ids": [0, 1]},
             moe={"num_experts": 2, "num_experts_per_tok": 1})


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_speculative_sampling_preserves_target_distribution(method: str, seed: int) -> None:
    """End to end on a 16-token vocabulary: from one prefilled state, many seeded speculative steps (DSpark drafts
    N = 2, temperature 0.1) each emit a first token; its counts must follow the target's softmax(logits / T)."""
    model = tiny_model(seed, **SMALL)
    T, trials = 0.1, 300
    prompt = random_tokens(8, 16, seed).tolist()        # shorter than the draft window: the ring never wraps
    kv, drafter = ResidentKV(model.cfg, None, dtype=model.dtype), DSparkDrafter(model)
    dec = SpeculativeDecoder(model, kv, drafter, SpeculativeConfig("dspark", 2, method))
    params = SamplingParams(temperature=T)
    st0 = dec.start(0, prompt, params, torch.Generator().manual_seed(seed))
    counts = torch.zeros(16)
    for i in range(trials):
        st = SpecState(0, st0.anchor, st0.pos, params, torch.Generator().manual_seed(seed * 7919 + i))
        counts[dec.step(st, 3)[0]] += 1
        kv.truncate(0, st0.pos)
        drafter.truncate(0, st0.pos)
    ref_kv = ResidentKV(model.cfg, None, dtype=model.dtype)
    logits = model(torch.tensor(prompt + [st0.anchor]), [Segment(0, 0, len(prompt) + 1)], ref_kv)[-1]
    target = torch.softmax(logits / T, dim=-1)
    pval = chi2_pvalue(counts, target)
    print(f"[seed {seed}] {method}: accepted {dec.stats.accepted}/{dec.stats.proposed} drafts, chi2 p = {pval:.3f}")
    assert dec.stats.proposed == 2 * trials and dec.stats.accepted < dec.stats.proposed
    assert pval > 1e-4, f"seed {seed}: {method}: first tokens do not follow the target (p = {pval:.2e})"


def test_rejection_with_no_residual_mass_emits_from_the_target() -> None:
    """Where rounding leaves max(0, p - q) without mass after a rejection, the emitted token comes from p itself.
    Stood in for by p = q / 2 (every residual is 0): the first seed whose draw rejects emits p's token."""
    V, d = 6, 4
    q = torch.nn.functional.one_hot(torch.tensor([d]), V).double()
    p = torch.cat((q / 2, torch.full((1, V), 1 / V, dtype=torch.float64)))
    for s in range(64):
        n_acc, y = accept_rejection(p, torch.tensor([d]), None, torch.Generator().manual_seed(s))
        if n_acc == 0:
            assert y == d
            return
    raise AssertionError("no seed rejected a draft accepted with probability 1/2")


def test_rows_per_request_counts_the_drafts() -> None:
    assert SpeculativeConfig.rows_per_request(None) == 1
    assert SpeculativeConfig.rows_per_request(SpeculativeConfig("dspark", 3, "greedy")) == 4


@pytest.mark.parametrize("top_k, top_p", [(-1, 1.0), (0, 1.0), (-1, 0.5), (3, 1.0), (3, 0.5), (7, 1.0)])
def test_processed_probs_are_the_filtered_softmax(top_k: int, top_p: float, seed: int) -> None:
    """The drafter's and the verifier's pi: softmax(logits / T) restricted to the top_k (0, -1: off) most likely
    tokens and then to the fewest top tokens whose mass reaches top_p, renormalised; each setting alone too."""
    V, T = 7, 0.8
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    got = processed_probs(logits, [SamplingParams(temperature=T, top_k=top_k, top_p=top_p)] * 3)
    for row, probs in zip(logits, got, strict=True):
        order = torch.argsort(row, descending=True)
        keep = order[:top_k] if 0 < top_k < V else order
        pk = torch.softmax(row[keep] / T, dim=0)
        n = int((torch.cumsum(pk, 0) - pk < top_p).sum())          # the fewest whose mass reaches top_p
        want = torch.zeros(V, dtype=torch.float64)
        want[keep[:n]] = pk[:n] / pk[:n].sum()
        torch.testing.assert_close(probs, want, rtol=1e-12, atol=1e-12)
        assert int((probs > 0).sum()) == n


def test_speculative_generate_stops_at_a_stop_token_inside_an_accepted_block(greedy_case) -> None:
    """A stop token the oracle's drafts bring in ends the output with its first occurrence, as plain decoding
    would (the drafts after it in the block are dropped)."""
    model, prompt, ref = greedy_case
    k = ref.index(ref[6])         # 6: the second token of the second block of 4 drafts (or an earlier one)
    out, _ = speculative_generate(model, ResidentKV(model.cfg, None, dtype=model.dtype), OracleProposer(prompt + ref),
                                  prompt, NEW, SpeculativeConfig(), stop_ids=(ref[k],))
    assert out == ref[:k + 1]
