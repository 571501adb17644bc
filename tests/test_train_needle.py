"""The passkey trainer: its autograd forward is the inference model's math, its losses train what they should, it
is reproducible from a seed, and the shipped checkpoint retrieves passkeys through HiSparse."""

from __future__ import annotations

import json
import shutil
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import full_forward, random_tokens, selection_sets, tiny_model
from hisparse.kv.settings import KVSettings
from hisparse.core.config import ModelConfig
from hisparse.model.tokenizer import load_tokenizer
from hisparse.model.weights import load_model
from hisparse.train.evaluate import passkey_accuracy
import hisparse.train.forward as fw
from hisparse.train.forward import train_forward
from hisparse.train.recipe import FIRST_STAGES, LONG_STAGES, TOKENIZER_WORDS, Gate, Recipe, Stage
from hisparse.model.weights import save_model
from hisparse.train.drafter import drafter_params, with_drafter
import hisparse.train.trainer as trainer
from hisparse.train.trainer import (DISPATCH_VARS, PARTIAL_FILE, init_model, lerope_at, numeric_env, train,
                                    trained_steps)

pytestmark = pytest.mark.usefixtures("single_thread")
SHIPPED = Path(__file__).resolve().parents[1] / "checkpoints" / "needle-ml4"


@pytest.mark.parametrize("sparse", [False, True])
def test_train_forward_is_the_inference_math(seed: int, sparse: bool):
    """Every layer kind of the tiny preset (dense, MoE, RoPE, NoPE, KV consumer, indexer sharer): the training
    forward's logits equal ML4.forward's (fp64), and in the sparse mode its masks are exactly the selections.
    Dense mode equals inference only while every query sees at most top-k keys."""
    model = tiny_model(seed)
    T = 40 if sparse else model.cfg.index_topk
    tokens = random_tokens(T, model.cfg.vocab_size, seed)
    ref, _ = full_forward(model, tokens)
    st_logits, _ = train_forward(model, tokens[None], model.cfg.index_topk if sparse else None)
    assert torch.allclose(st_logits, ref, rtol=1e-9, atol=1e-9), (st_logits - ref).abs().max()


def test_sparse_masks_equal_inference_selections(seed: int, monkeypatch: pytest.MonkeyPatch):
    """Each owner's training mask [T, T] holds exactly its inference Sel(t) (ties to the earlier position)."""
    model = tiny_model(seed)
    tokens = random_tokens(48, model.cfg.vocab_size, seed)
    _, trace = full_forward(model, tokens)
    masks = {}
    real = fw.indexer_forward

    def recording(indexer, x, target, st):
        masks[len(masks)] = real(indexer, x, target, st)[0]
        return masks[len(masks) - 1][None]
    monkeypatch.setattr(fw, "indexer_forward", recording)
    train_forward(model, tokens[None], model.cfg.index_topk)
    owners = model.cfg.index_owner_layers
    assert len(masks) == len(owners)
    for i, layer in enumerate(owners):
        want = selection_sets(trace.selections[layer][0])
        got = [sorted(torch.nonzero(row).flatten().tolist()) for row in masks[i]]
        assert got == want, f"layer {layer}"


def test_indexer_loss_trains_only_the_indexers(seed: int):
    model = tiny_model(seed, dtype=torch.float32, sharp=False).train()
    tokens = random_tokens(24, model.cfg.vocab_size, seed)[None]
    logits, kl = train_forward(model, tokens, model.cfg.index_topk)
    kl.backward(retain_graph=True)
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert any(g is not None and g.abs().sum() > 0 for n, g in grads.items() if ".indexer." in n)
    assert all(g is None or g.abs().sum() == 0 for n, g in grads.items() if ".indexer." not in n)
    model.zero_grad(set_to_none=True)
    F.cross_entropy(logits[:-1], tokens[0, 1:]).backward()   # top-k is discrete: the LM loss never reaches them
    assert all(p.grad is None or p.grad.abs().sum() == 0 for n, p in model.named_parameters() if ".indexer." in n)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters()
               if ".wq." in n)


