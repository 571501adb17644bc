"""The engine: one thread owns the model and the KV store and runs scheduler steps; other threads submit.

`add_request` / `abort` are thread-safe (they go through an inbox queue); outputs are pushed to each request's
`sink` from the engine thread. `generate` runs requests to completion synchronously (tests, benchmarks). With a
`SpeculativeConfig`, every decoding request drafts and verifies up to N tokens per step (spec_decode.py); a step
may then emit several tokens per request, cut exactly where plain decoding would stop.

An EngineFatal (a peer rank of a parallel group died or hung) is fatal: every request in flight or queued fails
with its message, later submissions are refused (503), the loop ends and `on_fatal` is told. `hooks` (hooks.py)
is how rank 0 of a parallel group takes part in every step, release, idle wait, failure and stop.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from ..model.dspark import DSparkDrafter
from ..kv.base import KVStats, LatentKV
from ..model.ml4 import ML4
from .detokenizer import TextStream
from .request import Request, RequestError, RequestOutput, SamplingParams, TokenLogprobs
from .cuda_graphs import DecodeGraphs
from .full_graph import FullGraphs
from .hooks import EngineFatal, EngineHooks
from .runner import ModelRunner, SegmentOutput
from .sampling import SamplingBatch, sample, token_logprobs
from .scheduler import Scheduler, SchedulerConfig
from .spec_decode import Speculator
from .speculative import Proposer, SpeculativeConfig

log = logging.getLogger("hisparse.engine")


@dataclass
class StepStats:
    """What one step did, for metrics (passed to `Engine.on_step` from the engine thread)."""
    num_running: int
    num_waiting: int
    prompt_tokens: int = 0
    generation_tokens: int = 0
    ttft: list[float] = field(default_factory=list)            # seconds, requests that got their first token
    tpot: list[float] = field(default_factory=list)            # seconds per output token after the first (the
                                                               # tokens of one step share its gap evenly)
    spec_draft_tokens: int = 0                                 # draft tokens verified this step
    spec_accepted: list[int] = field(default_factory=list)     # per verify segment: drafts accepted
    finished: list[str] = field(default_factory=list)          # finish reasons
    kv_stats: KVStats = field(default_factory=KVStats)
    kv_usage: float = 0.0                 # LatentKV.usage_ratio()
    kv_reserved_tokens: int = 0           # tokens reserved by admitted requests (0 when all are done)
    num_preemptions: int = 0              # running requests preempted so far (their KV freed, to recompute)
    kv_index_cache_bytes: int = 0         # indexer keys running requests hold on the device (0 when all are done)
    kv_cached_pages: int = 0              # pages the prefix cache holds
    kv_ranks: list[Any] = field(default_factory=list)   # each rank's host pool report ([] in one process)
    graph_steps: int = 0                  # forwards of this step that replayed the decode graphs
    kv_resident_rows: int = 0             # latent rows in resident device pages (hybrid offload)
    residency: list[float] = field(default_factory=list)   # finished requests' resident fraction of pages


class Engine:
    """`speculative`: DSpark speculative decoding (None: off); `proposer` overrides the checkpoint's drafter
    (tests and benchmarks: an oracle); `graphs`: piecewise CUDA graphs for decode steps (None: eager); `hooks`:
    the engine's extension points (hooks.py; None: a single process)."""

    def __init__(self, model: ML4, kv: LatentKV, cfg: SchedulerConfig, eos_id: int | None = None,
                 decode: Callable[[list[int]], str] | None = None, speculative: SpeculativeConfig | None = None,
                 proposer: Proposer | None = None, graphs: DecodeGraphs | FullGraphs | None = None,
                 hooks: EngineHooks | None = None):
        self.model, self.kv = model, kv
        self.graphs = graphs
        self.hooks = hooks or EngineHooks()
        self.speculator: Speculator | None = None
        if speculative is not None:
            window = model.cfg.mtp.sliding_window if model.cfg.mtp is not None else None
            self.speculator = Speculator(speculative, proposer or DSparkDrafter(model), kv, window, self.hooks)
        self.runner = ModelRunner(model, kv, self.speculator.tap_layers if self.speculator else (), graphs,
                                  self.hooks)
        # a prefix-cache hit still computes the drafter's window of rows (it reads their hidden states)
        tail = (self.speculator.window or 1) if self.speculator is not None else 1
        self.scheduler = Scheduler(cfg, kv, speculative.num_speculative_tokens if speculative else 0,
                                   on_preempt=self._preempted, recompute_tail=tail)
        self.eos_id, self.decode = eos_id, decode
        self.vocab = model.cfg.vocab_size
        self.on_step: Callable[[StepStats], None] | None = None
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.requests: dict[str, Request] = {}
        self.streams: dict[str, TextStream] = {}
        self._ids = itertools.count()
        self._finished: list[str] = []   # finish reasons since the last step's stats (aborts land between steps)
        self._residency: list[float] = []   # the finished requests' residency ratios, likewise
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.fatal: EngineFatal | None = None    # set when a parallel group broke; the engine no longer runs
        self.on_fatal: Callable[[EngineFatal], None] | None = None
        self._fatal_lock = threading.Lock()      # orders submissions against the switch to `fatal`

    # ---- submission (any thread) ----
    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
                    sink: Callable[[RequestOutput], None] | None = None) -> Request:
        """Validate and queue a request; raises RequestError (naming the field) if it can never run."""
        return self.add_requests([(prompt, params, request_id, sink)])[0]

    def add_requests(self, items: list[tuple[list[int], SamplingParams, str | None,
                                             Callable[[RequestOutput], None] | None]],
                     group: str | None = None) -> list[Request]:
        """Validate every (prompt, params, request id, sink) first, then queue them all at once: a RequestError
        (naming the field) for any of them queues none, so a rejected batch leaves no request behind. `group`
        (one API request's requests) shares one fair share of each step; None: each request is its own."""
        reqs = [self._checked(*item) for item in items]
        for req in reqs:
            req.group = group or req.id
        with self._fatal_lock:
            if self.fatal is not None:
                raise RequestError(f"the engine has stopped: {self.fatal}", status=503)
            self.inbox.put(("add", reqs))
        return reqs

    def _checked(self, prompt: list[int], params: SamplingParams, request_id: str | None,
                 sink: Callable[[RequestOutput], None] | None) -> Request:
        """A Request for these settings; RequestError if it can never run."""
        if not prompt:
            raise RequestError("prompt: must contain at least one token", "prompt")
        bad = [t for t in prompt if not 0 <= t < self.vocab]
        if bad:
            raise RequestError(f"prompt: token ids {bad[:8]} outside the vocabulary [0, {self.vocab})", "prompt")
        params.validate(self.vocab)
        if params.stop and self.decode is None:
            raise RequestError("stop: stop strings need a tokenizer, and this engine has none", "stop")
        req = Request(request_id or f"req-{next(self._ids)}", list(prompt), params, sink or (lambda out: None))
        if params.seed is not None:
            req.generator = torch.Generator(device=self.model.device).manual_seed(params.seed)
        self.scheduler.check(req)
        return req

    def abort(self, request_id: str) -> None:
        """Cancel a request; its pages and slots are freed at the start of the next step."""
        self.inbox.put(("abort", request_id))

    def reset_prefix_cache(self) -> Future:
        """Drop every cached page, on the engine thread; the future gets how many pages were cached."""
        done: Future = Future()
        self.inbox.put(("reset_prefix_cache", done))
        return done

    def fail_all(self, message: str) -> None:
        """End every request submitted so far with finish reason 'error' and `message` (a bounded shutdown)."""
        self.inbox.put(("fail_all", message))

    # ---- the loop (engine thread) ----
    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def _drain_inbox(self, block: bool = False) -> bool:
        """Take every queued submission; with `block`, wait for the first one (at most idle_s: then False)."""
        while True:
            try:
                kind, arg = self.inbox.get(block=block, timeout=self.hooks.idle_s if block else None)
            except queue.Empty:
                return not block
            block = False
            if kind == "add":
                for req in arg:
                    self.requests[req.id] = req
                    if self.decode is not None:
                        self.streams[req.id] = TextStream(self.decode, req.params.stop, req.params.min_tokens)
                    self.scheduler.add(req)
            elif kind == "abort" and arg in self.requests:
                self._finish(self.requests[arg], "abort")
            elif kind == "reset_prefix_cache":
                arg.set_result(self.kv.reset_prefix_cache())
            elif kind == "fail_all":
                for req in list(self.requests.values()):
                    self._finish(req, "error", error=arg)

    def step(self) -> StepStats:
        """Admit, draft (speculative decoding), run one forward, accept or sample, and deliver outputs."""
        self._drain_inbox()
        stats = StepStats(0, 0)
        graph_steps = self.graphs.steps if self.graphs is not None else 0
        plan = self.scheduler.schedule()
        if plan is not None:
            if self.speculator is not None:
                self.speculator.propose(plan)
            result = self.runner.execute(plan)
            for req, err in result.failed:
                log.exception("request %s failed", req.id, exc_info=err)
                self._finish(req, "error", error=f"{type(err).__name__}: {err}")
            emitted: dict[int, list[int]] = {}   # segment index -> new tokens
            kept = {o.index: o.segment.length for o in result.ok}   # rows whose KV stays written
            verify = [o for o in result.ok if plan.num_drafts[o.index]]
            if verify:
                for o, tokens in zip(verify, self.speculator.accept(plan, verify)):
                    emitted[o.index], kept[o.index] = tokens, len(tokens)
                    stats.spec_draft_tokens += plan.num_drafts[o.index]
                    stats.spec_accepted.append(len(tokens) - 1)
            if self.speculator is not None:
                self.speculator.observe(result.ok, [kept[o.index] for o in result.ok])
            for o in result.ok:
                o.req.num_computed += kept[o.index]
                stats.prompt_tokens += max(0, min(o.req.num_computed, len(o.req.prompt)) - o.segment.start)
                self.kv.commit_prefix(o.req.id, o.req.token_slice, o.req.num_computed)
            self._prompt_logprobs([o for o in result.ok if o.prompt_logits is not None])
            plain = [o for o in result.ok if o.logits is not None and o.index not in emitted]
            logprobs: dict[int, list[TokenLogprobs]] = {}   # segment index -> its sampled token's logprobs
            if plain:
                logits = torch.cat([o.logits for o in plain])
                sampled = sample(logits, SamplingBatch.from_requests([o.req for o in plain], self.vocab,
                                                                     logits.device, self.eos_id))
                emitted.update((o.index, [t]) for o, t in zip(plain, sampled.tolist()))
                asked = [j for j, o in enumerate(plain) if o.req.params.logprobs is not None]
                if asked:
                    rows = torch.tensor(asked, device=logits.device)
                    lps = token_logprobs(logits[rows], sampled[rows], [plain[j].req.params.logprobs for j in asked])
                    logprobs.update((plain[j].index, [lp]) for j, lp in zip(asked, lps))
            now = time.monotonic()
            for o in result.ok:
                if o.index in emitted:
                    try:
                        self._append(o.req, emitted[o.index], now, stats, logprobs.get(o.index, []))
                    except Exception as e:   # noqa: BLE001 - its detokenising or stop handling: this request only
                        log.exception("request %s failed", o.req.id)
                        self._finish(o.req, "error", error=f"{type(e).__name__}: {e}")
        stats.graph_steps = (self.graphs.steps if self.graphs is not None else 0) - graph_steps
        stats.finished, self._finished = self._finished, []
        stats.residency, self._residency = self._residency, []
        stats.kv_resident_rows = self.kv.resident_rows()
        stats.num_running, stats.num_waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        if not self.scheduler.running:     # idle: counters a store keeps on the device are read now
            self.kv.sync_stats()
        stats.kv_stats, stats.kv_usage = self.kv.stats.snapshot(), self.kv.usage_ratio()
        stats.kv_reserved_tokens = sum(self.kv.reserved.values())
        stats.num_preemptions = self.scheduler.num_preemptions
        stats.kv_index_cache_bytes = self.kv.index_cache_bytes()
        stats.kv_cached_pages = self.kv.cached_pages()
        stats.kv_ranks = self.rank_pools()
        if stats.kv_ranks:   # DCP: the cache counters of every rank's store, not only rank 0's
            stats.kv_stats = KVStats(**{k: sum(getattr(p.stats, k) for p in stats.kv_ranks)
                                        for k in vars(stats.kv_stats)})
        if self.on_step is not None:
            self.on_step(stats)
        return stats

    def _prompt_logprobs(self, outs: list[SegmentOutput]) -> None:
        """Extend each request's prompt logprobs by the prompt tokens its chunk's rows predict (row of position j
        -> prompt token j + 1), for all chunks in one batched pass."""
        rows, targets, ks, spans = [], [], [], []
        for o in outs:
            req, first = o.req, o.segment.start
            lo, hi = len(req.prompt_logprobs), min(first + o.segment.length, len(req.prompt) - 1)
            rows.append(o.prompt_logits[lo - first:hi - first])
            targets += req.prompt[lo + 1:hi + 1]
            ks += [req.params.prompt_logprobs] * (hi - lo)
            spans.append((req, hi - lo))
        if not targets:
            return
        logits = torch.cat(rows)
        lps = token_logprobs(logits, torch.tensor(targets, device=logits.device), ks)
        for req, n in spans:
            req.prompt_logprobs += lps[:n]
            lps = lps[n:]

    def _append(self, req: Request, tokens: list[int], now: float, stats: StepStats,
                logprobs: list[TokenLogprobs]) -> None:
        """Append one step's new tokens, stopping after the first that ends the request (as if they had come one
        per step), and deliver them as one output (with the tokens' logprobs, and the prompt's with the first)."""
        p = req.params
        prompt_lps = req.prompt_logprobs if not req.output else []
        stream = self.streams.get(req.id)
        new, delta, reason = [], "", None
        for tok in tokens:
            new.append(tok)
            req.output.append(tok)
            delta += stream.push([tok]) if stream is not None else ""
            if (tok == self.eos_id and not p.ignore_eos) or tok in p.stop_token_ids or (stream and stream.stopped):
                reason = "stop"
            elif len(req.output) >= p.max_tokens:
                reason = "length"
            if reason:
                break
        rest = len(new)
        if req.first_token_time is None:
            req.first_token_time = now
            stats.ttft.append(now - req.arrival)
            rest -= 1
            gap = 0.0
        else:
            gap = (now - req.last_token_time) / rest
        stats.tpot += [gap] * rest
        req.last_token_time = now
        stats.generation_tokens += len(new)
        if reason:
            self._finish(req, reason, new, delta, logprobs=logprobs[:len(new)], prompt_logprobs=prompt_lps)
        else:
            self._deliver(req, RequestOutput(req.id, new, delta, prompt_tokens=len(req.prompt),
                                             output_tokens=len(req.output), logprobs=logprobs,
                                             prompt_logprobs=prompt_lps))

    def _preempted(self, req: Request) -> None:
        """A request's KV was freed to make room (it recomputes later): drop its drafter state too."""
        self.hooks.released(req.id)
        if self.speculator is not None:
            self.speculator.release(req.id)

    @staticmethod
    def _deliver(req: Request, out: RequestOutput) -> None:
        try:
            req.sink(out)
        except Exception:   # noqa: BLE001 - a broken consumer must not stop the engine or its neighbours
            log.exception("sink of request %s failed", req.id)

    def _finish(self, req: Request, reason: str, new: list[int] | None = None, delta: str = "",
                error: str | None = None, logprobs: list[TokenLogprobs] | None = None,
                prompt_logprobs: list[TokenLogprobs] | None = None) -> None:
        """End a request: free its KV, then deliver the final output (remaining text included)."""
        self.hooks.released(req.id)
        self._residency.append(self.kv.residency(req.id))
        self.scheduler.remove(req)
        if self.speculator is not None:
            self.speculator.release(req.id)
        req.finish_reason = reason
        self.requests.pop(req.id, None)
        stream = self.streams.pop(req.id, None)
        if stream is not None:
            delta += stream.flush()
        self._finished.append(reason)
        self._deliver(req, RequestOutput(req.id, new or [], delta, True, reason, error, len(req.prompt),
                                         len(req.output), logprobs or [], prompt_logprobs or []))

    def _fail_all(self, err: Exception) -> None:
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            self._finish(req, "error", error=f"engine error: {type(err).__name__}: {err}")

    def _die(self, err: EngineFatal) -> None:
        """A parallel group is broken: fail everything in flight or queued, refuse new work, tell `on_fatal`."""
        err = self.hooks.failed(err)
        log.error("engine stopped: %s", err)
        with self._fatal_lock:
            self.fatal = err
        self._drain_inbox()     # submissions that raced the switch: queued, so failed below
        self._fail_all(err)
        if self.on_fatal is not None:
            self.on_fatal(err)

    def rank_pools(self) -> list[Any]:
        """Each rank's host pool as last reported ([] in one process)."""
        return self.hooks.rank_pools()

    def run_forever(self) -> None:
        while not self._stopping:
            try:
                if not self._drain_inbox(block=not self.has_work()):
                    self.hooks.idle()
                if not self._stopping:
                    self.step()
            except EngineFatal as e:   # no forward can run any more: not one request's failure
                self._die(e)
                return
            except Exception as e:   # noqa: BLE001 - keep serving; fail what was in flight
                log.exception("engine step failed")
                self._fail_all(e)

    # ---- lifecycle ----
    def start(self) -> None:
        """Run the loop in a daemon thread (the only thread that touches the model and the KV store)."""
        self._thread = threading.Thread(target=self.run_forever, name="hisparse-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the engine thread, then tell the hooks (unless the engine already stopped on a fatal error)."""
        if self._stopping:
            return
        self._stopping = True
        self.inbox.put(("stop", None))
        if self._thread is not None:
            self._thread.join()
        if self.fatal is None:
            self.hooks.stopped()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[Request]:
        """Run prompts to completion on the calling thread (the engine thread must not be running)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while self.has_work() or not self.inbox.empty():
            self.step()
        return reqs
