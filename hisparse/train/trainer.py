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
from dataclasses import asdict, dataclass, field, replace
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
from .frozen_haystack import FrozenHaystack, build_haystack, live_needle
from .prefix_forward import prefix_forward
from .topk_forward import topk_forward
from .passkey import answer, random_value, sample_prompt
from .recipe import FIRST_STAGES, LONG_STAGES, TOKENIZER_WORDS, Recipe, Stage


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

    def needle(self) -> tuple[float, str]:
        """A frozen-haystack step's needle: its depth (0..1) and passkey value."""
        depth = self.rng.random()
        return depth, random_value(self.rng)

    def draw(self, stage: Stage, tokens_per_batch: int) -> tuple[tuple, tuple | None]:
        """What one step of `stage` trains on: a needle in a frozen-haystack stage, else a batch; and a batch of
        its replay stage, if it has one."""
        drawn = self.needle() if stage.frozen else self.batch(stage, tokens_per_batch)
        return drawn, None if stage.replay is None else self.batch(stage.replay, tokens_per_batch)


def haystack_seed(recipe: Recipe, stage: Stage, round_: int) -> int:
    """The synthetic haystack a frozen-haystack stage's round caches (the data stream does not draw it, so a resumed
    round finds it without replaying the stream)."""
    return random.Random(f"haystack:{recipe.seed}:{stage.name}:{round_}").randrange(1 << 30)


def lr_at(step: int, steps: int, stage: Stage, warmup: int) -> float:
    """Linear warm-up (the stage's own length if it sets one), then cosine decay to 0."""
    warmup = stage.warmup if stage.warmup is not None else warmup
    if step < warmup:
        return stage.lr * (step + 1) / warmup
    return stage.lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def answer_hits(logits: torch.Tensor, targets: torch.Tensor, ans: torch.Tensor) -> torch.Tensor:
    """[B] bool: whether each sequence's answer (and EOS) is the argmax at every answer position, teacher-forced;
    logits [B n, V] of the rows whose next tokens are targets [B, n], ans the answer mask [B, n]."""
    hit = (logits.argmax(-1).view(ans.shape) == targets) | ~ans
    return hit.all(dim=1)


def lerope_at(recipe: Recipe, stage: Stage, step: int) -> torch.Tensor:
    """LeRoPE alpha for step `step` of a stage's first round that sets one: `stage.lerope_alpha`, reached linearly
    over `stage.lerope_ramp` steps from the latest earlier stage's setting (0 if none). Later rounds and stages
    keep it from the checkpoint."""
    target = torch.tensor(stage.lerope_alpha)
    before = [s.lerope_alpha for s in recipe.stages[:recipe.stages.index(stage)] if s.lerope_alpha is not None]
    start = torch.tensor(before[-1]) if before else torch.zeros_like(target)
    if stage.lerope_ramp <= 0 or step + 1 >= stage.lerope_ramp:
        return target
    return start + (target - start) * ((step + 1) / stage.lerope_ramp)


def stage_dir(out: Path, stage: Stage) -> Path:
    return out / f"after-{stage.name}"


STEPS_FILE = "stage_steps"   # in a stage checkpoint: how many of the stage's steps (all rounds) it has seen
PARTIAL_FILE = "partial.pt"   # the round in progress: weights and optimizer after its last saved step
PARTIAL_EVERY_S = 60.0        # how often a round saves its progress (a 128k step takes minutes)


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
    cfg = ModelConfig.from_params(recipe.params())
    model = init_model(cfg, recipe.seed).train()
    data = PasskeyBatches(out, recipe.seed)
    env = numeric_env()
    partial = RoundState.load(out) if resume else None
    trained = trained_steps(out, recipe, env, partial) if resume else {}
    log = open(out / "train_log.jsonl", "w")
    log.write(json.dumps({"recipe": asdict(recipe), "params": recipe.params(), "env": env}) + "\n")
    t0 = time.time()
    for stage in recipe.stages:
        records = trained.get(stage.name, [])
        for rec in records:
            data.draw(stage, recipe.tokens_per_batch)
            log.write(json.dumps(rec) + "\n")
        state = partial if partial is not None and partial.stage == stage.name else None
        if records and (state is None or state.start > 0):
            model = load_stage(out, stage)
        exact = [rec["answer_exact"] for rec in records]
        while state is not None or not stage_done(stage, exact):
            start = state.start if state is not None else len(exact)
            torch.set_num_threads(stage.threads)
            at = Progress(out, log, t0, start, state, exact[start:])
            exact = exact[:start] + train_round(model, stage, data, recipe, at)
            state = None
            save_model(model, stage_dir(out, stage))
            write_tekken(stage_dir(out, stage), TOKENIZER_WORDS)     # each stage's folder loads on its own
            (stage_dir(out, stage) / STEPS_FILE).write_text(str(len(exact)))
            (out / PARTIAL_FILE).unlink(missing_ok=True)
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


