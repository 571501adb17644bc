"""`hisparse train-drafter`: give a checkpoint a trained DSpark drafter (`mtp_dspark.*`), distilled from the
frozen target itself.

Data: the target's own greedy continuations of the retrieval model's training distribution (synthetic haystack
text after the passkey intro, and passkey prompts answered up to EOS), generated through the inference path
(ML4.forward over HiSparse KV, as `hisparse serve` runs it). Every position records its token, the target's greedy
next token (its label) and the tapped hidden states the drafter's context path reads at inference.

Training: a block anchored at position P (its token not yet run by the target) reads the context rows of the
newest `sliding_window` positions before P, computed by `DSpark.context_rows` from the taps and rounded to the
window cache's dtype, and runs `DSpark.block_logits` + the Markov head with its inputs forced to the anchor and
the target's tokens (`DSpark.forced_logits`): the very functions `DSparkDrafter.propose_batch` runs. Loss: cross
entropy of slot i against the target's greedy token at P + i, counted while the sequence up to P + i is the
target's own greedy continuation (so the label is what greedy verification accepts). Only the drafter trains.

Deterministic for a seed (one thread; the data and every step's anchors derive from it). The state (drafter,
AdamW, step) is saved every `save_every` steps under `<out>/drafter-train/`, so `--resume` continues a run and
gives the same weights as an uninterrupted one. Progress is a tqdm bar; every step appends a line to
`<out>/drafter_log.jsonl`.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..kv.settings import KVSettings
from ..core.batch import ForwardTrace, Segment
from ..core.config import ModelConfig
from ..model.dspark import DSpark
from ..model.ml4 import ML4
from ..model.tokenizer import load_tokenizer
from ..model.weights import load_model, save_model
from .passkey import INTRO, SyntheticHaystack, sample_prompt
from .trainer import numeric_env

WORK = "drafter-train"          # under the output dir while training: the generated data and the resumable state
LOG = "drafter_log.jsonl"


def drafter_params(target: ModelConfig) -> dict[str, Any]:
    """The `mtp` block for the 4-layer, dim-128 retrieval model: one draft layer (the target has four; the drafter
    must cost a fraction of a target forward), block 3 (num_speculative_tokens 3), a 256-token window (a few
    haystack sentences: what the target's continuation depends on), taps after the middle and the last target
    layer, a 32-rank Markov head and a 256-wide FFN (~0.3M parameters)."""
    n = target.n_layers
    return {"method": "dspark", "n_layers": 1, "block_size": 3, "sliding_window": 256,
            "kv_cache_dtype": "bfloat16", "target_layer_ids": sorted({n // 2 - 1, n - 1}), "markov_rank": 32,
            "markov_head_type": "gated_rnn", "hidden_dim": 256, "sample_from_anchor": True}


@dataclass(frozen=True)
class DrafterRecipe:
    seed: int = 0
    sequences: int = 320               # generated training sequences
    passkey_share: float = 0.25        # of them passkey prompts (answered up to EOS), the rest haystack text
    min_chars: int = 48                # prompt haystack length, log-uniform (characters = byte tokens)
    max_chars: int = 1024
    continuation: int = 96             # greedy tokens the target appends to a haystack prompt
    answer_tokens: int = 12            # at most, after a passkey prompt (the answer is ' 1234567.' + EOS)
    gen_batch: int = 16                # sequences decoded together
    steps: int = 4000
    seqs_per_step: int = 4
    anchors_per_seq: int = 64
    lr: float = 2e-3
    warmup: int = 100
    clip: float = 1.0
    save_every: int = 200
    drafter: dict[str, Any] | None = field(default=None)   # the `mtp` block (None: drafter_params)


@dataclass
class Sequence:
    tokens: torch.Tensor            # [T] long: the fed tokens
    labels: torch.Tensor            # [T] long: the target's greedy next token at each position
    taps: dict[int, torch.Tensor]   # layer -> [T, D] hidden state after that target layer


def with_drafter(target: ML4, mtp: dict[str, Any], seed: int) -> ML4:
    """The target's weights (frozen) in a model whose params carry `mtp`, with a fresh drafter: PyTorch's default
    init, mask embeddings N(0, 1) like the token embeddings, norms 1."""
    params = target.cfg.to_params()
    params["mtp"] = dict(mtp)
    model = ML4(ModelConfig.from_params(params))
    missing, unexpected = model.load_state_dict(
        {k: v for k, v in target.state_dict().items() if not k.startswith("mtp_dspark.")}, strict=False)
    assert not unexpected and all(k.startswith("mtp_dspark.") for k in missing), (missing, unexpected)
    torch.manual_seed(seed)
    model.mtp_dspark = DSpark(model.cfg)
    with torch.no_grad():
        torch.nn.init.normal_(model.mtp_dspark.mask_embeddings)
        model.mtp_dspark.markov.gate.bias.zero_()
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("mtp_dspark."))
    return model.eval()


def prompts(model_dir: Path, recipe: DrafterRecipe) -> list[tuple[list[int], int]]:
    """(prompt tokens, greedy tokens to append) per training sequence, from the seed."""
    tok = load_tokenizer(model_dir).instruct_tokenizer.tokenizer
    rng = random.Random(f"drafter:{recipe.seed}")
    out = []
    for _ in range(recipe.sequences):
        chars = round(math.exp(rng.uniform(math.log(recipe.min_chars), math.log(recipe.max_chars))))
        if rng.random() < recipe.passkey_share:
            text, _ = sample_prompt(rng, chars, rng.random())
            out.append((tok.encode(text, bos=True, eos=False), recipe.answer_tokens))
        else:   # haystack cut anywhere, also mid-sentence: the target continues it
            text = "".join(SyntheticHaystack(rng.randrange(1 << 30)).units(chars // 20 + 2))[:chars]
            out.append((tok.encode(INTRO + text, bos=True, eos=False), recipe.continuation))
    return out


@torch.no_grad()
def generate(target: ML4, taps: tuple[int, ...], batch: list[tuple[list[int], int]], eos: int) -> list[Sequence]:
    """Prefill each prompt, then greedy-decode all of them together through ML4.forward over HiSparse KV; a
    passkey answer stops after EOS."""
    kv = KVSettings(offload="hisparse", host_pool_gib=0.25).build(target.cfg, target.device, target.dtype)
    seqs, nxt = [], []
    for r, (prompt, _) in enumerate(batch):
        ids = torch.tensor(prompt)
        parts: list[tuple[torch.Tensor, dict[int, torch.Tensor]]] = []
        for s in range(0, len(prompt), 256):
            n = min(256, len(prompt) - s)
            tr = ForwardTrace(tap_layers=taps)
            logits = target(ids[s:s + n], [Segment(r, s, n)], kv, trace=tr)
            parts.append((logits.argmax(-1), tr.taps))
        seqs.append(Sequence(ids, torch.cat([p[0] for p in parts]),
                             {l: torch.cat([p[1][l] for p in parts]) for l in taps}))
        nxt.append(int(seqs[-1].labels[-1]))
    live = [r for r, (_, n) in enumerate(batch) if n > 0]
    for step in range(max(n for _, n in batch)):
        live = [r for r in live if step < batch[r][1] and int(seqs[r].tokens[-1]) != eos]
        if not live:
            break
        tr = ForwardTrace(tap_layers=taps)
        logits = target(torch.tensor([nxt[r] for r in live]),
                        [Segment(r, len(seqs[r].tokens), 1) for r in live], kv, trace=tr)
        for j, r in enumerate(live):
            s = seqs[r]
            s.tokens = torch.cat((s.tokens, torch.tensor([nxt[r]])))
            s.labels = torch.cat((s.labels, logits[j:j + 1].argmax(-1)))
            s.taps = {l: torch.cat((s.taps[l], tr.taps[l][j:j + 1])) for l in taps}
            nxt[r] = int(s.labels[-1])
    for r in range(len(batch)):
        kv.release(r)
    return seqs


def make_data(target: ML4, model_dir: Path, recipe: DrafterRecipe, taps: tuple[int, ...]) -> list[Sequence]:
    eos = load_tokenizer(model_dir).instruct_tokenizer.tokenizer.eos_id
    todo, data = prompts(model_dir, recipe), []
    for i in tqdm(range(0, len(todo), recipe.gen_batch), desc="train-drafter data", mininterval=5):
        data += generate(target, taps, todo[i:i + recipe.gen_batch], eos)
    return data


def rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to `dtype` (as the window cache stores it), with the gradient of the identity."""
    return x + (x.to(dtype).to(x.dtype) - x).detach()


def drafter_forward(model: ML4, seq: Sequence, anchors: torch.Tensor, n: int) -> torch.Tensor:
    """The drafter's training forward for blocks anchored at positions `anchors` [A] of one sequence, the Markov
    head fed the anchor and then the target's labels -> capped logits [A, n, V], as DSparkDrafter computes them
    for those drafts."""
    m, cfg = model.mtp_dspark, model.cfg
    W, dtype = cfg.mtp.sliding_window, getattr(torch, cfg.mtp.kv_cache_dtype)
    T = seq.tokens.numel()
    rows = rounded(m.context_rows(seq.taps, *model.rope(torch.arange(T))), dtype)           # [L, T, w]
    idx = anchors[:, None] - W + torch.arange(W)                                            # [A, W]
    ctx_pos = torch.where(idx >= 0, idx, -1)
    ctx = rows[:, idx.clamp_min(0)].transpose(0, 1)                                          # [A, L, W, w]
    positions = anchors[:, None] + torch.arange(n)                                          # [A, n]
    u = m.block_logits(model, seq.tokens[anchors], positions, *model.rope(positions.flatten()), ctx, ctx_pos)
    prev = torch.cat((seq.tokens[anchors][:, None], forced_tokens(seq, anchors, n - 1)), dim=1)   # [A, n]
    return m.forced_logits(u, prev)


def forced_tokens(seq: Sequence, anchors: torch.Tensor, n: int) -> torch.Tensor:
    """The target's greedy tokens at positions P .. P + n - 1 (past the end: its last label) -> [A, n]."""
    at = (anchors[:, None] + torch.arange(n)).clamp_max(seq.tokens.numel() - 1)
    return seq.labels[at]


def targets_and_mask(seq: Sequence, anchors: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot i's target (the label at P + i) and whether it counts: P + i is in the sequence and the tokens at
    P + 1 .. P + i are the target's own greedy ones (so greedy verification would see exactly this context)."""
    T = seq.tokens.numel()
    at = anchors[:, None] + torch.arange(n)                                                 # [A, n]
    inside = at < T
    nxt = torch.cat((seq.tokens[1:], seq.tokens.new_full((1,), -1)))                        # token at p + 1
    agree = (seq.labels == nxt)[at.clamp_max(T - 1)] & inside                               # label p is fed next
    chain = torch.cat((torch.ones_like(agree[:, :1]), agree[:, :-1].long().cumprod(1).bool()), dim=1)
    return seq.labels[at.clamp_max(T - 1)], inside & chain


def lr_at(step: int, r: DrafterRecipe) -> float:
    if step < r.warmup:
        return r.lr * (step + 1) / r.warmup
    return r.lr * 0.5 * (1 + math.cos(math.pi * (step - r.warmup) / max(1, r.steps - r.warmup)))


def train_drafter(model_dir: Path, out: Path, recipe: DrafterRecipe = DrafterRecipe(), resume: bool = False,
                  until: int | None = None) -> ML4:
    """Train the drafter of the checkpoint in `model_dir` and write the checkpoint with it into `out` (may be the
    same directory). `until`: stop after that many steps, leaving the resumable state (a later `resume` goes on)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(model_dir, out, recipe, resume, until)
    finally:
        torch.set_num_threads(threads)


def _train(model_dir: Path, out: Path, recipe: DrafterRecipe, resume: bool, until: int | None) -> ML4:
    mtp = recipe.drafter or drafter_params(ModelConfig.load(model_dir))
    model = with_drafter(load_model(model_dir, progress=False), mtp, recipe.seed)
    m, n = model.mtp_dspark, model.cfg.mtp.block_size
    taps = model.cfg.mtp.target_layer_ids
    work = out / WORK
    work.mkdir(parents=True, exist_ok=True)
    opt = torch.optim.AdamW(m.parameters(), lr=recipe.lr, betas=(0.9, 0.95), weight_decay=0.01)
    header = {"recipe": asdict(recipe), "mtp": mtp, "env": numeric_env()}
    start, records = 0, []
    if resume and (work / "state.pt").exists():
        state = torch.load(work / "state.pt")
        m.load_state_dict(state["drafter"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        records = [json.loads(ln) for ln in (out / LOG).read_text().splitlines()[1:]][:start]
    if (work / "data.pt").exists() and resume:
        data = [Sequence(**d) for d in torch.load(work / "data.pt")]
    else:
        data = make_data(model, model_dir, recipe, taps)
        torch.save([asdict(s) for s in data], work / "data.pt")
    log = open(out / LOG, "w")
    log.write(json.dumps(header) + "\n")
    for rec in records:
        log.write(json.dumps(rec) + "\n")
    t0 = time.time()
    stop = recipe.steps if until is None else min(until, recipe.steps)
    bar = tqdm(range(start, stop), desc="train-drafter", initial=start, total=recipe.steps, mininterval=5)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, recipe)
        g = torch.Generator().manual_seed(recipe.seed * 1_000_003 + step)
        pick = torch.randint(len(data), (recipe.seqs_per_step,), generator=g).tolist()
        losses, hits, counts = [], torch.zeros(n), torch.zeros(n)
        for i in pick:
            seq = data[i]
            anchors = torch.randint(seq.tokens.numel(), (recipe.anchors_per_seq,), generator=g)
            z = drafter_forward(model, seq, anchors, n)                                   # [A, n, V]
            y, mask = targets_and_mask(seq, anchors, n)
            if mask.any():
                losses.append(F.cross_entropy(z[mask], y[mask], reduction="sum"))
            hit = (z.argmax(-1) == y) & mask
            hits += hit.long().cumprod(1).sum(0)        # slot i accepted: every slot up to i drafted right
            counts += mask.sum(0)
        loss = torch.stack(losses).sum() / counts.sum().clamp_min(1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), recipe.clip)
        opt.step()
        rec = {"step": step, "loss": round(loss.item(), 4),
               "accepted_per_pos": [round(h / max(c, 1), 3) for h, c in zip(hits.tolist(), counts.tolist())],
               "s": round(time.time() - t0, 1)}
        log.write(json.dumps(rec) + "\n")
        log.flush()
        bar.set_postfix(loss=rec["loss"], acc=rec["accepted_per_pos"])
        if (step + 1) % recipe.save_every == 0 or step + 1 == stop:
            torch.save({"step": step + 1, "drafter": m.state_dict(), "opt": opt.state_dict()}, work / "state.pt")
    log.close()
    if stop < recipe.steps:
        return model
    save_model(model, out)
    if not (out / "tekken.json").exists() and (model_dir / "tekken.json").exists():
        shutil.copy(model_dir / "tekken.json", out / "tekken.json")
    shutil.rmtree(work)
    return model


def main(args) -> None:
    """`hisparse train-drafter` (args from the CLI)."""
    recipe = DrafterRecipe(seed=args.seed, **({"steps": args.steps} if args.steps else {}))
    train_drafter(Path(args.model), Path(args.out or args.model), recipe, resume=args.resume)
