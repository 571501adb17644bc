"""`hisparse train-needle`: train the retrieval model from a seed on the passkey task, evaluate it through the
inference path, and write a Mistral-native checkpoint (params.json, consolidated.safetensors, byte-level tekken).

Deterministic for a seed: each stage runs on the recipe's thread count (Stage.threads), and two runs in one
environment (`numeric_env`, recorded in the log's header) are bit-identical. Across environments a run is not:
changing only MKL's or ATen's kernel dispatch moves a run off its trajectory (at steps 79 or 88 for seed 0), and a
run in another environment can train a weaker model; the stages' gates (recipe.Gate) catch a sparse-copy stage
that retrieves late by retrying it: see docs/needle-model.md. Progress is a tqdm bar; every step appends a line
to `train_log.jsonl` (loss, answer loss, indexer KL, answer exact match under teacher forcing, length, seconds).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import TextIO

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..kv.settings import KVSettings, KVSettingsError
from ..core.config import ModelConfig
from ..core.native import cpu_id
from ..model.ml4 import ML4
from ..model.tokenizer import load_tokenizer, write_tekken
from ..model.weights import load_model, save_model
from .forward import train_forward
from .topk_forward import topk_forward
from .passkey import answer, sample_prompt
from .recipe import TOKENIZER_WORDS, Recipe, Stage, retrieval_params


def init_model(cfg: ModelConfig, seed: int) -> ML4:
    """Fresh weights: PyTorch's default Linear init, embeddings N(0, 1), norms 1, SSMax gain 1 (s = 0, b = 1),
    LeRoPE alpha 0."""
    torch.manual_seed(seed)
    model = ML4(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("ssmax_scaling"):
                p[:, 0], p[:, 1] = 0.0, 1.0
            elif name.endswith("lerope.alpha") or name.endswith("bias"):
                p.zero_()
            elif "norm" in name:
                p.fill_(1.0)
    return model


def keep_ssmax_sane(model: ML4) -> None:
    """Project SSMax onto slope s >= 0 and offset b >= 0.1: the query gain then never shrinks with position, so
    beyond the training length it sharpens attention rather than flattening or flipping it."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("ssmax_scaling"):
                p[:, 0].clamp_(min=0.0)
                p[:, 1].clamp_(min=0.1)