def test_training_is_reproducible_and_writes_a_servable_checkpoint(tmp_path: Path):
    recipe = Recipe(seed=3, stages=(Stage("dense", 3, 16, 48, False, 1e-3), Stage("sparse", 2, 64, 160, True, 1e-3),
                                    Stage("topk", 2, 96, 200, True, 1e-3, topk_only=True, threads=2)),
                    tokens_per_batch=512, warmup=2, kl_recent_keys=8)
    a = train(tmp_path / "a", recipe)
    assert torch.get_num_threads() == 1   # the 2-thread stage's count is not left behind
    b = train(tmp_path / "b", recipe)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    # resuming after the first stage's checkpoint gives the uninterrupted run's weights and log
    (tmp_path / "c").mkdir()
    shutil.copytree(tmp_path / "a" / "after-dense", tmp_path / "c" / "after-dense")
    shutil.copy(tmp_path / "a" / "train_log.jsonl", tmp_path / "c")
    c = train(tmp_path / "c", recipe, resume=True)
    for (n, p), q in zip(a.named_parameters(), c.parameters()):
        assert torch.equal(p, q), n
    assert log_records(tmp_path / "a") == log_records(tmp_path / "c")
    for name, p in a.named_parameters():
        if name.endswith("ssmax_scaling"):
            assert (p[:, 0] >= 0).all() and (p[:, 1] >= 0.1).all()
    saved = load_model(tmp_path / "a")
    assert saved.cfg == ModelConfig.from_params(Recipe().params())
    for ckpt in (tmp_path / "a", tmp_path / "a" / "after-sparse"):     # the run's model and a stage's
        assert load_tokenizer(ckpt).instruct_tokenizer.tokenizer.n_words == TOKENIZER_WORDS
    lines = (tmp_path / "a" / "train_log.jsonl").read_text().splitlines()
    assert len(lines) == 1 + 3 + 2 + 2


def log_records(out: Path) -> list[dict]:
    """The per-step records of a run's train_log.jsonl, without their wall-clock seconds."""
    return [{k: v for k, v in json.loads(ln).items() if k != "s"}
            for ln in (out / "train_log.jsonl").read_text().splitlines()[1:]]


def test_a_gated_stage_retries_until_its_gate_holds_and_resumes_between_rounds(tmp_path: Path):
    never = Gate(1.0, 2, retry_steps=2, retries=2)   # a model trained for a few steps never gets 7 digits exact
    recipe = Recipe(seed=5, stages=(Stage("dense", 3, 16, 48, False, 1e-3, gate=never),
                                    Stage("sparse", 2, 64, 160, True, 1e-3, gate=Gate(0.0, 2, 2))),
                    tokens_per_batch=512, warmup=2)
    a = train(tmp_path / "a", recipe)
    assert [(r["stage"], r.get("round", 0)) for r in log_records(tmp_path / "a")] == (
        [("dense", 0)] * 3 + [("dense", 1)] * 2 + [("dense", 2)] * 2 + [("sparse", 0)] * 2)
    # a run that stopped after the first retry, resumed under the full recipe, runs the second retry and the rest
    short = replace(recipe, stages=(replace(recipe.stages[0], gate=replace(never, retries=1)),))
    train(tmp_path / "c", short)
    c = train(tmp_path / "c", recipe, resume=True)
    for (n, p), q in zip(a.named_parameters(), c.parameters()):
        assert torch.equal(p, q), n
    assert log_records(tmp_path / "a") == log_records(tmp_path / "c")


class Interrupt(Exception):
    pass


def test_a_run_interrupted_mid_round_resumes_from_its_partial_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A long stage saves its round's progress (weights, AdamW state, step) as it goes; a run killed mid-round
    and resumed ends with the uninterrupted run's weights and log, in the first round and in a retry."""
    recipe = Recipe(seed=7, stages=(Stage("dense", 2, 16, 48, False, 1e-3),
                                    Stage("topk", 3, 96, 200, True, 1e-3, topk_only=True, threads=2,
                                          gate=Gate(1.0, 2, retry_steps=3, retries=1))),
                    tokens_per_batch=512, warmup=2, kl_recent_keys=8)
    monkeypatch.setattr(trainer, "PARTIAL_EVERY_S", 0.0)
    a = train(tmp_path / "a", recipe)
    assert not (tmp_path / "a" / PARTIAL_FILE).exists()
    assert [r.get("round", 0) for r in log_records(tmp_path / "a") if r["stage"] == "topk"] == [0, 0, 0, 1, 1, 1]
    real = trainer.topk_forward
    for stop_at in (2, 5):      # topk steps before the kill: mid first round, mid retry
        calls = []

        def dies(*args, **kw):
            calls.append(1)
            if len(calls) > stop_at:
                raise Interrupt
            return real(*args, **kw)

        out = tmp_path / f"killed-{stop_at}"
        monkeypatch.setattr(trainer, "topk_forward", dies)
        with pytest.raises(Interrupt):
            train(out, recipe)
        assert (out / PARTIAL_FILE).exists()
        resumed = []

        def counts(*args, **kw):
            resumed.append(1)
            return real(*args, **kw)

        monkeypatch.setattr(trainer, "topk_forward", counts)
        b = train(out, recipe, resume=True)
        assert len(resumed) == 6 - stop_at      # only the steps after the save run again
        for (n, p), q in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(p, q), (stop_at, n)
        assert log_records(tmp_path / "a") == log_records(out)
        assert not (out / PARTIAL_FILE).exists()