def trained_steps(out: Path, recipe: Recipe, env: dict[str, str],
                  partial: RoundState | None = None) -> dict[str, list[dict]]:
    """For resume: the logged steps of each stage up to its checkpoint, in recipe order (the log may run past a
    checkpoint, into a round that was interrupted). A stage's checkpoint is its `after-<stage>` folder, or the
    round in progress's `partial` save, or, for a finished stage without a folder (a shipped checkpoint and its
    log), the checkpoint in `out` itself. Warns when the log was written in another numeric environment than
    `env`: the resumed run is then not the run its seed would give here."""
    header, *lines = [json.loads(ln) for ln in (out / "train_log.jsonl").read_text().splitlines()]
    params = recipe.params()
    differ = sorted(k for k in header["params"].keys() | params.keys() if header["params"].get(k) != params.get(k))
    if differ:
        raise ValueError(f"resume: {out / 'train_log.jsonl'} trained a model whose params differ in {differ} "
                         f"(--rope-theta / --yarn-factor choose rope_theta and yarn)")
    if header.get("env") != env:
        warnings.warn(f"resuming a run logged in another numeric environment (logged: {header.get('env')}; "
                      f"here: {env}): its steps will not be bit-identical to an uninterrupted run")
    trained = {}
    for stage in recipe.stages:
        logged = [rec for rec in lines if rec["stage"] == stage.name]
        ckpt = stage_dir(out, stage)
        steps_file = ckpt / STEPS_FILE
        if partial is not None and partial.stage == stage.name:
            trained[stage.name] = logged[:partial.start + partial.step]
            break
        if (ckpt / "params.json").exists():   # a stage folder written before gates existed has no steps file
            trained[stage.name] = logged[:int(steps_file.read_text()) if steps_file.exists() else stage.steps]
        elif (out / "params.json").exists() and stage_done(stage, [rec["answer_exact"] for rec in logged]):
            trained[stage.name] = logged
        else:
            break
    return trained


@dataclass
class RoundState:
    """A round in progress, as saved after one of its steps: the stage's steps before the round (`start`), the
    round's steps done (`step`), and the fp32 weights and AdamW state after them. Resuming from it fast-forwards
    the data stream as for a finished round, so the run's weights stay those of an uninterrupted run."""
    stage: str
    start: int
    step: int
    model: dict
    opt: dict

    def save(self, out: Path) -> None:
        tmp = out / (PARTIAL_FILE + ".tmp")
        torch.save(asdict(self), tmp)
        os.replace(tmp, out / PARTIAL_FILE)     # a crash mid-write leaves the previous save

    @staticmethod
    def load(out: Path) -> RoundState | None:
        path = out / PARTIAL_FILE
        return RoundState(**torch.load(path, weights_only=True)) if path.exists() else None


@dataclass
class Progress:
    """Where a round writes (checkpoint folder, log, the run's start time) and where it starts: the stage's steps
    before it and, when resuming, the saved state of the round and its steps' logged exact matches."""
    out: Path
    log: TextIO
    t0: float
    start: int
    state: RoundState | None = None
    done: list[float] = field(default_factory=list)


def train_round(model: ML4, stage: Stage, data: PasskeyBatches, recipe: Recipe, at: Progress) -> list[float]:
    """One round of a stage (the stage's steps, or its gate's retry steps) with a fresh AdamW, or the rest of an
    interrupted one; logs every step, saves the round's progress every PARTIAL_EVERY_S seconds, and returns each
    of the round's steps' teacher-forced answer exact match (the resumed round's earlier steps from the log)."""
    round_ = rounds_of(stage, at.start)
    steps = stage.steps if round_ == 0 else stage.gate.retry_steps
    hay = None
    if stage.frozen:   # cached under the round's starting weights (before a resumed round loads its saved ones)
        hay = build_haystack(model, data.encode, haystack_seed(recipe, stage, round_), stage.max_chars,
                             recipe.kl_recent_keys)
    opt = torch.optim.AdamW(model.parameters(), lr=stage.lr, betas=(0.9, 0.95), weight_decay=0.01)
    first, exacts = 0, []
    if at.state is not None:
        model.load_state_dict(at.state.model)
        opt.load_state_dict(at.state.opt)
        first, exacts = at.state.step, list(at.done)
    bar = tqdm(range(first, steps), desc=f"train-needle {stage.name}" + (f" (retry {round_})" if round_ else ""),
               mininterval=5, initial=first, total=steps)
    saved = time.time()
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, stage, recipe.warmup)
        if round_ == 0 and stage.lerope_alpha is not None:
            with torch.no_grad():
                model.lerope.alpha.copy_(lerope_at(recipe, stage, step))
        drawn, replay = data.draw(stage, recipe.tokens_per_batch)
        logits, targets, ans, valid, index_kl, (B, T) = step_forward(model, stage, drawn, data, recipe, hay)
        loss, ans_ce = step_loss(logits, targets, ans, valid, index_kl, recipe)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        extra = {}
        if replay is not None:      # its gradients add to the step's (one backward each: one graph at a time)
            r_logits, r_targets, r_ans, r_valid, r_kl, (_, r_T) = step_forward(model, stage.replay, replay, data,
                                                                                recipe, None)
            r_loss, r_ce = step_loss(r_logits, r_targets, r_ans, r_valid, r_kl, recipe)
            r_loss.backward()
            loss = loss.detach() + r_loss.detach()
            with torch.no_grad():
                r_exact = answer_hits(r_logits, r_targets, r_ans).float().mean().item()
            extra = {"replay_T": r_T, "replay_answer_ce": round(r_ce.item(), 4), "replay_exact": r_exact}
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip)
        opt.step()
        keep_ssmax_sane(model)
        with torch.no_grad():
            exacts.append(answer_hits(logits, targets, ans).float().mean().item())
        rec = {"stage": stage.name, "step": step, "T": T, "B": B,
               "loss": round(loss.item(), 4), "answer_ce": round(ans_ce.item(), 4),
               "index_kl": round(index_kl.item(), 4), "answer_exact": exacts[-1], **extra,
               "s": round(time.time() - at.t0, 1)}
        if round_:
            rec["round"] = round_
        at.log.write(json.dumps(rec) + "\n")
        at.log.flush()
        if step + 1 < steps and time.time() - saved >= PARTIAL_EVERY_S:
            RoundState(stage.name, at.start, step + 1, model.state_dict(), opt.state_dict()).save(at.out)
            saved = time.time()
        bar.set_postfix(ans=rec["answer_ce"], kl=rec["index_kl"], exact=exacts[-1], T=rec["T"])
    return exacts


