"""Planted bugs against the suite, over many test seeds: each bug is a one-line change to a copy of the tree, and
the tests that should catch it run once per `HISPARSE_TEST_SEED`. A bug is caught every run when its tests fail
under every seed (a seed may vary the data, never whether a boundary case is covered).

The three bugs are the ones an earlier review found surviving: the scheduler preempting the oldest running request
instead of the newest, the chat endpoint preferring `max_tokens` over `max_completion_tokens`, and the
vocab-parallel embedding's shard bound off by one. Writes JSON (per bug and seed: caught or not).

    python -m benchmarks.test_strength.planted [--seeds 20] [--out benchmarks/results/test_strength]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Bug:
    name: str
    path: str          # the file, relative to the tree
    old: str           # the line's text before ...
    new: str           # ... and with the bug
    tests: tuple[str, ...]


BUGS = (
    Bug("preempt the oldest", "hisparse/engine/scheduler.py", "self.preempt(self.running[-1])",
        "self.preempt(self.running[0])", ("tests/test_preemption_victim.py",)),
    Bug("max_tokens over max_completion_tokens", "hisparse/server/serving_chat.py",
        "req.max_completion_tokens or req.max_tokens", "req.max_tokens or req.max_completion_tokens",
        ("tests/test_server_completions.py::test_chat_max_completion_tokens_wins_over_max_tokens",)),
    Bug("vocab shard bound off by one", "hisparse/parallel/tp.py", "(local < self.num_embeddings)",
        "(local <= self.num_embeddings)", ("tests/test_tp_vocab.py",)),
)


def tree_copy(dest: Path) -> None:
    """The committed tree (HEAD) into dest."""
    data = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")


def plant(tree: Path, bug: Bug) -> None:
    f = tree / bug.path
    text = f.read_text()
    if text.count(bug.old) != 1:
        raise SystemExit(f"{bug.name}: {bug.old!r} is not exactly once in {bug.path}")
    f.write_text(text.replace(bug.old, bug.new))


def run_tests(tree: Path, tests: tuple[str, ...], seed: int) -> bool:
    """Whether the tests fail (the bug is caught) under `seed`."""
    env = dict(os.environ, HISPARSE_TEST_SEED=str(seed), PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                          cwd=tree, env=env, capture_output=True, text=True)
    return proc.returncode != 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/test_strength")
    args = ap.parse_args()
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    results, t0 = [], time.perf_counter()
    with tqdm(total=len(BUGS) * (len(seeds) + 1), desc="planted bugs") as bar:
        for bug in BUGS:
            with tempfile.TemporaryDirectory() as tmp:
                tree = Path(tmp)
                tree_copy(tree)
                clean = not run_tests(tree, bug.tests, seeds[0])     # the tests pass without the bug
                bar.update()
                plant(tree, bug)
                caught = {}
                for s in seeds:
                    caught[s] = run_tests(tree, bug.tests, s)
                    bar.update()
            results.append({"bug": bug.name, "file": bug.path, "tests": list(bug.tests), "pass_without_bug": clean,
                            "caught": caught, "caught_every_seed": all(caught.values())})
            print(f"{bug.name}: passes without it: {clean}; caught under {sum(caught.values())}/{len(seeds)} seeds",
                  flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "planted.json").write_text(json.dumps(
        {"command": f"python -m benchmarks.test_strength.planted --seeds {args.seeds} --first-seed {args.first_seed}",
         "seeds": seeds, "bugs": results, "wall_s": round(time.perf_counter() - t0)}, indent=2) + "\n")


if __name__ == "__main__":
    main()
