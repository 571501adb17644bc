"""Mutation testing of chosen modules against their tests: each mutant is one small change to a module's source (a
comparison, `+`/`-` or `and`/`or` swapped, a small int or a bool changed, a `not` dropped), found with `ast` and made
by editing only that token's text in a copy of the tree (HEAD); the tests that run its line (`--select coverage`:
one coverage run of the quick suite with a context per test function, cached) or its module's table entry then
run once with a fixed test seed, quickest first and stopping at the first failure. A mutant is killed when they
fail or time out, survives when they pass, and is invalid (not counted) when it does not compile. Each has a
stable id `module:line:col:operator`; results are appended to `<out>/mutants.jsonl`, so a run resumes where one
stopped, and `<out>/mutation.json` holds the score per module and the survivors. Survivors listed in
`equivalent.json` (id -> reason, kept by hand) count as equivalent and leave the score.

    pip install coverage     # (the default --select coverage)
    python -m benchmarks.test_strength.mutate [--modules resolver,scheduler] [--max-per-module 40] [--seed 0]
        [--select coverage|table] [--jobs 2] [--out benchmarks/results/test_strength] [--list] [--report-only]
"""

from __future__ import annotations

import argparse
import ast
import bisect
import functools
import hashlib
import itertools
import json
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree

from tqdm import tqdm

from .planted import ROOT, tree_copy
from .report import EQUIVALENT, report

# tests that assert wall-clock bounds of a server process: a traced test process misses them, and coverage does not
# trace the server they measure, so the coverage run leaves them out
WALL_CLOCK = ("tests/test_server_hostile.py::test_health_answers_within_100ms_while_heavy_requests_run",
              "tests/test_server_hostile.py::test_a_light_client_keeps_its_pace_beside_a_heavy_one")

KV = ("tests/test_hisparse_kv.py", "tests/test_hybrid.py", "tests/test_device_budget.py", "tests/test_triton_kv.py",
      "tests/test_host_sync.py", "tests/test_full_graph.py", "tests/test_prefix_cache.py")   # the stores' tests
MODULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "resolver": ("hisparse/gpu_working_set/resolver.py", ("tests/test_resolver.py", *KV)),
    "static_plan": ("hisparse/gpu_working_set/static_plan.py", ("tests/test_full_graph.py", "tests/test_host_sync.py")),
    "miss_path_wrapper": ("hisparse/gpu_working_set/kernels/miss_path_triton.py",
                          ("tests/test_triton_miss_path.py", "tests/test_triton_kv.py")),
    "hisparse_kv": ("hisparse/kv/hisparse_kv.py", KV),
    "device_budget": ("hisparse/kv/device_budget.py", ("tests/test_device_budget.py", *KV)),
    "hybrid": ("hisparse/kv/hybrid.py", KV),
    "resident_pages": ("hisparse/gpu_working_set/resident_pages.py", ("tests/test_device_budget.py", *KV)),
    "scheduler": ("hisparse/engine/scheduler.py", ("tests/test_preemption_victim.py", "tests/test_engine.py")),
    "sampling": ("hisparse/engine/sampling.py", ("tests/test_sampling_processors.py", "tests/test_engine.py")),
    "speculative": ("hisparse/engine/speculative.py", ("tests/test_engine_speculative.py",)),
    "spec_decode": ("hisparse/engine/spec_decode.py", ("tests/test_engine_speculative.py",)),
    "dcp_combine": ("hisparse/parallel/context.py", ("tests/test_dcp_context.py", "tests/test_dcp.py")),
    "tp": ("hisparse/parallel/tp.py", ("tests/test_tp_vocab.py", "tests/test_tp.py")),
    "pages": ("hisparse/host_pool/pages.py", ("tests/test_hisparse_kv.py", "tests/test_prefix_cache.py")),
    "pool": ("hisparse/host_pool/pool.py", ("tests/test_pinned_pool.py", "tests/test_hisparse_kv.py")),
    "detokenizer": ("hisparse/engine/detokenizer.py", ("tests/test_engine.py",)),
}

# Operator swaps: ast op type -> (regex for its token in the source, replacement text, operator name).
CMP = {ast.Lt: (rb"<", "<=", "Lt->LtE"), ast.LtE: (rb"<=", "<", "LtE->Lt"), ast.Gt: (rb">", ">=", "Gt->GtE"),
       ast.GtE: (rb">=", ">", "GtE->Gt"), ast.Eq: (rb"==", "!=", "Eq->NotEq"), ast.NotEq: (rb"!=", "==", "NotEq->Eq"),
       ast.Is: (rb"\bis\b", "is not", "Is->IsNot"), ast.IsNot: (rb"\bis[ \t]+not\b", "is", "IsNot->Is"),
       ast.In: (rb"\bin\b", "not in", "In->NotIn"), ast.NotIn: (rb"\bnot[ \t]+in\b", "in", "NotIn->In")}
