"""Run the needle grid (length x depth x seed) against one OpenAI-compatible endpoint, or two side by side.

Every request is greedy (temperature 0) with the same prompt on both endpoints, so with a second endpoint each
record also says whether the two completions are identical (HiSparse on vs off, hisparse vs vLLM). Retrieval is
an exact match of the needle's value as a whole number in the completion.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import openai
from tqdm import tqdm

from .prompt import NeedlePrompt, PromptBuilder
from .watch import PrefillWatch

UNITS = {"k": 1 << 10, "m": 1 << 20}


def parse_lengths(text: str) -> list[tuple[str, int | None]]:
    """'8k,32k,128k,max' -> [(label, tokens)], k = 1024, m = 1024**2; 'max' (None) = the server's limit."""
    out = []
    for item in (t.strip().lower() for t in text.split(",") if t.strip()):
        if item == "max":
            out.append((item, None))
            continue
        m = re.fullmatch(r"(\d+(?:\.\d+)?)([km]?)", item)
        if m is None:
            raise SystemExit(f"--lengths: {item!r} is not a token count like 4096, 8k, 1m or max")
        n = int(float(m.group(1)) * UNITS.get(m.group(2), 1))
        if n < 1:
            raise SystemExit(f"--lengths: {item!r} must be at least 1 token")
        out.append((item, n))
    if not out:
        raise SystemExit("--lengths: empty")
    return out


def parse_depths(text: str) -> list[float]:
    """'0,25,50,75,100' (percent) -> fractions."""
    try:
        depths = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise SystemExit(f"--depths: expected comma-separated percentages, got {text!r}") from None
    if not depths or any(not 0 <= d <= 100 for d in depths):
        raise SystemExit(f"--depths: every depth must be a percentage in [0, 100], got {text!r}")
    return [d / 100 for d in depths]


def needle_value(seed: int, target: int, depth: float) -> str:
    """The passkey of one cell and seed: a 7-digit number (a chance match in random text is negligible)."""
    return str(random.Random(f"{seed}:{target}:{depth}").randint(10**6, 10**7 - 1))


def retrieved(value: str, text: str) -> bool:
    """Whether the completion contains the needle's value as a whole number (not inside a longer one)."""
    return re.search(rf"(?<!\d){re.escape(value)}(?!\d)", text) is not None


@dataclass
class Endpoint:
    name: str               # "base" | "compare"
    url: str
    model: str
    max_model_len: int | None
    client: openai.OpenAI

    @classmethod
    def connect(cls, name: str, url: str, model: str | None, api_key: str, timeout: float) -> "Endpoint":
        """Open a client; the model defaults to the first one /v1/models lists (with its max_model_len when the
        server reports one, as vLLM and hisparse do)."""
        client = openai.OpenAI(base_url=url, api_key=api_key, timeout=timeout, max_retries=0)
        models = client.models.list().data
        card = next((m for m in models if model is None or m.id == model), None)
        if card is None:
            raise SystemExit(f"--model: {model!r} is not served at {url} (it serves {[m.id for m in models]})")
        limit = (card.model_extra or {}).get("max_model_len")
        return cls(name, url, card.id, int(limit) if limit else None, client)


@dataclass
class Answer:
    text: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    latency_s: float = 0.0
    found: bool = False
    error: str | None = None


@dataclass
class Record:
    length: str
    target: int
    tokens: int             # prompt tokens as the harness counted them
    depth: float            # requested, fraction
    needle_depth: float     # actual, fraction of the filler's tokens before the needle
    seed: int
    value: str
    haystack_digest: str
    answers: dict[str, Answer] = field(default_factory=dict)

    @property
    def identical(self) -> bool | None:
        """Whether both endpoints answered, with the same text (None with one endpoint)."""
        if len(self.answers) < 2:
            return None
        a, b = self.answers.values()
        return a.error is None and b.error is None and a.text == b.text


def ask(ep: Endpoint, prompt: NeedlePrompt, max_tokens: int) -> Answer:
    """One greedy request; errors are recorded, not raised."""
    t0 = time.perf_counter()
    try:
        if prompt.api == "chat":
            r = ep.client.chat.completions.create(model=ep.model, max_tokens=max_tokens, temperature=0,
                                                  **prompt.request())
            text = r.choices[0].message.content or ""
        else:
            r = ep.client.completions.create(model=ep.model, max_tokens=max_tokens, temperature=0,
                                             **prompt.request())
            text = r.choices[0].text
    except openai.OpenAIError as e:
        return Answer(latency_s=time.perf_counter() - t0, error=f"{type(e).__name__}: {e}")
    usage = r.usage
    return Answer(text, usage.prompt_tokens if usage else None, usage.completion_tokens if usage else None,
                  r.choices[0].finish_reason, time.perf_counter() - t0, retrieved(prompt.value, text))


def resolve_lengths(lengths: list[tuple[str, int | None]], limit: int | None, max_tokens: int
                    ) -> list[tuple[str, int]]:
    """Prompt lengths to run: a length whose prompt + max_tokens exceeds the server's limit is clipped to it."""
    out = []
    for label, n in lengths:
        if limit is not None and (n is None or n + max_tokens > limit):
            n = limit - max_tokens
        if n is None:
            raise SystemExit("--lengths: 'max' needs a server that reports max_model_len in /v1/models")
        out.append((label, n))
    return out


Journal = dict[tuple[str, int, float, int], "Record"]


def read_journal(path: Path) -> Journal:
    """Finished records of an earlier run (one JSON line each, as run_grid appends them), keyed by cell + seed."""
    out: Journal = {}
    if path.exists():
        for line in path.read_text().splitlines():
            d = json.loads(line)
            d.pop("identical", None)
            d["answers"] = {k: Answer(**a) for k, a in d["answers"].items()}
            r = Record(**d)
            out[(r.length, r.target, r.depth, r.seed)] = r
    return out


