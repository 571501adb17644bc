"""The mutation run's report: the score per module (mutation.json) and its tables (mutation.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .mutate import Mutant

EQUIVALENT = Path(__file__).with_name("equivalent.json")


def report(out: Path, selected: dict[str, list[Mutant]], done: dict[str, dict], unmutated: dict[str, dict],
           command: str) -> None:
    """Write mutation.json (with this run's unmutated test runs, where it made them) and print one line per
    module."""
    equivalent = json.loads(EQUIVALENT.read_text())
    modules, survivors = {}, []
    for module, mutants in selected.items():
        ran = [done[m.id] for m in mutants if m.id in done]
        recs = [r for r in ran if r["status"] != "invalid"]
        count = {s: sum(r["status"] == s for r in recs) for s in ("killed", "timeout", "survived")}
        count["equivalent"] = sum(r["status"] == "survived" and r["id"] in equivalent for r in recs)
        live = len(recs) - count["equivalent"]
        modules[module] = {"total": len(recs), **count, "invalid": len(ran) - len(recs),
                           "not_run": len(mutants) - len(ran), "unmutated": unmutated.get(module),
                           "score": round((count["killed"] + count["timeout"]) / live, 3) if live else None}
        survivors += [{k: r[k] for k in ("id", "path", "line", "operator", "original", "mutated")}
                      for r in recs if r["status"] == "survived" and r["id"] not in equivalent]
        print(f"{module}: {modules[module]}", flush=True)
    (out / "mutation.json").write_text(json.dumps(
        {"command": command, "modules": modules, "survivors": survivors}, indent=2) + "\n")
    retested = sorted((r for ms in selected.values() for m in ms if isinstance((r := done.get(m.id, {})).get("tests"),
                       list) and r["status"] == "killed"), key=lambda r: r["id"])
    (out / "mutation.md").write_text(markdown(modules, retested, survivors))


def markdown(modules: dict[str, dict], retested: list[dict], survivors: list[dict]) -> str:
    """The report's tables: the score per module, the survivors killed by tests written for them, the open ones."""
    def name(test: str) -> str:
        return f"`{test.split('::')[-1]}`"

    rows = ["| module | sampled | run | killed (timeouts among them) | survived | equivalent | score |",
            "|---|---|---|---|---|---|---|"]
    for module, m in modules.items():
        score = "" if m["score"] is None else f"**{m['score']:.3f}**"
        rows.append(f"| {module} | {m['total'] + m['invalid'] + m['not_run']} | {m['total']} | "
                    f"{m['killed'] + m['timeout']} ({m['timeout']}) | {m['survived'] - m['equivalent']} | "
                    f"{m['equivalent']} | {score} |")
    rows += ["", "Survivors of a first pass, killed by tests written for them:", "", "| mutant | killed by |",
             "|---|---|", *(f"| `{r['id']}` | {', '.join(map(name, r['tests']))} |" for r in retested),
             "", "Survivors not yet killed or explained:", ""]
    rows += [f"- `{s['id']}`: `{s['original'].strip()}` -> `{s['mutated'].strip()}`" for s in survivors] or ["(none)"]
    return "\n".join(rows) + "\n"