class PasskeyBatches:
    """Batches of equal-length passkey sequences: BOS + prompt + answer + EOS, with a loss weight per target."""

    def __init__(self, model_dir: Path, seed: int):
        tok = load_tokenizer(model_dir).instruct_tokenizer.tokenizer
        self.encode, self.eos = tok.encode, tok.eos_id
        self.rng = random.Random(f"train:{seed}")

    def sequence(self, chars: int, echoes: int) -> tuple[list[int], int]:
        """One training sequence with `chars` haystack characters and its prompt length."""
        text, value = sample_prompt(self.rng, chars, self.rng.random(), echoes)
        prompt = self.encode(text, bos=True, eos=False)
        return prompt + self.encode(answer(value), bos=False, eos=False) + [self.eos], len(prompt)

    def batch(self, stage: Stage, tokens_per_batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens [B, T], the answer mask over targets [B, T - 1] (True on the answer and EOS) and the valid mask
        (False on padding: sequences of one batch differ by a token or two, padded with EOS at the end)."""
        chars = round(math.exp(self.rng.uniform(math.log(stage.min_chars), math.log(stage.max_chars))))
        seqs = [self.sequence(chars, self.rng.choice(stage.echoes))
                for _ in range(max(1, tokens_per_batch // (chars + 200)))]
        T = max(len(s) for s, _ in seqs)
        toks = torch.tensor([s + [self.eos] * (T - len(s)) for s, _ in seqs])
        i = torch.arange(T - 1)
        ans = torch.stack([(i >= n - 1) & (i < len(s) - 1) for s, n in seqs])
        valid = torch.stack([i < len(s) - 1 for s, _ in seqs])
        return toks, ans, valid


def lr_at(step: int, steps: int, stage: Stage, warmup: int) -> float:
    """Linear warm-up (the stage's own length if it sets one), then cosine decay to 0."""
    warmup = stage.warmup if stage.warmup is not None else warmup
    if step < warmup:
        return stage.lr * (step + 1) / warmup
    return stage.lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def stage_dir(out: Path, stage: Stage) -> Path:
    return out / f"after-{stage.name}"


STEPS_FILE = "stage_steps"   # in a stage checkpoint: how many of the stage's steps (all rounds) it has seen


DISPATCH_VARS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")


def numeric_env() -> dict[str, str]:
    """What a run's bits depend on besides the recipe and seed: torch (and the MKL it links), the CPU (which picks
    ATen's and MKL's kernels: MKL_ENABLE_INSTRUCTIONS=AVX2 alone moves the copy stage's 4-decimal log off this
    machine's at step 79) and the variables that override that choice."""
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu": hashlib.sha256(cpu_id().encode()).hexdigest()[:16],
            **{k: os.environ[k] for k in DISPATCH_VARS if k in os.environ}}


def train(out: Path, recipe: Recipe = Recipe(), resume: bool = False) -> ML4:
    """Train and save the retrieval checkpoint into `out`; returns the model.

    Every round of a stage ends in a checkpoint, `out/after-<stage>` (the weights as stored: bf16), and the next
    round or stage starts from that checkpoint as loaded, with a fresh optimizer. So `resume` (continue after the
    last finished round, fast-forwarding the data stream through the batches already trained on) gives the same
    weights as one uninterrupted run. Each stage sets torch's thread count to its own; the caller's is restored
    at the end."""
    threads = torch.get_num_threads()
    try:
        return _train(out, recipe, resume)
    finally:
        torch.set_num_threads(threads)


def _train(out: Path, recipe: Recipe, resume: bool) -> ML4:
    out.mkdir(parents=True, exist_ok=True)
    write_tekken(out, TOKENIZER_WORDS)
    cfg = ModelConfig.from_params(retrieval_params())
    model = init_model(cfg, recipe.seed).train()
    data = PasskeyBatches(out, recipe.seed)
    env = numeric_env()
    trained = trained_steps(out, recipe, env) if resume else {}
    log = open(out / "train_log.jsonl", "w")
    log.write(json.dumps({"recipe": asdict(recipe), "params": retrieval_params(), "env": env}) + "\n")
    t0 = time.time()
    for stage in recipe.stages:
        records = trained.get(stage.name, [])
        for rec in records:
            data.batch(stage, recipe.tokens_per_batch)
            log.write(json.dumps(rec) + "\n")
        if records:
            model = load_stage(out, stage)
        exact = [rec["answer_exact"] for rec in records]
        while not stage_done(stage, exact):
            torch.set_num_threads(stage.threads)
            exact += train_round(model, stage, rounds_of(stage, len(exact)), data, recipe, log, t0)
            save_model(model, stage_dir(out, stage))
            (stage_dir(out, stage) / STEPS_FILE).write_text(str(len(exact)))
            model = load_stage(out, stage)
    log.close()
    model.eval()
    save_model(model, out)
    return model


def rounds_of(stage: Stage, steps: int) -> int:
    """How many rounds a stage has run after `steps` of its steps."""
    if steps == 0 or stage.gate is None:
        return min(steps, 1)
    return 1 + (steps - stage.steps) // stage.gate.retry_steps


def stage_done(stage: Stage, exact: list[float]) -> bool:
    """A stage is done after its first round if it has no gate, else once the gate is met or its retries run out."""
    rounds = rounds_of(stage, len(exact))
    if rounds == 0 or stage.gate is None:
        return rounds > 0
    return stage.gate.met(exact) or rounds > stage.gate.retries


def trained_steps(out: Path, recipe: Recipe, env: dict[str, str]) -> dict[str, list[dict]]:
    """For resume: the logged steps of each stage up to its checkpoint, for the stages with one, in recipe order
    (the log may run past a checkpoint, into a round that was interrupted). Warns when the log was written in
    another numeric environment than `env`: the resumed run is then not the run its seed would give here."""
    header, *lines = [json.loads(ln) for ln in (out / "train_log.jsonl").read_text().splitlines()]
    if header.get("env") != env:
        warnings.warn(f"resuming a run logged in another numeric environment (logged: {header.get('env')}; "
                      f"here: {env}): its steps will not be bit-identical to an uninterrupted run")
    trained = {}
    for stage in recipe.stages:
        ckpt = stage_dir(out, stage)
        if not (ckpt / "params.json").exists():
            break
        steps_file = ckpt / STEPS_FILE
        n = int(steps_file.read_text()) if steps_file.exists() else stage.steps  # written before gates existed
        trained[stage.name] = [rec for rec in lines if rec["stage"] == stage.name][:n]
    return trained


def train_round(model: ML4, stage: Stage, round_: int, data: PasskeyBatches, recipe: Recipe, log: TextIO,
                t0: float) -> list[float]:
    """One round of a stage (the stage's steps, or its gate's retry steps) with a fresh AdamW; logs every step
    and returns each step's teacher-forced answer exact match."""
    steps = stage.steps if round_ == 0 else stage.gate.retry_steps
    index_topk = model.cfg.index_topk if stage.sparse else None
    opt = torch.optim.AdamW(model.parameters(), lr=stage.lr, betas=(0.9, 0.95), weight_decay=0.01)
    bar = tqdm(range(steps), desc=f"train-needle {stage.name}" + (f" (retry {round_})" if round_ else ""),
               mininterval=5)
    exacts = []
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, stage, recipe.warmup)
        tokens, ans, valid = data.batch(stage, recipe.tokens_per_batch)
        if stage.topk_only:
            logits, index_kl = topk_forward(model, tokens[:, :-1], recipe.kl_recent_keys)
        else:
            logits, index_kl = train_forward(model, tokens[:, :-1], index_topk)
        ce = F.cross_entropy(logits, tokens[:, 1:].flatten(), reduction="none").view(ans.shape)
        ans_ce = ce[ans].mean()
        loss = ce[valid].mean() + recipe.answer_weight * ans_ce + recipe.index_weight * index_kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip)
        opt.step()
        keep_ssmax_sane(model)
        with torch.no_grad():
            hit = (logits.argmax(-1).view(ans.shape) == tokens[:, 1:]) | ~ans
            exacts.append(hit.all(dim=1).float().mean().item())
        rec = {"stage": stage.name, "step": step, "T": tokens.shape[1], "B": tokens.shape[0],
               "loss": round(loss.item(), 4), "answer_ce": round(ans_ce.item(), 4),
               "index_kl": round(index_kl.item(), 4), "answer_exact": exacts[-1], "s": round(time.time() - t0, 1)}
        if round_:
            rec["round"] = round_
        log.write(json.dumps(rec) + "\n")
        log.flush()
        bar.set_postfix(ans=rec["answer_ce"], kl=rec["index_kl"], exact=exacts[-1], T=rec["T"])
    return exacts