def run_grid(builder_for: Callable[[int], PromptBuilder], endpoints: list[Endpoint],
             lengths: list[tuple[str, int]], depths: list[float], seeds: int, max_tokens: int, concurrency: int,
             journal: Path, resume: bool = False, watch_every_s: float = 0.0) -> tuple[list[Record], int]:
    """Build every prompt (seed s from builder_for(s): one shared haystack, or a fresh one per seed), then send
    each to every endpoint (`concurrency` requests in flight per endpoint).

    Seeds go in the outer loop, so a run stopped part way has every cell about equally sampled. Each finished
    record is appended to `journal` (JSON lines); with resume, records already there (same cell, seed, passkey
    and haystack, answered by every endpoint) are kept instead of asked again. With watch_every_s, a bar per
    endpoint shows its prefilled prompt tokens, read from its /metrics that often (`PrefillWatch`). Returns
    (records, resumed)."""
    done = read_journal(journal) if resume else {}
    cells = [(label, n, d, s) for s in range(seeds) for label, n in lengths for d in depths]
    records, prompts, resumed = [], [], 0
    for label, n, d, s in tqdm(cells, desc="building prompts", unit="prompt", leave=False):
        p = builder_for(s).build(n, d, needle_value(s, n, d))
        rec = Record(label, n, p.tokens, d, p.needle_depth, s, p.value, p.haystack_digest)
        old = done.get((label, n, d, s))
        if old is not None and (old.value, old.haystack_digest) == (rec.value, rec.haystack_digest) and \
                all(ep.name in old.answers for ep in endpoints):
            rec, p = old, None
            resumed += 1
        records.append(rec)
        prompts.append(p)
    journal.parent.mkdir(parents=True, exist_ok=True)
    journal.write_text("".join(json.dumps(record_json(r)) + "\n" for r, p in zip(records, prompts) if p is None))
    todo = [(r, p) for r, p in zip(records, prompts) if p is not None]
    pools = {ep.name: ThreadPoolExecutor(concurrency) for ep in endpoints}
    lock = threading.Lock()
    watch = (PrefillWatch({ep.name: (ep.url, [r.tokens for r, _ in todo]) for ep in endpoints}, watch_every_s,
                          per_request_eta=concurrency == 1) if watch_every_s > 0 and todo else None)

    def watched(ep: Endpoint, rec: Record, p: NeedlePrompt) -> Answer:
        if watch is None:
            return ask(ep, p, max_tokens)
        watch.begin(ep.name, rec.tokens)
        try:
            return ask(ep, p, max_tokens)
        finally:
            watch.end(ep.name)

    def finished(rec: Record, name: str, answer: Answer) -> None:
        with lock:
            rec.answers[name] = answer
            bar.update()
            if len(rec.answers) == len(endpoints):
                with journal.open("a") as f:
                    f.write(json.dumps(record_json(rec)) + "\n")

    with tqdm(total=len(todo) * len(endpoints), desc="needle", unit="req") as bar:
        futures = []
        for rec, p in todo:
            for ep in endpoints:
                fut = pools[ep.name].submit(watched, ep, rec, p)
                fut.add_done_callback(lambda f, rec=rec, name=ep.name: finished(rec, name, f.result()))
                futures.append(fut)
        for fut in futures:
            fut.result()
    for pool in pools.values():
        pool.shutdown()
    if watch is not None:
        watch.close()
    return records, resumed


def rate(hits: int, n: int) -> dict:
    return {"hits": hits, "n": n, "rate": hits / n if n else None}


def cell_table(records: list[Record], names: list[str]) -> list[dict]:
    """Per (length, depth): retrieval per endpoint and, with two, agreement, over the seeds."""
    cells: dict[tuple[str, float], list[Record]] = {}
    for r in records:
        cells.setdefault((r.length, r.depth), []).append(r)
    out = []
    for (label, depth), rs in cells.items():
        row = {"length": label, "target": rs[0].target, "depth": depth,
               "retrieval": {n: rate(sum(r.answers[n].found for r in rs), len(rs)) for n in names}}
        if len(names) == 2:
            row["agreement"] = rate(sum(bool(r.identical) for r in rs), len(rs))
        out.append(row)
    return out


def summarize(records: list[Record], names: list[str], wall_s: float) -> dict:
    n = len(records)
    out = {"records": n, "wall_s": round(wall_s, 2),
           "retrieval": {k: rate(sum(r.answers[k].found for r in records), n) for k in names},
           "errors": {k: sum(r.answers[k].error is not None for r in records) for k in names},
           "length_exact": {k: rate(sum(r.answers[k].prompt_tokens == r.target for r in records), n)
                            for k in names}}
    if len(names) == 2:
        out["agreement"] = rate(sum(bool(r.identical) for r in records), n)
    return out


def summary_line(summary: dict, names: list[str]) -> str:
    def pct(r: dict) -> str:
        return f"{r['hits']}/{r['n']} ({100 * r['rate']:.1f}%)" if r["n"] else "0/0"
    parts = [f"needle: {summary['records']} prompts in {summary['wall_s']:.1f} s"]
    parts += [f"retrieval {k} {pct(summary['retrieval'][k])}" for k in names]
    if "agreement" in summary:
        parts.append(f"{names[0]} == {names[1]} {pct(summary['agreement'])}")
    parts += [f"prompt tokens == target ({k}) {pct(summary['length_exact'][k])}" for k in names]
    errors = sum(summary["errors"].values())
    if errors:
        parts.append(f"{errors} errors")
    return " | ".join(parts)


def record_json(r: Record) -> dict:
    d = asdict(r)
    d["identical"] = r.identical
    return d