def test_a_shipped_checkpoint_resumes_into_a_new_stage(tmp_path: Path):
    """A checkpoint kept without its stage folders (the model, its log, a drafter distilled from it) trains the
    stages a longer recipe adds as the full run would, and drops the drafter that no longer matches its weights."""
    short = Recipe(seed=2, stages=(Stage("dense", 2, 16, 48, False, 1e-3), Stage("sparse", 2, 64, 160, True, 1e-3)),
                   tokens_per_batch=512, warmup=2)
    longer = replace(short, stages=short.stages + (Stage("more", 2, 96, 200, True, 1e-3),))
    full = train(tmp_path / "full", longer)
    shipped = tmp_path / "shipped"
    model = train(shipped, short)
    for stage in short.stages:
        shutil.rmtree(shipped / f"after-{stage.name}")
    save_model(with_drafter(model, drafter_params(model.cfg), seed=0), shipped)
    assert load_model(shipped).mtp_dspark is not None
    resumed = train(shipped, longer, resume=True)
    assert resumed.mtp_dspark is None and load_model(shipped).mtp_dspark is None
    for (n, p), q in zip(full.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), n
    assert log_records(tmp_path / "full") == log_records(shipped)


def test_a_stage_sets_lerope_alpha_as_it_starts_and_training_keeps_it(tmp_path: Path):
    """A stage's `lerope_alpha` (a LongRoPE-style rescale of the slow RoPE pairs) is set as the stage starts and
    kept: the optimizer never moves alpha, the stage before it does not see it, the stages after it and the saved
    checkpoint carry it, and a run resumed after it ends with the uninterrupted run's weights."""
    alpha = (0.0,) * 6 + (-3.0, -6.0)
    recipe = Recipe(seed=4, stages=(Stage("dense", 2, 16, 48, False, 1e-3),
                                    Stage("rescaled", 2, 64, 160, True, 1e-3, lerope_alpha=alpha),
                                    Stage("after", 2, 64, 160, True, 1e-3)),
                    tokens_per_batch=512, warmup=2)
    a = train(tmp_path / "a", recipe)
    assert a.lerope.alpha.tolist() == list(alpha)
    assert load_model(tmp_path / "a" / "after-dense").lerope.alpha.abs().max() == 0
    assert load_model(tmp_path / "a" / "after-rescaled").lerope.alpha.tolist() == list(alpha)
    assert load_model(tmp_path / "a").lerope.alpha.tolist() == list(alpha)
    (tmp_path / "c").mkdir()
    for stage in ("dense", "rescaled"):
        shutil.copytree(tmp_path / "a" / f"after-{stage}", tmp_path / "c" / f"after-{stage}")
    shutil.copy(tmp_path / "a" / "train_log.jsonl", tmp_path / "c")
    c = train(tmp_path / "c", recipe, resume=True)
    for (n, p), q in zip(a.named_parameters(), c.parameters()):
        assert torch.equal(p, q), n
    assert log_records(tmp_path / "a") == log_records(tmp_path / "c")


def test_a_ramped_stage_moves_lerope_alpha_step_by_step_and_resumes_mid_ramp(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch):
    """`lerope_ramp` moves alpha linearly from the earlier stages' setting to the stage's over its first steps;
    every step trains with its own alpha, the retry keeps the target, and a run killed mid-ramp resumes to the
    uninterrupted run's weights and log."""
    first, target = (0.0,) * 6 + (-1.0, -2.0), (0.0,) * 4 + (-0.5, -1.0, -2.5, -5.0)
    ramped = Stage("ramped", 4, 96, 200, True, 1e-3, topk_only=True, gate=Gate(1.1, 2, retry_steps=2, retries=1),
                   lerope_alpha=target, lerope_ramp=3)
    recipe = Recipe(seed=5, stages=(Stage("rescaled", 2, 16, 48, False, 1e-3, lerope_alpha=first), ramped),
                    tokens_per_batch=512, warmup=2, kl_recent_keys=8)
    want = [[f + (t - f) * k / 3 for f, t in zip(first, target)] for k in (1, 2, 3, 3, 3, 3)]
    for step in range(4):
        assert torch.allclose(lerope_at(recipe, ramped, step), torch.tensor(want[step]))
    real, seen = trainer.topk_forward, []

    def records_alpha(model, *args, **kw):
        seen.append(model.lerope.alpha.tolist())
        return real(model, *args, **kw)

    monkeypatch.setattr(trainer, "topk_forward", records_alpha)
    a = train(tmp_path / "a", recipe)
    assert len(seen) == 6
    for got, exp in zip(seen, want):
        assert got == pytest.approx(exp, abs=1e-6)
    assert a.lerope.alpha.tolist() == list(target)
    monkeypatch.setattr(trainer, "PARTIAL_EVERY_S", 0.0)

    def dies(*args, **kw):
        if len(seen) >= 8:          # six steps above, then two of the killed run: mid-ramp
            raise Interrupt
        return records_alpha(*args, **kw)

    monkeypatch.setattr(trainer, "topk_forward", dies)
    with pytest.raises(Interrupt):
        train(tmp_path / "b", recipe)
    monkeypatch.setattr(trainer, "topk_forward", records_alpha)
    b = train(tmp_path / "b", recipe, resume=True)
    assert seen[8:] == seen[2:6]       # the resumed steps train with the alphas they had
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    assert log_records(tmp_path / "a") == log_records(tmp_path / "b")


