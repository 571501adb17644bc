"""The package layering of hisparse/, read from the source with ast (nothing is imported).

Data flows one way: server -> engine -> model -> kv store -> working set -> host pool, over the shared types in
core/; parallel/ plugs into the engine and the model from outside them; entry points (cli, server, connector,
train, the AOT tool) sit on top. An import may only point to a lower layer (or stay in its own part), modules
import no cycle, no file imports another part's underscore name, and no function is over 80 lines (Triton
kernels excepted: splitting one must not move a barrier).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "hisparse"
LAYERS = [                      # top to bottom; parts in one layer do not import each other
    {"cli"},
    {"server", "connector", "train", "triton_kernels"},
    {"parallel"},
    {"engine"},
    {"model"},
    {"kv"},
    {"gpu_working_set"},
    {"host_pool"},
    {"core"},
]
MAX_FUNCTION_LINES = 80


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = ("hisparse",) + path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part(module: str) -> str | None:
    """The top-level part of hisparse a module belongs to ('kv', 'cli', ...; None for the package itself)."""
    return module.split(".")[1] if "." in module else None


def type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (annotations only: no import at run time)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def imports(path: Path, root: Path | None = ROOT) -> list[tuple[str, list[str], int, bool]]:
    """(module imported, names, line, under TYPE_CHECKING) for every hisparse import of a file; relative imports
    are resolved for files of the package under `root` (None: a file outside it, tests and benchmarks)."""
    tree = ast.parse(path.read_text())
    checking = type_checking_nodes(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno, id(node) in checking) for a in node.names
                    if a.name.startswith("hisparse.")]
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level and root is not None:
                base = module_name(path, root).split(".")
                base = base if path.name == "__init__.py" else base[:-1]
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            if target == "hisparse" or target.startswith("hisparse."):
                out.append((target, [a.name for a in node.names], node.lineno, id(node) in checking))
    return out


RANK = {p: i for i, layer in enumerate(LAYERS) for p in layer}


def back_arrows(root: Path) -> list[str]:
    """Every import of the package under `root` that does not point to a lower layer."""
    bad = []
    for f in sorted(root.rglob("*.py")):
        src = part(module_name(f, root))
        for target, names, line, _ in imports(f, root):
            for t in [target] if target != "hisparse" else [f"hisparse.{n}" for n in names]:
                dst = part(t)
                if src is not None and dst != src and RANK[dst] <= RANK[src]:
                    bad.append(f"{f.relative_to(root.parent)}:{line}: {src} -> {dst} ({t})")
    return bad


def long_functions(root: Path) -> list[str]:
    """Functions over MAX_FUNCTION_LINES lines, Triton kernels (jit-decorated or with constexpr parameters)
    excepted."""
    long = []
    for f in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                kernel = any("jit" in ast.unparse(d) for d in node.decorator_list) or any(
                    a.annotation is not None and "constexpr" in ast.unparse(a.annotation) for a in node.args.args)
                if lines > MAX_FUNCTION_LINES and not kernel:
                    long.append(f"{f.relative_to(root.parent)}:{node.lineno} {node.name}: {lines} lines")
    return long


FILES = sorted(ROOT.rglob("*.py"))


def test_every_part_has_a_layer():
    parts = {part(module_name(f)) for f in FILES} - {None}
    assert parts <= set(RANK), f"parts without a layer: {sorted(parts - set(RANK))}"


def test_imports_point_down_the_layers():
    bad = back_arrows(ROOT)
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_no_import_cycle_between_modules():
    modules = {module_name(f): f for f in FILES}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for m, f in modules.items():
        for target, names, _, checking in imports(f):
            if checking:
                continue
            for t in [f"{target}.{n}" for n in names] + [target]:
                if t in modules and t != m:
                    graph[m].add(t)
                    break
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:   # depth-first; a grey node reached again closes a cycle
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_no_underscore_import_from_another_part():
    outside = sorted((ROOT.parent / "tests").glob("*.py")) + sorted((ROOT.parent / "benchmarks").rglob("*.py"))
    bad = []
    for f in FILES + outside:
        inside = f.is_relative_to(ROOT)
        own = part(module_name(f)) if inside else None
        for target, names, line, _ in imports(f, ROOT if inside else None):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and (own is None or part(target) != own):
                bad.append(f"{f.relative_to(ROOT.parent)}:{line}: {target} {private}")
    assert not bad, "underscore names imported across parts:\n" + "\n".join(bad)


def test_functions_are_short():
    long = long_functions(ROOT)
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_the_checks_fail(tmp_path):
    """The checks themselves: back arrows (relative, absolute, from the package) and a long function are
    reported, a downward import and a long Triton kernel are not."""
    root = tmp_path / "hisparse"
    (root / "kv").mkdir(parents=True)
    (root / "kv" / "bad.py").write_text("from ..engine.engine import Engine\nfrom hisparse.server import app\n"
                                        "from hisparse import model\nfrom ..host_pool.pool import HostPool\n")
    body = "    x = 1\n" * MAX_FUNCTION_LINES
    (root / "kv" / "long.py").write_text(f"def f():\n{body}\n\ndef k(n: tl.constexpr):\n{body}")
    assert [b.split(": ")[1] for b in back_arrows(root)] == ["kv -> engine (hisparse.engine.engine)",
                                                             "kv -> server (hisparse.server)",
                                                             "kv -> model (hisparse.model)"]
    assert [b.split(" ")[1] for b in long_functions(root)] == ["f:"]


def layout_rows(text: str) -> dict[str, str]:
    """README layout table: `hisparse/<part>/` or `hisparse/<part>.py` -> the row's text."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\| `hisparse/([a-z_]+)(/|\.py)` \|(.*)", line)
        if m:
            rows[m.group(1)] = m.group(3)
    return rows


def test_readme_layout_matches_the_tree():
    rows = layout_rows((ROOT.parent / "README.md").read_text())
    parts = {part(module_name(f)) for f in FILES} - {None}
    assert set(rows) == parts, f"README layout rows {sorted(rows)} vs parts {sorted(parts)}"
    missing = [f"{p}: {name}" for p, text in rows.items() for name in re.findall(r"`([a-z_]+\.py)`", text)
               if (ROOT / p).is_dir() and not list((ROOT / p).rglob(name))]
    assert not missing, f"README layout names files that do not exist: {missing}"


def test_design_layering_table_matches_the_layers():
    text = (ROOT.parent / "docs" / "design.md").read_text()
    table = text[text.index("## Layout and layering"):].split("\n\n")[2]
    named = set(re.findall(r"`([a-z_]+)(?:/|\.py)`", table))
    assert set(RANK) <= named, f"design.md's layering table misses {sorted(set(RANK) - named)}"


def test_no_private_override_of_an_engine_class_outside_the_engine():
    """The engine is extended through EngineHooks: no class outside engine/ that subclasses an engine class
    defines an underscore method."""
    bad = []
    for f in FILES:
        if part(module_name(f)) == "engine":
            continue
        engine_names = {n for t, names, _, _ in imports(f) if t.startswith("hisparse.engine") for n in names}
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ClassDef) and {ast.unparse(b) for b in node.bases} & engine_names:
                bad += [f"{f.relative_to(ROOT.parent)}:{m.lineno} {node.name}.{m.name}" for m in node.body
                        if isinstance(m, ast.FunctionDef) and m.name.startswith("_") and not m.name.startswith("__")]
    assert not bad, "underscore methods overridden outside engine/:\n" + "\n".join(bad)
