"""Frozen-haystack training: a step's live rows are the benchmark's prompt around the cached haystack, and a stage
that trains on them logs, saves and resumes mid-round like every other stage."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hisparse.model.tokenizer import load_tokenizer
from hisparse.model.weights import load_model, save_model
import hisparse.train.trainer as trainer
from hisparse.train.frozen_haystack import build_haystack, live_needle
from hisparse.train.passkey import (COMPLETION_CUE, INTRO, QUESTION, SyntheticHaystack, answer, haystack_units,
                                    needle_text)
from hisparse.train.recipe import Gate, Recipe, Stage
from hisparse.train.trainer import PARTIAL_FILE, train
from test_train_needle import Interrupt, log_records

pytestmark = pytest.mark.usefixtures("single_thread")
NEEDLE = Path(__file__).resolve().parents[1] / "checkpoints" / "needle-ml4"


@pytest.mark.parametrize("depth", [0.0, 0.4, 1.0])
def test_live_rows_and_the_haystack_are_the_benchmark_prompt(depth: float):
    """Haystack rows and live rows in merged order decode to the intro, the filler with the needle at a unit
    boundary (its own paragraph after a paragraph end), the question, the cue, the answer and EOS; the needle's
    rows take the positions of the rows after it, the question's the whole prompt's; only the answer and EOS are
    answer targets, and the needle's last row has no live target."""
    tok = load_tokenizer(NEEDLE).instruct_tokenizer.tokenizer
    hay = build_haystack(load_model(NEEDLE), tok.encode, seed=11, chars=700, recent=8)
    live = live_needle(hay, tok.encode, tok.eos_id, "4011790", depth)
    N, n = hay.cache.tokens.numel(), live.tokens.numel()
    merged = torch.empty(N + n, dtype=torch.long)
    at = live.after + torch.arange(n)
    keep = torch.ones(N + n, dtype=torch.bool)
    keep[at] = False
    merged[at], merged[keep] = live.tokens, hay.cache.tokens
    text = tok.decode(merged.tolist() + [live.targets[-1].item()])
    units = haystack_units(SyntheticHaystack(11), 700)
    j = round(depth * len(units))
    own = j == 0 or units[j - 1].endswith("\n\n")
    filler = "".join(units[:j]) + needle_text("4011790", own) + "".join(units[j:])
    assert text == INTRO + filler + QUESTION + COMPLETION_CUE + answer("4011790") and live.targets[-1] == tok.eos_id
    L = len(needle_text("4011790", own))
    assert live.positions[:L].tolist() == list(range(hay.starts[j], hay.starts[j] + L))
    assert live.positions[L:].tolist() == list(range(N + L, N + n))
    assert torch.equal(live.targets[:-1], live.tokens[1:]) and not live.valid[L - 1] and live.valid.sum() == n - 1
    assert live.ans.sum() == len(answer("4011790")) + 1 and live.ans[-live.ans.sum():].all()