def step_forward(model: ML4, stage: Stage, drawn: tuple, data: PasskeyBatches, recipe: Recipe,
                 hay: FrozenHaystack | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, int]]:
    """One step's forward on what it drew (`PasskeyBatches.draw`): logits [B n, V] of the rows whose next tokens
    are targets [B, n], the answer and loss masks [B, n], the indexer KL (the answer queries' weighted by
    `stage.answer_kl` in top-k-only and frozen-haystack stages) and the sequences' (B, T)."""
    if stage.frozen:
        depth, value = drawn
        live = live_needle(hay, data.encode, data.eos, value, depth)
        logits, query_kl = prefix_forward(model, hay.cache, live.tokens, live.after, live.positions,
                                          recipe.kl_recent_keys)
        index_kl = query_kl.mean(1).mean() + stage.answer_kl * query_kl[:, live.ans].mean()
        T = hay.cache.tokens.numel() + live.tokens.numel() + 1
        return logits, live.targets[None], live.ans[None], live.valid[None], index_kl, (1, T)
    tokens, ans, valid = drawn
    if stage.topk_only:
        logits, query_kl = topk_forward(model, tokens[:, :-1], recipe.kl_recent_keys)
        index_kl = query_kl.mean(1).mean() + stage.answer_kl * query_kl[:, ans.flatten()].mean()
    else:
        logits, index_kl = train_forward(model, tokens[:, :-1], model.cfg.index_topk if stage.sparse else None)
    return logits, tokens[:, 1:], ans, valid, index_kl, tuple(tokens.shape)


def step_loss(logits: torch.Tensor, targets: torch.Tensor, ans: torch.Tensor, valid: torch.Tensor,
              index_kl: torch.Tensor, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """The recipe's loss of one step (`step_forward`'s outputs): token CE + answer_weight x answer CE +
    index_weight x indexer KL, and the answer CE."""
    ce = F.cross_entropy(logits, targets.flatten(), reduction="none").view(ans.shape)
    ans_ce = ce[ans].mean()
    return ce[valid].mean() + recipe.answer_weight * ans_ce + recipe.index_weight * index_kl, ans_ce


def load_stage(out: Path, stage: Stage) -> ML4:
    """A stage's checkpoint as the next stage trains it (fp32 copy of the stored weights): its own folder, or the
    checkpoint in `out` (a shipped model). A DSpark drafter stored with it is dropped: it was distilled from the
    weights that training now changes (`hisparse train-drafter` distils a new one)."""
    ckpt = stage_dir(out, stage)
    model = load_model(ckpt if (ckpt / "params.json").exists() else out, progress=False)
    if model.mtp_dspark is not None:
        bare = ML4(replace(model.cfg, mtp=None))
        bare.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("mtp_dspark.")})
        model = bare
    return model.train()


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
        recipe = Recipe(seed=args.seed, stages=FIRST_STAGES + LONG_STAGES[args.long_stages],
                        rope_theta=args.rope_theta, yarn_factor=args.yarn_factor)
        train(out, recipe, resume=args.resume)
    report(out, [int(c) for c in args.eval_chars.split(",")], args.eval_samples, settings, args.seed)
