"""How far a RoPE indexer can rank the newest keys above every far one, for a choice of RoPE frequencies.

    python -m benchmarks.needle.rope_margin [--near 16] [--far 1024] [--contexts 131072,1048576] \\
        [--out benchmarks/results/needle/trained/rope_margin.json]

The RoPE part of a query-key dot product at distance d is f(d) = sum_j a_j cos(d w_j) + b_j sin(d w_j): the
query's and key's pair j fix a_j and b_j, the frequencies w_j are the model's (YaRN, LeRoPE alpha 0). A linear
program finds the coefficients with sum_j |a_j| + |b_j| = 1 that maximise the margin m with f(d) >= u + m for
every near distance (0 .. --near) and f(d) <= u for every far one (--far .. context - 1): the best separation
any indexer head's RoPE part can reach, per unit of coefficient. A margin near 0 means some far distance repeats
the phases of the near ones whatever the weights (the aliasing measured by `benchmarks.needle.distances`).
The far constraints are generated lazily: solve on a sample, add the distances that violate it, repeat; the
returned coefficients are checked against every far distance, so the margin holds on all of them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from scipy.optimize import linprog

from hisparse.core.config import ModelConfig
from hisparse.model.rope import rope_frequencies
from hisparse.train.recipe import Recipe

CHOICES = [(100.0, 4), (100.0, 64), (1e3, 16), (1e3, 64), (1e4, 4), (1e4, 16), (1e4, 64), (1e5, 4), (1e5, 16),
           (1e6, 4), (1e6, 16)]     # (rope_theta, yarn factor) over YaRN's original length 64
SOLVER_TOL = 1e-7           # HiGHS' feasibility tolerance: far distances within it of u are not re-added


def frequencies(rope_theta: float, yarn_factor: int) -> np.ndarray:
    """The retrieval model's RoPE frequencies [8] for this choice (LeRoPE alpha 0, as training keeps it)."""
    cfg = ModelConfig.from_params(Recipe(rope_theta=rope_theta, yarn_factor=yarn_factor).params())
    return rope_frequencies(cfg, torch.zeros(cfg.qk_rope_head_dim // 2)).numpy()


def _features(omega: np.ndarray, d: np.ndarray) -> np.ndarray:
    phase = d.astype(np.float64)[:, None] * omega[None, :]
    return np.hstack([np.cos(phase), np.sin(phase)])                    # [len(d), 2J]


def margin(omega: np.ndarray, near: int, far: int, context: int, sample: int = 4000,
           rounds: int = 40) -> tuple[float, np.ndarray, float]:
    """(margin, coefficients [2J] (cos then sin), threshold u) of the linear program in the module docstring; the
    margin is min f(near) - max f(far) of the coefficients found, over every far distance."""
    n = 2 * omega.size
    near_f = _features(omega, np.arange(near + 1))
    everywhere = np.arange(far, context)
    chosen = np.random.default_rng(0).choice(everywhere, min(sample, everywhere.size), replace=False)
    for _ in range(rounds):
        far_f = _features(omega, chosen)
        # variables: p [n], q [n] (coefficients p - q), u, m; maximise m
        cost = np.zeros(2 * n + 2)
        cost[-1] = -1
        a_ub = np.vstack([np.hstack([-near_f, near_f, np.ones((near + 1, 2))]),         # u + m - f(near) <= 0
                          np.hstack([far_f, -far_f, -np.ones((len(chosen), 1)), np.zeros((len(chosen), 1))]),
                          np.concatenate([np.ones(2 * n), [0, 0]])[None]])              # sum |coef| <= 1
        b_ub = np.zeros(a_ub.shape[0])
        b_ub[-1] = 1
        res = linprog(cost, A_ub=a_ub, b_ub=b_ub, bounds=[(0, None)] * (2 * n) + [(None, None)] * 2,
                      method="highs")
        coef, u = res.x[:n] - res.x[n:2 * n], res.x[-2]
        worst, top = [], -np.inf
        for lo in range(0, everywhere.size, 1 << 18):
            d = everywhere[lo:lo + (1 << 18)]
            f = _features(omega, d) @ coef
            top = max(top, float(f.max()))
            over = np.nonzero(f > u + SOLVER_TOL)[0]
            worst.extend(d[over[np.argsort(f[over])[-64:]]].tolist())
        if not worst:     # the margin these coefficients keep over every far distance
            return float((near_f @ coef).min()) - top, coef, u
        chosen = np.concatenate([chosen, worst])
    raise RuntimeError(f"the far constraints did not settle in {rounds} rounds")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--near", type=int, default=16)
    ap.add_argument("--far", type=int, default=1024)
    ap.add_argument("--contexts", default="131072,1048576")
    ap.add_argument("--out", default="benchmarks/results/needle/trained/rope_margin.json")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = []
    for theta, factor in CHOICES:
        omega = frequencies(theta, factor)
        row = {"rope_theta": theta, "yarn_factor": factor,
               "wavelengths": [round(float(2 * np.pi / w)) for w in omega],
               "margin": {str(c): round(margin(omega, args.near, args.far, c)[0], 4) for c in contexts}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"near": args.near, "far": args.far, "contexts": contexts,
                                          "recipe": [Recipe.rope_theta, Recipe.yarn_factor], "rows": rows},
                                         indent=1))


if __name__ == "__main__":
    main()