def test_resume_warns_when_the_log_came_from_another_numeric_environment(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch):
    for var in DISPATCH_VARS:
        monkeypatch.delenv(var, raising=False)
    recipe = Recipe(stages=(Stage("dense", 1, 16, 48, False, 1e-3),))
    env = numeric_env()
    (tmp_path / "train_log.jsonl").write_text(json.dumps({"env": env, "params": recipe.params()}) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert trained_steps(tmp_path, recipe, env) == {}
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")   # another MKL kernel: other bits from step 79 on
    other = numeric_env()
    assert other == {**env, "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    with pytest.warns(UserWarning, match="another numeric environment"):
        trained_steps(tmp_path, recipe, other)


def test_resume_refuses_a_log_of_other_rope_frequencies(tmp_path: Path):
    """A run trained with one --rope-theta / --yarn-factor is not continued with another: the error names the
    params that differ."""
    recipe = Recipe(stages=(Stage("dense", 1, 16, 48, False, 1e-3),))
    (tmp_path / "train_log.jsonl").write_text(json.dumps({"env": numeric_env(), "params": recipe.params()}) + "\n")
    assert trained_steps(tmp_path, recipe, numeric_env()) == {}
    with pytest.raises(ValueError, match=r"\['rope_theta', 'yarn'\]"):
        trained_steps(tmp_path, replace(recipe, rope_theta=1e4, yarn_factor=16), numeric_env())
    with pytest.raises(ValueError, match=r"\['yarn'\]"):
        trained_steps(tmp_path, replace(recipe, yarn_factor=16), numeric_env())


def test_the_shipped_run_meets_every_gate_of_the_recipe_in_its_first_round():
    """The gates were added after the shipped run: it would have run exactly as it did (no retries). Its stages
    are the recipe's first ones (a stage the recipe adds trains from it with `--resume`)."""
    steps: dict[str, list[float]] = {}
    for rec in log_records(SHIPPED):
        steps.setdefault(rec["stage"], []).append(rec["answer_exact"])
    recipe = [stage.name for stage in Recipe().stages]
    assert list(steps) == recipe[:len(steps)] and len(steps) >= 7
    assert list(steps)[:len(FIRST_STAGES)] == [stage.name for stage in FIRST_STAGES]
    for name, long in LONG_STAGES.items():      # every long schedule trains on from the shipped stages
        assert long and not {stage.name for stage in long} & set(steps), name
    for stage in Recipe().stages[:len(steps)]:
        assert len(steps[stage.name]) == stage.steps, stage.name
        assert stage.gate is None or stage.gate.met(steps[stage.name]), stage.name


def test_init_model_ssmax_gain_is_one():
    model = init_model(ModelConfig.from_params(Recipe().params()), 0)
    for name, p in model.named_parameters():
        if name.endswith("ssmax_scaling"):
            assert torch.equal(p, torch.tensor([[0.0, 1.0]]).expand_as(p))


def test_shipped_checkpoint_retrieves_through_hisparse():
    """The committed model finds fresh passkeys far beyond a hot buffer of 64 slots, with HiSparse on and off
    giving identical completions."""
    model = load_model(SHIPPED)
    tok = load_tokenizer(SHIPPED).instruct_tokenizer.tokenizer
    hisparse = KVSettings(host_pool_gib=0.05, hot_buffer_tokens=64, resident_window=16)
    on = passkey_accuracy(model, lambda: hisparse.build(model.cfg), tok, 1500, 4, seed=11)
    off = passkey_accuracy(model, lambda: KVSettings(offload="none").build(model.cfg), tok, 1500, 4, seed=11)
    assert [r.completion for r in on] == [r.completion for r in off]
    assert sum(r.found for r in on) >= 3, [(r.value, r.completion) for r in on]
