"""`hisparse serve --dcp-size R` end to end: real server processes (rank 0 + spawned followers, gloo)
with HiSparse on and a hot buffer far below the context, driven by the official openai client.

Greedy completions (64 tokens, concurrent, servers in fp64) equal the single-rank tokens, with and without DSpark;
/metrics shows every rank's pool; a follower killed or stopped mid-request fails the request with an error naming
DCP and the rank, the server exits non-zero within the timeout and leaves no process behind; a follower that dies
while loading ends `serve` with its error. In process: the followers' DSpark draft windows are bit-identical to
rank 0's; a forward that raises on one rank fails the group (no rank reruns part of a step alone).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import torch
from serving import KEY, MAX_MODEL_LEN, Server, free_port, running, wait_healthy

from hisparse.parallel.context import DCPContext
from hisparse.parallel.group import RankGroup
from hisparse.parallel.sharded_kv import ShardedKV
from hisparse.parallel.launch import DCPLaunchError, launch as launch_ranks
from hisparse.parallel.leader import Leader
from hisparse.parallel.serve import run_follower
from hisparse.engine.engine import Engine
from hisparse.engine.generate import greedy_generate
from hisparse.kv.settings import KVSettings
from hisparse.engine.request import SamplingParams
from hisparse.engine.scheduler import SchedulerConfig
from hisparse.engine.speculative import SpeculativeConfig
from hisparse.model.tiny import builtin_tiny, make_tiny
from hisparse.model.tokenizer import load_tokenizer
from hisparse.model.weights import load_model

pytestmark = pytest.mark.usefixtures("single_thread")

TOKENS = 64
TIMEOUT = 5          # --dcp-timeout of every server here (heartbeat every 1.25 s)
HOT, WINDOW, POOL_GIB = 16, 8, 0.05   # 28 device rows per layer and request; the prompts are longer


def prompts(seed: int, n: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(40, 70, (n,), generator=g).tolist()
    return [torch.randint(1000, 131072, (k,), generator=g).tolist() for k in lengths]


@pytest.fixture(scope="module")
def reference(seed: int) -> tuple[list[list[int]], list[str]]:
    """Three prompts and their single-rank greedy texts, in this process on the server's KV settings, in fp64.

    DCP combines per-rank partial attention by log-sum-exp, which equals one rank's softmax only up to
    reassociation. In fp32 on the random built-in model (top-two logit gaps down to 1e-6) that is not enough for
    equal greedy tokens: a 1-ulp change of a latent can flip the rounding of a stored fp8 element, and the jump
    (measured: up to 8e-2 in a logit) can flip a near-tie; a run on CI did. So these servers compute in fp64
    (`--dtype float64`), where reassociation moves a logit by ~1e-16 and flips an fp8 rounding with probability
    ~1e-9 per run; the fp32 tolerance of the combine is checked in process by test_dcp."""
    torch.set_num_threads(1)
    model = load_model(builtin_tiny(), dtype=torch.float64)
    text = load_tokenizer(builtin_tiny()).instruct_tokenizer.tokenizer
    ps = prompts(seed)
    settings = KVSettings(host_pool_gib=POOL_GIB, hot_buffer_tokens=HOT, resident_window=WINDOW)
    texts = [text.decode(greedy_generate(model, settings.build(model.cfg, dtype=torch.float64), p, TOKENS).tokens)
             for p in ps]
    return ps, texts


def complete(server: Server, prompt: list[int], max_tokens: int = TOKENS) -> str:
    r = server.client().completions.create(model=server.name, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == max_tokens
    return r.choices[0].text


def complete_all(server: Server, ps: list[list[int]]) -> list[str]:
    """All prompts at once (batched by the engine)."""
    with ThreadPoolExecutor(len(ps)) as pool:
        return list(pool.map(lambda p: complete(server, p), ps))


@contextmanager
def dcp_server(log: Path, *extra: str, healthy: bool = True, ckpt: Path | None = None,
               launcher: tuple[str, ...] = (sys.executable,)) -> Iterator[tuple[Server, subprocess.Popen]]:
    """`hisparse serve` (`ckpt`, default the built-in tiny checkpoint; always offloading, with a small hot buffer)
    with `extra` flags, started by `launcher` (python, or torchrun and its flags)."""
    ckpt, port = ckpt or builtin_tiny(), free_port()
    cmd = [*launcher, "-m", "hisparse.cli", "serve", "--model", str(ckpt), "--port", str(port), "--api-key", KEY,
           "--max-model-len", str(MAX_MODEL_LEN), "--kv-offload", "hisparse", "--host-pool-gib", str(POOL_GIB),
           "--hot-buffer-tokens", str(HOT),
           "--resident-window", str(WINDOW), "--device", "cpu", "--dtype", "float64", "--log-level", "warning",
           "--dcp-timeout", str(TIMEOUT), *extra]
    url = f"http://127.0.0.1:{port}"
    with running(cmd, log, dict(os.environ, OMP_NUM_THREADS="1")) as proc:
        if healthy:
            wait_healthy(proc, url, log)
        yield Server(url, ckpt.name, ckpt, log), proc


def follower_pids(log: Path) -> list[int]:
    return [int(m) for m in re.findall(r"(?:DCP|TP) rank [1-9]\d* \(pid (\d+)\)", log.read_text())]


def descendants(pid: int) -> set[int]:
    """Every live process below pid (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def assert_all_gone(pids: set[int], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while left := [p for p in pids if alive(p)]:
        assert time.monotonic() < deadline, f"processes left behind: {left}"
        time.sleep(0.1)


@pytest.mark.parametrize("interleave,spec,n", [(1, None, 3), (2, 2, 2)], ids=["I1", "I2-dspark"])
def test_dcp_server_greedy_equals_single_rank(tmp_path: Path, reference, interleave: int, spec: int | None,
                                              n: int) -> None:
    """R = 2: n concurrent greedy completions equal R = 1 (with DSpark: equal plain R = 1 decoding); metrics per
    rank; every pool empty again once idle; nothing left running after a normal shutdown."""
    ps, want, size = reference[0][:n], reference[1][:n], 2
    extra = ["--dcp-size", str(size), "--dcp-interleave", str(interleave)]
    if spec:
        extra += ["--speculative-config", f'{{"method": "dspark", "num_speculative_tokens": {spec}}}']
    with dcp_server(tmp_path / "serve.log", *extra) as (server, proc):
        log = server.log.read_text()
        assert f"DCP: {size} ranks, interleave {interleave}" in log and len(follower_pids(server.log)) == size - 1
        assert "(float64 on cpu)" in log
        pools = [int(n.replace(",", "")) for n in re.findall(r"DCP rank \d+ \(pid \d+\): host pool ([\d,]+) tokens",
                                                               log)]
        cap = int(re.search(r"KV cache \(host pool\) size: ([\d,]+) tokens", log)[1].replace(",", ""))
        assert len(pools) == size and len(set(pools)) == 1 and cap == size * pools[0]   # global: R pools
        assert complete_all(server, ps) == want
        m = server.wait_idle()
        rank = [f'{{"rank": "{r}"}}' for r in range(size)]
        assert all(m[f"hisparse_dcp_host_pool_capacity_tokens{k}"] == pools[0] for k in rank)
        assert all(m[f"hisparse_dcp_cache_misses{k}"] > 0 for k in rank)   # every rank served rows from its pool
        assert m["hisparse_cache_misses_total"] == sum(m[f"hisparse_dcp_cache_misses{k}"] for k in rank)
        deadline = time.monotonic() + 3 * TIMEOUT                          # the heartbeat reports the releases
        while any(m[f"hisparse_dcp_host_pool_used_tokens{k}"] != m[f"hisparse_dcp_prefix_cache_tokens{k}"]
                  for k in rank):                                            # every rank: only its cached pages
            assert time.monotonic() < deadline, m
            time.sleep(0.3)
            m = server.metrics()
        if spec:
            assert m["hisparse_spec_decode_num_draft_tokens_total"] > 0
        group = descendants(proc.pid) | {proc.pid}
    assert proc.returncode == 0 or proc.returncode == -signal.SIGTERM
    assert_all_gone(group)


@pytest.mark.parametrize("spec", [None, 2], ids=["plain", "dspark"])
def test_tp_dcp_server_on_fp8_equals_single_rank(tmp_path: Path, seed: int, spec: int | None) -> None:
    """-tp 2 -dcp 2 on an FP8 checkpoint (each rank loads its half of the FP8 blocks): concurrent greedy completions
    equal the single-rank ones, also with DSpark (every rank runs the drafter's block forwards, whose vocab-parallel
    embedding and head are collectives); startup names every rank's weight bytes (each less than the whole
    model's)."""
    ckpt = make_tiny(tmp_path / "fp8", fp8=True, seed=seed)
    torch.set_num_threads(1)
    model = load_model(ckpt, dtype=torch.float64)
    text = load_tokenizer(ckpt).instruct_tokenizer.tokenizer
    settings = KVSettings(host_pool_gib=POOL_GIB, hot_buffer_tokens=HOT, resident_window=WINDOW)
    ps = prompts(seed)
    want = [text.decode(greedy_generate(model, settings.build(model.cfg, dtype=torch.float64), p, TOKENS).tokens)
            for p in ps]
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    extra = ["--speculative-config", f'{{"method": "dspark", "num_speculative_tokens": {spec}}}'] if spec else []
    with dcp_server(tmp_path / "serve.log", "-tp", "2", "-dcp", "2", *extra, ckpt=ckpt) as (server, proc):
        log = server.log.read_text()
        assert "TP2 DCP2: 2 rank processes" in log and len(follower_pids(server.log)) == 1
        weights = [int(w.replace(",", "")) for w in re.findall(r"TP rank \d+ \(pid \d+\): .* weights ([\d,]+) bytes",
                                                                  log)]
        assert len(weights) == 2 and all(w < 0.75 * whole for w in weights), (weights, whole)
        assert complete_all(server, ps) == want
        if spec:
            assert server.metrics()["hisparse_spec_decode_num_draft_tokens_total"] > 0
        group = descendants(proc.pid) | {proc.pid}
    assert proc.returncode == 0 or proc.returncode == -signal.SIGTERM
    assert_all_gone(group)


def test_torchrun_tp_server_equals_single_rank(tmp_path: Path, reference) -> None:
    """torchrun starts the ranks (`torchrun --nproc-per-node 2 -m hisparse.cli serve -tp 2 -dcp 2`): every process
    joins from the environment and loads its share, rank 0 serves the single-rank greedy completions."""
    ps, want = reference
    torchrun = (str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "2", "--master-port",
                str(free_port()))
    with dcp_server(tmp_path / "serve.log", "-tp", "2", "-dcp", "2", launcher=torchrun) as (server, proc):
        assert "TP2 DCP2: 2 rank processes" in server.log.read_text()
        assert complete_all(server, ps) == want
        group = descendants(proc.pid) | {proc.pid}
    assert_all_gone(group, within=30.0)     # torchrun ends its ranks (and itself exits 1 on SIGTERM, by design)


@pytest.mark.parametrize("how, flags", [("kill", ("--dcp-size", "2")), ("hang", ("--dcp-size", "2")),
                                        ("kill", ("-tp", "2", "-dcp", "2"))], ids=["kill", "hang", "kill-tp2-dcp2"])
def test_dead_or_hung_follower_fails_the_server_cleanly(tmp_path: Path, how: str, flags: tuple[str, ...],
                                                        seed: int) -> None:
    """Two requests in flight (one streaming) when rank 1 is SIGKILLed or SIGSTOPped: both end with an error
    naming the group and rank 1 within the timeout, a new request is refused, the server exits non-zero, no process
    is left."""
    with dcp_server(tmp_path / "serve.log", *flags) as (server, proc):
        group = descendants(proc.pid) | {proc.pid}
        (follower,) = follower_pids(server.log)
        events: list[str] = []
        failures: list[openai.APIStatusError] = []

        def stream() -> None:
            body = {"model": server.name, "prompt": prompts(seed + 1, 1)[0], "max_tokens": 1000, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60,
                              headers={"Authorization": f"Bearer {KEY}"}) as r:
                events.extend(filter(None, r.iter_lines()))

        def plain() -> None:
            try:
                complete(server, prompts(seed + 2, 1)[0], 1000)
            except openai.APIStatusError as e:
                failures.append(e)

        clients = [threading.Thread(target=stream), threading.Thread(target=plain)]
        for c in clients:
            c.start()
        deadline = time.monotonic() + 30
        while server.metrics()["hisparse_generation_tokens_total"] < 4:   # both admitted and decoding
            assert time.monotonic() < deadline
            time.sleep(0.1)
        os.kill(follower, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        t0 = time.monotonic()
        for c in clients:
            c.join(60)
        elapsed = time.monotonic() - t0
        with pytest.raises((openai.APIStatusError, openai.APIConnectionError)):   # refused (503) or gone
            complete(server, prompts(seed + 3, 1)[0], 4)
        code = proc.wait(timeout=3 * TIMEOUT)
    (failure,) = failures
    message = str(failure)
    print(f"{how}: failed after {elapsed:.1f} s with {failure.status_code}: {message[:400]}")
    assert failure.status_code == 500 and "DCP" in message and f"rank 1 (pid {follower})" in message
    assert ("killed by signal SIGKILL" if how == "kill" else "hung") in message
    errors = [e for e in events if '"error"' in e]
    assert errors and f"rank 1 (pid {follower})" in errors[0] and events[-1] == "data: [DONE]"
    assert elapsed < 2 * TIMEOUT + 5
    assert code not in (0, None) and re.search(r"stopped because the (TP2 )?DCP2 group failed", server.log.read_text())
    assert_all_gone(group)


def test_follower_failing_at_startup_ends_serve(tmp_path: Path) -> None:
    """A follower that dies while loading: serve exits non-zero naming it, without waiting for the timeout."""
    with dcp_server(tmp_path / "serve.log", "--dcp-size", "2", healthy=False) as (server, proc):
        deadline = time.monotonic() + 30
        while not (kids := [p for p in descendants(proc.pid)
                            if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]):
            assert time.monotonic() < deadline and proc.poll() is None, server.log.read_text()
            time.sleep(0.05)
        os.kill(kids[0], signal.SIGKILL)
        code = proc.wait(timeout=3 * TIMEOUT)
    log = server.log.read_text()
    assert code not in (0, None) and f"rank 1 (pid {kids[0]}) died: killed by signal SIGKILL" in log, log
    assert_all_gone({proc.pid, *kids})


def window_rank(group: RankGroup, seed: int) -> dict:
    """Every rank: the engine path with DSpark (rank 0 schedules, drafts and samples; rank 1 replays); after 12
    steps, with requests still in flight, the ranks' draft windows and rank 0's acceptance counts."""
    model = load_model(builtin_tiny())
    kv = KVSettings(host_pool_gib=POOL_GIB, hot_buffer_tokens=HOT, resident_window=WINDOW).build(model.cfg)
    spec = SpeculativeConfig(num_speculative_tokens=2)
    if group.rank > 0:
        cache = run_follower(group, model, ShardedKV(kv, DCPContext(group, 1)), spec).speculator.proposer.cache
        return {"rows": cache.rows, "pos": cache.pos}
    sharded = ShardedKV(kv, DCPContext(group, 1))
    leader = Leader(group, sharded)
    engine = Engine(model, sharded, SchedulerConfig(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64),
                    speculative=spec, hooks=leader)
    leader.start_up(model)                       # the start-up exchanges run_follower expects
    for p in prompts(seed):
        engine.add_request(p, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    for _ in range(12):
        engine.step()
    cache, stats = engine.speculator.proposer.cache, engine.speculator.stats
    out = {"rows": {r: t.clone() for r, t in cache.rows.items()}, "pos": {r: t.clone() for r, t in cache.pos.items()},
           "proposed": stats.proposed, "accepted": stats.accepted, "running": len(engine.scheduler.running)}
    engine.stop()
    return out


def test_draft_windows_replicated_on_every_rank(seed: int) -> None:
    """DSpark under DCP: observe / rollback ops keep each follower's draft window cache bit-identical to rank 0's."""
    lead, follow = launch_ranks(window_rank, 2, seed, threads=1, timeout_s=60.0, deadline_s=300.0)
    assert lead["running"] == 3 and lead["proposed"] > lead["accepted"]     # in flight, some drafts rolled back
    assert sorted(lead["rows"]) == sorted(follow["rows"]) and len(lead["rows"]) == 3
    for req in lead["rows"]:
        assert (lead["pos"][req] >= 0).sum() > 0
        assert torch.equal(lead["pos"][req], follow["pos"][req])
        assert torch.equal(lead["rows"][req], follow["rows"][req])


def failing_forward_rank(group: RankGroup, seed: int, who: int) -> None:
    """Every rank: the engine path on 2 DCP ranks; rank `who`'s store raises in the third step's writes."""
    model = load_model(builtin_tiny())
    kv = KVSettings(host_pool_gib=POOL_GIB, hot_buffer_tokens=HOT, resident_window=WINDOW).build(model.cfg)
    if group.rank == who:
        write, steps = kv.write, kv.stats

        def failing_write(*args) -> None:
            if steps.steps >= 3:
                raise RuntimeError("injected write failure")
            write(*args)
        kv.write = failing_write
    if group.rank > 0:
        run_follower(group, model, ShardedKV(kv, DCPContext(group, 1)), None)
        return
    sharded = ShardedKV(kv, DCPContext(group, 1))
    leader = Leader(group, sharded)
    engine = Engine(model, sharded, SchedulerConfig(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64),
                    hooks=leader)
    leader.start_up(model)
    for p in prompts(seed):
        engine.add_request(p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    for _ in range(20):
        engine.step()
    raise AssertionError("the group ran on past a failed forward")


@pytest.mark.parametrize("who", [0, 1])
def test_a_failed_forward_fails_the_group_not_one_request(seed: int, who: int) -> None:
    """A forward that fails on one rank is not rerun request by request (the other ranks ran it whole, so a rerun
    would run different collectives): rank 0's engine stops on it, a follower exits with it, and the peer's next
    collective fails with a GroupError."""
    with pytest.raises(DCPLaunchError) as info:
        launch_ranks(failing_forward_rank, 2, seed, who, threads=1, timeout_s=5.0, deadline_s=120.0)
    errors = info.value.errors
    assert "injected write failure" in errors[who], errors
    if who == 0:
        assert "EngineFatal" in errors[0] and "cannot rerun it request by request" in errors[0], errors
    else:
        assert "GroupError" in errors[0] and "peer rank died" in errors[0], errors