def load_stage(out: Path, stage: Stage) -> ML4:
    """A stage's checkpoint as the next stage trains it (fp32 copy of the stored weights)."""
    return load_model(stage_dir(out, stage)).train()


def report(out: Path, lengths: list[int], samples: int, settings: KVSettings, seed: int) -> dict:
    """Passkey accuracy of the saved checkpoint through `settings`' KV (HiSparse, hot buffer << context), per
    haystack length, with the per-layer needle recall; written to out/eval.json."""
    from .evaluate import passkey_accuracy
    saved = load_model(out)          # the checkpoint as stored (bf16 weights), not the fp32 training copy
    tok = load_tokenizer(out).instruct_tokenizer.tokenizer
    rows = []
    for chars in lengths:
        res = passkey_accuracy(saved, lambda: settings.build(saved.cfg), tok, chars, samples, seed)
        layers = sorted(res[0].recall)
        rows.append({"haystack_chars": chars, "prompt_tokens": round(sum(r.tokens for r in res) / len(res)),
                     "accuracy": sum(r.found for r in res) / len(res), "samples": len(res),
                     "needle_recall": {l: sum(r.recall[l] for r in res) / len(res) for l in layers},
                     "local_recall": {l: round(sum(r.local[l] for r in res) / len(res), 3) for l in layers}})
        print(f"passkey @ {rows[-1]['prompt_tokens']:,} tokens: {100 * rows[-1]['accuracy']:.0f}% of {samples}, "
              f"needle recall per layer {rows[-1]['needle_recall']}, local {rows[-1]['local_recall']}", flush=True)
    result = {"kv": f"hisparse, hot buffer {settings.hot_buffer(saved.cfg)}", "rows": rows}
    (out / "eval.json").write_text(json.dumps(result, indent=1))
    return result


def main(args) -> None:
    """`hisparse train-needle` (args from the CLI)."""
    out = Path(args.out)
    try:     # checked before training: a bad --hot-buffer-tokens fails now, not after the last stage
        settings = KVSettings(offload="hisparse", host_pool_gib=0.25, hot_buffer_tokens=args.hot_buffer_tokens)
    except KVSettingsError as e:
        raise SystemExit(f"--hot-buffer-tokens: {e.problem}") from None
    if not args.eval_only:
        train(out, Recipe(seed=args.seed), resume=args.resume)
    report(out, [int(c) for c in args.eval_chars.split(",")], args.eval_samples, settings, args.seed)
