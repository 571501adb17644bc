"""`hisparse train-drafter`: the training forward is DSparkDrafter's inference forward, the labels and their mask
follow the target's greedy continuation, a resumed run equals an uninterrupted one, and the shipped needle
checkpoint's drafter is accepted by greedy verification while decoding stays exactly plain greedy decoding."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_model
from test_dspark_model import Recorder
from hisparse.kv.settings import KVSettings
from hisparse.engine.speculative import OracleProposer, SpeculativeConfig, SpeculativeDecoder, speculative_generate
from hisparse.model.dspark import DSparkDrafter
from hisparse.model.tokenizer import load_tokenizer
from hisparse.model.weights import load_model
from hisparse.train.drafter import (LOG, DrafterRecipe, Sequence, drafter_forward, generate, targets_and_mask,
                                    train_drafter)
from hisparse.train.passkey import INTRO, SyntheticHaystack

pytestmark = pytest.mark.usefixtures("single_thread")
SHIPPED = Path(__file__).resolve().parents[1] / "checkpoints" / "needle-ml4"


@pytest.mark.parametrize("seed", [0, 1])
def test_training_forward_is_the_inference_forward(seed: int):
    """For anchors before, at and past the sliding window (16 here), drafter_forward's logits with the Markov head
    fed the drafter's own drafts equal what DSparkDrafter.propose showed its sampler, and their argmax are the
    drafts (the context rows go through the bf16 window cache at inference, a rounding at training)."""
    model = tiny_model(seed)
    mk = model.mtp_dspark.markov
    with torch.no_grad():   # a Markov head strong enough to move the drafts
        for p, scale in ((mk.embed.weight, 50.0), (mk.gate.weight, 50.0), (mk.proj.weight, 200.0)):
            p.mul_(scale)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.cfg.vocab_size, (40,), generator=g).tolist()
    seq = generate(model, model.cfg.mtp.target_layer_ids, [(prompt, 6)], eos=-1)[0]
    assert seq.tokens.numel() == 46 and torch.equal(seq.labels[40:45], seq.tokens[41:])
    n = model.cfg.mtp.block_size
    for P in (0, 5, 16, 23, 39, 44):
        drafter, rec = DSparkDrafter(model), Recorder()
        if P:
            drafter.observe(0, {l: t[:P] for l, t in seq.taps.items()}, torch.arange(P))
        drafts, _ = drafter.propose(0, int(seq.tokens[P]), P, n, rec)
        forced = Sequence(seq.tokens.clone(), seq.labels.clone(), seq.taps)
        forced.labels[P:P + n - 1] = drafts[:n - 1]
        with torch.no_grad():
            z = drafter_forward(model, forced, torch.tensor([P]), n)[0]                   # [n, V]
        torch.testing.assert_close(z, torch.cat(rec.logits), rtol=1e-5, atol=1e-5)
        assert torch.equal(z.argmax(-1), drafts), P


def test_targets_follow_the_greedy_continuation():
    """Slot i counts while the tokens after the anchor are the target's own greedy tokens and inside the sequence."""
    tokens = torch.tensor([5, 1, 2, 9, 4, 6])
    labels = torch.tensor([1, 2, 3, 4, 6, 8])   # greedy next tokens: position 2 predicts 3, the text has 9
    seq = Sequence(tokens, labels, {})
    y, mask = targets_and_mask(seq, torch.tensor([0, 2, 3, 5]), 3)
    assert y.tolist() == [[1, 2, 3], [3, 4, 6], [4, 6, 8], [8, 8, 8]]
    assert mask.tolist() == [[True, True, True], [True, False, False], [True, True, True], [True, False, False]]


def tiny_recipe(**kw) -> DrafterRecipe:
    mtp = {"method": "dspark", "n_layers": 1, "block_size": 3, "sliding_window": 24, "kv_cache_dtype": "bfloat16",
           "target_layer_ids": [1, 3], "markov_rank": 8, "hidden_dim": 32, "markov_head_type": "gated_rnn",
           "sample_from_anchor": True}
    return DrafterRecipe(sequences=4, min_chars=24, max_chars=64, continuation=8, gen_batch=3, steps=6,
                         seqs_per_step=2, anchors_per_seq=8, warmup=2, save_every=2, drafter=mtp, **kw)


def log_records(out: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(ln).items() if k != "s"} for ln in (out / LOG).read_text().splitlines()[1:]]


def test_resume_equals_an_uninterrupted_run(tmp_path: Path):
    """A run stopped after 3 of 6 steps and resumed writes the same drafter tensors and log as one run; the target's
    tensors are the shipped ones, bit for bit; the written checkpoint serves the drafter."""
    recipe = tiny_recipe(seed=1)
    train_drafter(SHIPPED, tmp_path / "a", recipe)
    train_drafter(SHIPPED, tmp_path / "b", recipe, until=3)
    assert len(log_records(tmp_path / "b")) == 3 and not (tmp_path / "b" / "params.json").exists()
    train_drafter(SHIPPED, tmp_path / "b", recipe, resume=True)
    a, b = (load_file(str(tmp_path / d / "consolidated.safetensors")) for d in "ab")
    assert a.keys() == b.keys() and any(k.startswith("mtp_dspark.") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert log_records(tmp_path / "a") == log_records(tmp_path / "b") and len(log_records(tmp_path / "a")) == 6
    shipped = load_file(str(SHIPPED / "consolidated.safetensors"))
    for k, t in a.items():
        if not k.startswith("mtp_dspark."):
            assert torch.equal(t, shipped[k]), k
    other = train_drafter(SHIPPED, tmp_path / "c", replace(recipe, seed=2))
    assert not torch.equal(other.mtp_dspark.context_proj.weight.bfloat16(), a["mtp_dspark.context_proj.weight"])
    model = load_model(tmp_path / "a")
    assert model.cfg.mtp.sliding_window == 24 and not (tmp_path / "a" / "drafter-train").exists()
    DSparkDrafter(model)


def haystack_prompt(tok, seed: int, chars: int) -> list[int]:
    text = "".join(SyntheticHaystack(seed).units(chars // 20 + 2))[:chars]
    return tok.encode(INTRO + text, bos=True, eos=False)


def test_shipped_drafter_is_accepted_and_lossless():
    """The needle checkpoint's trained drafter, over HiSparse KV: greedy speculative decoding of haystack text is
    plain greedy decoding token for token, and more than 2 tokens come out of each target forward (its random
    weights gave 1.0)."""
    model = load_model(SHIPPED)
    assert model.cfg.mtp is not None
    tok = load_tokenizer(SHIPPED).instruct_tokenizer.tokenizer
    kv = KVSettings(host_pool_gib=0.05, hot_buffer_tokens=64, resident_window=16)
    prompt = haystack_prompt(tok, 12345, 700)
    dec = SpeculativeDecoder(model, kv.build(model.cfg), OracleProposer([]), SpeculativeConfig())
    st = dec.start(0, prompt)
    plain = [st.anchor]
    while len(plain) < 64:
        plain += dec.step(st, 1)   # max_new 1: no drafts, one plain forward per token
    spec, stats = speculative_generate(model, kv.build(model.cfg), DSparkDrafter(model), prompt, 64,
                                       SpeculativeConfig(num_speculative_tokens=3))
    assert spec == plain
    assert stats.acceptance_length > 2.0, stats