ARITH = {ast.Add: (rb"\+", "-", "Add->Sub"), ast.Sub: (rb"-", "+", "Sub->Add")}
AUG = {ast.Add: (rb"\+=", "-=", "AugAdd->AugSub"), ast.Sub: (rb"-=", "+=", "AugSub->AugAdd")}
BOOL = {ast.And: (rb"\band\b", "or", "and->or"), ast.Or: (rb"\bor\b", "and", "or->and")}


@dataclass(frozen=True)
class Mutant:
    id: str
    module: str
    path: str
    line: int
    operator: str
    original: str      # the source line before ...
    mutated: str       # ... and after the change
    source: bytes      # the whole mutated file


def skipped_nodes(tree: ast.Module) -> set[int]:
    """ids of the nodes never mutated: annotations, f-strings, raise statements, `__repr__` bodies and the bodies
    of `if TYPE_CHECKING:` blocks (none of them change what the code computes)."""
    roots: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            roots += [node.returns] if node.name != "__repr__" else [node]
        elif isinstance(node, (ast.arg, ast.AnnAssign)):
            roots.append(node.annotation)
        elif isinstance(node, (ast.JoinedStr, ast.Raise)):
            roots.append(node)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            roots += node.body
    return {id(n) for root in roots if root is not None for n in ast.walk(root)}


