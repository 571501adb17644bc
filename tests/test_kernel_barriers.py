"""Races between the warps of one Triton program, found statically.

Triton's interpreter runs every tensor operation whole and in order, so a kernel that loads entries of a buffer
and stores to the same buffer later in one barrier-free stretch passes every interpreter test and can still be
wrong on a GPU: the compiler may issue a load once per register layout, in different warps, and a warp that lags
reads what another warp already stored. (The miss-path kernel did exactly this with its plan's entries: on an
H200 the lagging warps skipped row copies.) This test reads every kernel's source and flags each buffer (a
pointer parameter, followed through assignments) that is both loaded and stored between two `tl.debug_barrier()`
calls. A loop body is laid out twice in a row, so a store late in one iteration and a load early in the next
count as one stretch unless a barrier separates them.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

triton = pytest.importorskip("triton")

from hisparse import triton_kernels  # noqa: E402


def _events(fn_src: str) -> list[tuple[str, frozenset[str]]]:
    """The kernel's loads, stores and barriers in program order: ('load' | 'store', buffers) or ('barrier', {})."""
    fn = ast.parse(textwrap.dedent(fn_src)).body[0]
    alias: dict[str, frozenset[str]] = {a.arg: frozenset({a.arg}) for a in fn.args.args if a.arg.endswith("_ptr")}

    def buffers(node: ast.AST) -> frozenset[str]:
        """The pointer parameters an expression's address is built from (what a load or a @triton.jit helper
        returns is data, not an address)."""
        if isinstance(node, ast.Name):
            return alias.get(node.id, frozenset())
        if isinstance(node, ast.Call) and (getattr(node.func, "attr", "") == "load" or
                                           getattr(node.func, "id", "").startswith("_")):
            return frozenset()
        return frozenset().union(*(buffers(c) for c in ast.iter_child_nodes(node)))

    def call_events(node: ast.AST) -> list[tuple[str, frozenset[str]]]:
        out = []
        for c in ast.walk(node):
            if not isinstance(c, ast.Call):
                continue
            name = c.func.attr if isinstance(c.func, ast.Attribute) else getattr(c.func, "id", "")
            if name == "load" and c.args:
                out.append(("load", buffers(c.args[0])))
            elif name == "store" and c.args:
                out.append(("store", buffers(c.args[0])))
            elif name == "debug_barrier":
                out.append(("barrier", frozenset()))
            elif name.startswith("_") and c.args:     # a @triton.jit helper: it loads through its pointer args
                out.append(("load", buffers(ast.Tuple(elts=c.args, ctx=ast.Load()))))
        return out

    def block(stmts: list[ast.stmt]) -> list[tuple[str, frozenset[str]]]:
        out: list[tuple[str, frozenset[str]]] = []
        for st in stmts:
            if isinstance(st, ast.For | ast.While):
                body = block(st.body)
                out += body + body                     # two iterations: a stretch may span the back edge
            elif isinstance(st, ast.If):
                out += call_events(st.test) + block(st.body) + block(st.orelse)
            else:
                out += call_events(st)
                if isinstance(st, ast.Assign | ast.AugAssign | ast.AnnAssign):
                    targets = st.targets if isinstance(st, ast.Assign) else [st.target]
                    src = buffers(st.value) | (buffers(st.target) if isinstance(st, ast.AugAssign) else frozenset())
                    for t in targets:
                        for n in ast.walk(t):
                            if isinstance(n, ast.Name):
                                alias[n.id] = src
        return out

    return block(fn.body)


def races(fn_src: str) -> set[str]:
    """Buffers loaded and stored between two barriers (in either order) somewhere in the kernel."""
    found: set[str] = set()
    loads: set[str] = set()
    stores: set[str] = set()
    for kind, bufs in _events(fn_src):
        if kind == "barrier":
            loads, stores = set(), set()
            continue
        (loads if kind == "load" else stores).update(bufs)
        found |= loads & stores
    return found


def _kernels() -> dict[str, object]:
    return {name: fn for name, fn in triton_kernels.kernels().items()}


@pytest.mark.parametrize("name", sorted(_kernels()))
def test_no_buffer_is_loaded_and_stored_between_barriers(name: str) -> None:
    fn = _kernels()[name]
    src = inspect.getsource(getattr(fn, "fn", fn))
    assert not races(src), f"{name}: {sorted(races(src))} loaded and stored without a barrier between"


RACY = '''
def k(kind_ptr, out_ptr, n):
    for t0 in range(0, n, 4):
        e = t0 + tl.arange(0, 4)
        kind = tl.load(kind_ptr + e)
        tl.store(kind_ptr + e, kind + 1)
        tl.store(out_ptr + e, kind)
'''


def test_the_check_finds_a_load_then_store_without_a_barrier() -> None:
    assert races(RACY) == {"kind_ptr"}
    fixed = RACY.replace("        tl.store(kind_ptr", "        tl.debug_barrier()\n        tl.store(kind_ptr")
    assert races(fixed) == {"kind_ptr"}       # still racy across iterations: next block's load after this store
    fixed = fixed.replace("        tl.store(out_ptr + e, kind)", "        tl.store(out_ptr + e, kind)\n"
                          "        tl.debug_barrier()")
    assert races(fixed) == set()