@pytest.mark.parametrize("replay", [False, True], ids=["alone", "replay"])
def test_a_frozen_stage_trains_and_resumes_mid_round(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, replay: bool):
    """A frozen-haystack stage logs its steps at the merged prompt's length, caches a new haystack for a retry
    round, and a run killed mid-round resumes to the uninterrupted run's weights and log. With a replay stage
    each step also trains one of its batches (logged beside the needle's answer), and the replay's gradients
    reach the weights."""
    frozen_stage = Stage("frozen", 2, 400, 400, True, 1e-3, frozen=True, answer_kl=1.0,
                         gate=Gate(1.1, 2, retry_steps=2, retries=1),
                         replay=Stage("short", 1, 96, 160, True, 0.0, topk_only=True) if replay else None)
    recipe = Recipe(seed=3, stages=(Stage("dense", 2, 16, 48, False, 1e-3), frozen_stage),
                    tokens_per_batch=512, warmup=2, kl_recent_keys=8)
    monkeypatch.setattr(trainer, "PARTIAL_EVERY_S", 0.0)
    seeds = []
    real_build = trainer.build_haystack
    monkeypatch.setattr(trainer, "build_haystack", lambda *a: seeds.append(a[2]) or real_build(*a))
    a = train(tmp_path / "a", recipe)
    frozen = [r for r in log_records(tmp_path / "a") if r["stage"] == "frozen"]
    assert [r.get("round", 0) for r in frozen] == [0, 0, 1, 1] and len(set(seeds)) == 2
    prompt = {1 + len(INTRO) + 400 + len(needle_text("1234567", own)) + len(QUESTION + COMPLETION_CUE) +
              len(answer("1234567")) + 1 for own in (False, True)}    # BOS, the prompt, the answer and EOS
    assert all(r["B"] == 1 and r["T"] in prompt for r in frozen), frozen
    if replay:
        assert all(96 + 100 < r["replay_T"] < 160 + 200 and 0 <= r["replay_answer_ce"] for r in frozen), frozen
        one = replace(frozen_stage, steps=1, gate=None)     # one step: the same needle with and without
        both = train(tmp_path / "one", replace(recipe, stages=(recipe.stages[0], one)))
        alone = train(tmp_path / "alone", replace(recipe, stages=(recipe.stages[0], replace(one, replay=None))))
        assert not all(torch.equal(p, q) for p, q in zip(both.parameters(), alone.parameters()))
        assert [r["answer_ce"] for r in log_records(tmp_path / "one")] == [
            r["answer_ce"] for r in log_records(tmp_path / "alone")]
    else:
        assert not any("replay_T" in r for r in frozen)
    real = trainer.prefix_forward
    calls = []

    def dies(*args, **kw):
        calls.append(1)
        if len(calls) > 3:
            raise Interrupt
        return real(*args, **kw)

    monkeypatch.setattr(trainer, "prefix_forward", dies)
    with pytest.raises(Interrupt):
        train(tmp_path / "b", recipe)
    assert (tmp_path / "b" / PARTIAL_FILE).exists()
    monkeypatch.setattr(trainer, "prefix_forward", real)
    b = train(tmp_path / "b", recipe, resume=True)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    assert log_records(tmp_path / "a") == log_records(tmp_path / "b")


def test_frozen_eval_scores_answers_and_names_the_first_wrong_token(tmp_path: Path):
    """`benchmarks.needle.frozen_eval`: the shipped model answers needles in a 4k haystack exactly. With its EOS
    output row zeroed it still copies every value but never ends (the first miss is the EOS); with its output head
    negated it misses from the first token. Each run scores the same needles."""
    from benchmarks.needle.frozen_eval import evaluate

    def broken(name: str, edit) -> Path:
        model = load_model(NEEDLE)
        with torch.no_grad():
            edit(model.output.weight)
        save_model(model, tmp_path / name)
        (tmp_path / name / "tekken.json").write_bytes((NEEDLE / "tekken.json").read_bytes())
        return tmp_path / name

    good = evaluate(NEEDLE, 4096, 3, 12345, 1)
    assert good["exact"] == good["copied"] == 3
    assert all(r["first_wrong"] is None and r["answer_ce"] < 0.2 for r in good["rows"])
    eos = load_tokenizer(NEEDLE).instruct_tokenizer.tokenizer.eos_id
    endless = evaluate(broken("endless", lambda w: w[eos].zero_()), 4096, 3, 12345, 1)
    assert endless["exact"] == 0 and endless["copied"] == 3
    for r in endless["rows"]:
        assert r["first_wrong"]["want"] == "</s>" and r["first_wrong"]["index"] == r["first_wrong"]["of"] - 1
    bad = evaluate(broken("negated", lambda w: w.neg_()), 4096, 3, 12345, 1)
    assert bad["exact"] == bad["copied"] == 0
    for r in bad["rows"]:
        assert r["first_wrong"]["index"] == 0 and r["first_wrong"]["want"] != r["first_wrong"]["got"]
        assert r["answer_ce"] > 1.0
    values = [r["value"] for r in good["rows"]]
    assert [r["value"] for r in endless["rows"]] == [r["value"] for r in bad["rows"]] == values