def mutants_of(module: str, path: str) -> list[Mutant]:
    """Every mutant of one module's source, in source order."""
    src = (ROOT / path).read_bytes()
    lines = src.splitlines(keepends=True)
    starts = [0, *itertools.accumulate(map(len, lines))]    # byte offset of each line
    start = lambda node: starts[node.lineno - 1] + node.col_offset      # noqa: E731  (col_offset counts bytes)
    end = lambda node: starts[node.end_lineno - 1] + node.end_col_offset      # noqa: E731
    edits: list[tuple[int, int, str, str]] = []     # (start, end, new text, operator)

    def in_gap(a: int, b: int, swap: tuple[bytes, str, str]) -> None:
        # The operator token between two operands (parentheses and whitespace around it); gaps with a comment
        # or more than one match are left alone rather than guessed at.
        found = list(re.finditer(swap[0], src[a:b]))
        if b"#" not in src[a:b] and len(found) == 1:
            edits.append((a + found[0].start(), a + found[0].end(), *swap[1:]))

    tree = ast.parse(src)
    skip = skipped_nodes(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Compare):
            for left, op, right in zip([node.left, *node.comparators], node.ops, node.comparators):
                in_gap(end(left), start(right), CMP[type(op)])
        elif isinstance(node, ast.BinOp) and type(node.op) in ARITH and not any(    # not string concatenation
                isinstance(x, ast.JoinedStr) or isinstance(x, ast.Constant) and isinstance(x.value, str)
                for x in (node.left, node.right)):
            in_gap(end(node.left), start(node.right), ARITH[type(node.op)])
        elif isinstance(node, ast.AugAssign) and type(node.op) in AUG:
            in_gap(end(node.target), start(node.value), AUG[type(node.op)])
        elif isinstance(node, ast.BoolOp):
            for left, right in zip(node.values, node.values[1:]):
                in_gap(end(left), start(right), BOOL[type(node.op)])
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            in_gap(start(node), start(node.operand), (rb"^not[ \t]*", "", "not x->x"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
            edits.append((start(node), end(node), str(not node.value), f"{node.value}->{not node.value}"))
        elif isinstance(node, ast.Constant) and type(node.value) is int and node.value < 100:
            new_value = {0: 1, 1: 0}.get(node.value, node.value + 1)
            edits.append((start(node), end(node), str(new_value), f"int:{node.value}->{new_value}"))
    out = []
    for a, b, new, op in sorted(edits):      # every edit lies within one line
        i = bisect.bisect_right(starts, a) - 1
        col = a - starts[i]
        old_line = lines[i].decode().rstrip("\r\n")
        new_line = (lines[i][:col] + new.encode() + lines[i][col + b - a:]).decode().rstrip("\r\n")
        out.append(Mutant(f"{module}:{i + 1}:{col}:{op}", module, path, i + 1, op, old_line, new_line,
                          src[:a] + new.encode() + src[b:]))
    return out


def select(module: str, max_per_module: int, seed: int) -> list[Mutant]:
    """The module's mutants, or a sample of max_per_module of them fixed by (module, seed), in source order."""
    every = mutants_of(module, MODULES[module][0])
    if 0 < max_per_module < len(every):
        every = [every[i] for i in sorted(random.Random(f"{module}:{seed}").sample(range(len(every)), max_per_module))]
    return every


def put(file: Path, data: bytes) -> None:
    """Write data to file and drop its cached bytecode, which Python would keep using if the size and the
    modification second came out the same as before."""
    file.write_bytes(data)
    for pyc in file.parent.glob(f"__pycache__/{file.stem}.*.pyc"):
        pyc.unlink()


def run_tests(tree: Path, targets: tuple[str, ...], timeout: float | None) -> tuple[str, float]:
    """('killed' | 'survived' | 'timeout', seconds) for one pytest run of targets in tree."""
    env = dict(os.environ, HISPARSE_TEST_SEED="1", PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not slow", *targets]
    t0 = time.perf_counter()
    # Its own session, so that a timeout ends the processes the tests started too.
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out = proc.communicate(timeout=timeout)[0].decode(errors="replace")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return "timeout", time.perf_counter() - t0
    if proc.returncode in (4, 5):       # usage error, no tests collected: the setup is wrong, not the mutant caught
        raise SystemExit(f"pytest exited {proc.returncode} on {' '.join(targets)}:\n{out[-3000:]}")
    return ("killed" if proc.returncode else "survived"), time.perf_counter() - t0


def coverage_map(out: Path, tests: str,
                 paths: set[str]) -> tuple[dict[str, dict[int, list[str]]], dict[str, float]]:
    """(path -> line -> the tests (pytest node ids, parameters folded) that run it, test -> its seconds), from one
    coverage run of the quick suite with a context per test function (cached in <out>/coverage-map.json; needs
    `pip install coverage`). Lines that only spawned processes run (DCP ranks) have no test here. The cache serves
    while the mutated files (`paths`) are as it traced them (its line numbers would name other code after a change)
    and the run ran the same tests; a test edited since still covers what it covered, and one removed or renamed
    since leaves the map."""
    cache = out / "coverage-map.json"
    if cache.exists() and (cached := json.loads(cache.read_text())).get("tests") == tests \
            and all(cached["digests"].get(p) == file_digest(p) for p in paths):
        return ({f: {int(k): [t for t in v if test_exists(t)] for k, v in lines.items()}
                 for f, lines in cached["lines"].items()}, cached["seconds"])
    with tempfile.TemporaryDirectory() as tmp:
        rc = Path(tmp) / "coveragerc"
        rc.write_text(f"[run]\nsource = hisparse\ndynamic_context = test_function\ndata_file = {tmp}/.coverage\n")
        env = dict(os.environ, HISPARSE_TEST_SEED="1", OMP_NUM_THREADS="1")
        deselect = [arg for test in WALL_CLOCK for arg in ("--deselect", test)]
        run = subprocess.run([sys.executable, "-m", "coverage", "run", f"--rcfile={rc}", "-m", "pytest", "-q", "-p",
                              "no:cacheprovider", "-m", "not slow", f"--junitxml={tmp}/junit.xml", *deselect,
                              *tests.split(",")], cwd=ROOT, env=env)
        if run.returncode:     # a failing suite would make every mutant look killed
            raise SystemExit(f"the tests fail without a mutant (pytest exited {run.returncode}); fix them first")
        subprocess.run([sys.executable, "-m", "coverage", "json", f"--rcfile={rc}", "--show-contexts", "-o",
                        f"{tmp}/cov.json"], cwd=ROOT, env=env, check=True)
        shutil.copy(Path(tmp) / "cov.json", out / "coverage.json")    # (kept: the run takes a while)
        seconds = timed_tests(Path(tmp) / "junit.xml")
    files = json.loads((out / "coverage.json").read_text())["files"]
    by_line = {path: {int(line): sorted(filter(None, map(node_id, ctxs))) for line, ctxs in f["contexts"].items()}
               for path, f in files.items()}
    sources = (str(p.relative_to(ROOT)) for p in (ROOT / "hisparse").rglob("*.py"))
    digests = {path: file_digest(path) for path in sources}
    cache.write_text(json.dumps({"tests": tests, "digests": digests, "lines": by_line, "seconds": seconds}))
    return by_line, seconds


def file_digest(path: str) -> str:
    """The sha256 of a file of the tree as it is now ('' when it is gone)."""
    file = ROOT / path
    return hashlib.sha256(file.read_bytes()).hexdigest() if file.exists() else ""


def test_exists(node: str) -> bool:
    """Whether a pytest node id of the map (`tests/x.py::[Class::]test_y`) still names a function of its file."""
    file, *names = node.split("::")
    return names[-1] in functions_of(file)


@functools.cache
def functions_of(file: str) -> frozenset[str]:
    """The names of the functions a test file defines (read once per run); empty when it is gone."""
    path = ROOT / file
    if not path.exists():
        return frozenset()
    return frozenset(re.findall(r"^\s*(?:async )?def (\w+)\(", path.read_text(), re.M))


def timed_tests(junit: Path) -> dict[str, float]:
    """Each test function's seconds (its parameters summed) from a pytest junit report; the times are traced ones,
    so they order tests and bound runs rather than predict them."""
    seconds: dict[str, float] = {}
    for case in ElementTree.parse(junit).iter("testcase"):
        test = node_id(f"{case.get('classname')}.{case.get('name', '').split('[')[0]}")
        if test is not None:
            seconds[test] = seconds.get(test, 0.0) + float(case.get("time", 0.0))
    return seconds


def node_id(context: str) -> str | None:
    """A coverage test-function context (`test_engine.test_x`, `test_tp.TestY.test_z`) as a pytest node id; None
    for a context outside the test modules (code run at import, or in a helper module's function)."""
    parts = context.split(".")
    i = next((i for i, p in enumerate(parts) if p.startswith("test_") and (ROOT / "tests" / f"{p}.py").exists()),
             None)
    return None if i is None else "::".join([f"tests/{parts[i]}.py", *parts[i + 1:]])


def targets_of(m: Mutant, covered: dict[str, dict[int, list[str]]] | None,
               seconds: dict[str, float]) -> tuple[str, ...]:
    """The tests a mutant runs against, quickest first (with `-x` a killed mutant stops at its first failing test):
    those that cover its line, else (no coverage map, or a line only spawned processes run) its module's table
    entry."""
    tests = (covered or {}).get(m.path, {}).get(m.line)
    return tuple(sorted(tests, key=lambda t: seconds.get(t, 0.0))) if tests else MODULES[m.module][1]


def run_mutant(tree: Path, m: Mutant, timeout: float, covered: dict[str, dict[int, list[str]]] | None,
               seconds: dict[str, float], tests: tuple[str, ...] = ()) -> dict:
    """The result record of one mutant: its source put into tree, its tests run, the original put back. When its
    tests come from the coverage map the time limit is 3x their traced seconds plus a minute (pytest's start-up), at
    most timeout (a hang, not a slow machine); a table entry's run (no traced test) gets timeout itself. Explicit
    `tests` replace the covering ones (a retest of a survivor)."""
    traced = bool((covered or {}).get(m.path, {}).get(m.line))     # its tests come from the coverage map
    targets = tests or targets_of(m, covered, seconds)
    if traced and not tests:
        timeout = min(timeout, 60.0 + 3 * sum(seconds.get(t, 0.0) for t in targets))
    try:
        compile(m.source, m.path, "exec")
    except SyntaxError:
        status, took = "invalid", 0.0
    else:
        file = tree / m.path
        original = file.read_bytes()
        put(file, m.source)
        try:
            status, took = run_tests(tree, targets, timeout)
        finally:
            put(file, original)
    return {"id": m.id, "module": m.module, "path": m.path, "line": m.line, "operator": m.operator,
            "original": m.original, "mutated": m.mutated, "status": status, "seconds": round(took, 1),
            "tests": list(tests) if tests else len(targets) if traced else "table"}


def load_done(path: Path, mutants: list[Mutant]) -> dict[str, dict]:
    """The recorded results of these mutants whose source line has not changed since (the last record wins)."""
    current = {m.id: m.original for m in mutants}
    done = {}
    if path.exists():
        for rec in map(json.loads, path.read_text().splitlines()):
            if current.get(rec["id"]) == rec["original"]:
                done[rec["id"]] = rec
    return done


def retest(selected: dict[str, list[Mutant]], done: dict[str, dict], tests: tuple[str, ...], timeout: float,
           log: Path, ids: set[str]) -> None:
    """Run the recorded survivors of `selected` (less the listed equivalents; only `ids` if given) against `tests`
    in a copy of HEAD, recording each result (with the tests) as the mutant's latest."""
    equivalent = json.loads(EQUIVALENT.read_text())
    todo = [m for ms in selected.values() for m in ms
            if done.get(m.id, {}).get("status") == "survived" and m.id not in equivalent
            and (not ids or m.id in ids)]
    with tempfile.TemporaryDirectory() as tmp:
        tree_copy(Path(tmp))
        for m in tqdm(todo, desc="survivors"):
            rec = run_mutant(Path(tmp), m, timeout, None, {}, tests)
            done[m.id] = rec
            with log.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            tqdm.write(f"{m.id}: {rec['status']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modules", default=",".join(MODULES))
    ap.add_argument("--max-per-module", type=int, default=40, help="mutants sampled per module; 0: all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/test_strength")
    ap.add_argument("--list", action="store_true", help="only count the mutants per module")
    ap.add_argument("--report-only", action="store_true", help="only rewrite mutation.json from mutants.jsonl")
    ap.add_argument("--select", choices=("coverage", "table"), default="coverage",
                    help="the tests a mutant runs: those covering its line (one coverage run of the quick suite "
                         "first, cached; lines only spawned processes run fall back to the table), or its module's "
                         "table entry")
    ap.add_argument("--coverage-tests", default="tests", help="what the coverage run runs (comma-separated)")
    ap.add_argument("--jobs", type=int, default=1, help="mutants tested at once, each in its own copy of the tree")
    ap.add_argument("--retest", help="comma-separated tests: run the recorded survivors of the chosen modules that "
                    "equivalent.json does not list against them (in a copy of HEAD: tests written since the run)")
    ap.add_argument("--ids", help="comma-separated mutant ids: --retest only these")
    ap.add_argument("--timeout", type=float, default=3600.0,
                    help="the most seconds a mutant's tests may run (their limit: 60 + 3x the covering tests' traced "
                         "seconds; a table run: 3x its module's baseline); a retest's limit")
    ap.add_argument("--retry-timeouts", action="store_true",
                    help="run the recorded timeouts again (a limit too tight for a loaded machine reads as a kill)")
    args = ap.parse_args()
    names = args.modules.split(",")
    if unknown := set(names) - set(MODULES):
        raise SystemExit(f"unknown modules: {sorted(unknown)}; known: {', '.join(MODULES)}")
    if args.list:
        for name in names:
            print(f"{name}: {len(mutants_of(name, MODULES[name][0]))} candidates ({MODULES[name][0]})")
        return
    selected = {name: select(name, args.max_per_module, args.seed) for name in names}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "mutants.jsonl"
    done = load_done(log, [m for ms in selected.values() for m in ms])
    if args.retry_timeouts:
        done = {k: r for k, r in done.items() if r["status"] != "timeout"}
    command = " ".join(["python -m benchmarks.test_strength.mutate",
                        *(a for a in sys.argv[1:] if a != "--report-only")])
    unmutated: dict[str, dict] = {}     # module -> its tests' run without a mutant: passed, seconds
    if args.retest:
        retest(selected, done, tuple(args.retest.split(",")), args.timeout, log,
               set(args.ids.split(",")) if args.ids else set())
    elif not args.report_only:
        covered, seconds = (coverage_map(out, args.coverage_tests, {MODULES[n][0] for n in names})
                            if args.select == "coverage" else (None, {}))
        with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
            trees = [Path(tmp) / str(i) for i in range(args.jobs)]     # one copy of HEAD per concurrent mutant
            for tree in trees:
                tree_copy(tree)
            free = queue.SimpleQueue()
            for tree in trees:
                free.put(tree)
            limits = {}     # module -> its mutants' time limit
            for name, mutants in selected.items():
                if not any(m.id not in done for m in mutants):
                    continue
                # (with a coverage map the suite passed unmutated in the coverage run)
                status, baseline = run_tests(trees[0], MODULES[name][1], None) if covered is None else ("survived", 0)
                unmutated[name] = {"passed": status == "survived", "seconds": round(baseline, 1)}
                if status == "survived":
                    limits[name] = args.timeout if covered is not None else max(60.0, 3 * baseline)
                else:
                    print(f"{name}: its tests fail without a mutant; skipped", flush=True)

            def one(m: Mutant) -> dict:
                tree = free.get()
                try:
                    return run_mutant(tree, m, limits[m.module], covered, seconds)
                finally:
                    free.put(tree)

            todo = [m for ms in selected.values() for m in ms if m.id not in done and m.module in limits]
            with tqdm(total=len(todo), desc="mutants") as bar:
                for rec in pool.map(one, todo):
                    done[rec["id"]] = rec
                    with log.open("a") as f:
                        f.write(json.dumps(rec) + "\n")
                    statuses = [r["status"] for r in done.values()]
                    bar.set_postfix(module=rec["module"], killed=statuses.count("killed") + statuses.count("timeout"),
                                    survived=statuses.count("survived"), refresh=False)
                    bar.update()
    report(out, selected, done, unmutated, command)


if __name__ == "__main__":
    main()
