"""How much a LeRoPE stretch of some RoPE pairs breaks a trained retrieval model before any training adapts it.

    python -m benchmarks.needle.stretch_probe --model checkpoints/needle-ml4 \\
        [--out benchmarks/results/needle/trained/lerope-ramp/stretch_probe.json]

For each setting of LeRoPE alpha (none; each of the slow pairs 4-7 stretched alone to `RAMPED_ALPHA`'s or the
first ramp's value; combinations), the trainer's top-k-only forward (the selections `hisparse serve` makes)
scores the same fresh passkey sequences (the trainer's format, haystacks of 3k, 6k and 12k characters)
teacher-forced: the answer's exact match and mean cross-entropy per sequence. A pair whose stretch alone breaks the
answers carries something the model relies on at the distances it trained on; training to a stretch of it starts
from a broken model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from hisparse.model.weights import load_model
from hisparse.train.recipe import RAMPED_ALPHA, Stage
from hisparse.train.topk_forward import topk_forward
from hisparse.train.trainer import PasskeyBatches, answer_hits

FIRST_RAMP = (0.0, 0.0, 0.0, 0.0, -2.25, -2.875, -3.921875, -5.1875)   # pairs 4-7, the first ramp tried
LENGTHS = (3000, 3000, 6000, 6000, 12000)


def settings() -> dict[str, tuple[float, ...]]:
    """The alphas probed, by name: none, each slow pair alone at the first ramp's stretch, half of pair 6's, the
    first ramp whole and without pair 6, and the recipe's."""
    one = {f"pair {j} alone": tuple(a if i == j else 0.0 for i, a in enumerate(FIRST_RAMP)) for j in (4, 5, 6, 7)}
    half6 = tuple(a / 2 if i == 6 else 0.0 for i, a in enumerate(FIRST_RAMP))
    return {"none": (0.0,) * 8, **one, "pair 6 alone, half": half6, "pairs 4-7": FIRST_RAMP,
            "pairs 4, 5, 7": tuple(0.0 if i == 6 else a for i, a in enumerate(FIRST_RAMP)),
            "pairs 4-7, 3/4 (RAMPED_ALPHA)": RAMPED_ALPHA}


@torch.no_grad()
def probe(model_dir: Path, seed: int) -> dict:
    """Per alpha setting: teacher-forced answer exact match and answer CE of each probe sequence."""
    model = load_model(model_dir, progress=False).eval()
    data = PasskeyBatches(model_dir, seed)
    batches = [data.batch(Stage("probe", 1, c, c, True, 0.0), 3072) for c in LENGTHS]
    rows = []
    for name, alpha in tqdm(settings().items(), desc="stretch probe"):
        model.lerope.alpha.copy_(torch.tensor(alpha))
        exact, ce = [], []
        for tokens, ans, _ in batches:
            logits, _ = topk_forward(model, tokens[:, :-1], 64)
            loss = F.cross_entropy(logits, tokens[:, 1:].flatten(), reduction="none").view(ans.shape)
            exact.append(answer_hits(logits, tokens[:, 1:], ans).float().mean().item())
            ce.append(round(loss[ans].mean().item(), 4))
        rows.append({"setting": name, "alpha": list(alpha), "answer_exact": exact, "answer_ce": ce})
        print(f"{name:32s} exact {sum(exact):.0f}/{len(exact)}  answer CE {ce}", flush=True)
    return {"model": str(model_dir), "haystack_chars": list(LENGTHS), "seed": seed, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path("checkpoints/needle-ml4"))
    ap.add_argument("--seed", type=int, default=123)
    ap.add_argument("--out", type=Path,
                    default=Path("benchmarks/results/needle/trained/lerope-ramp/stretch_probe.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    result = probe(args.model, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
