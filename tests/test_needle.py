"""benchmarks/needle end to end: two real `hisparse serve` processes (HiSparse with a small hot buffer, and
--kv-offload none) driven by `python -m benchmarks.needle`; plus the prompt builder against an independent
tokenization and the retrieval scorer on fresh random text."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from benchmarks.needle.corpus import Corpus
from benchmarks.needle.harness import retrieved
from benchmarks.needle.prompt import PromptBuilder
from hisparse.train.passkey import INTRO, SyntheticHaystack, needle_sentence
from benchmarks.needle.tokens import LocalCounter
from hisparse.model.tiny import builtin_tiny
from serving import free_port, running, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 2048


@contextmanager
def serve(ckpt: Path, offload: str, log: Path):
    """A `hisparse serve` subprocess on a free port; yields its /v1 URL once /health answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "hisparse.cli", "serve", "--model", str(ckpt), "--port", str(port),
           "--kv-offload", offload, "--max-model-len", str(MAX_MODEL_LEN), "--host-pool-gib", "0.05",
           "--hot-buffer-tokens", "16", "--resident-window", "8", "--max-num-batched-tokens", "1024",
           "--device", "cpu", "--log-level", "warning"]
    with running(cmd, log, dict(os.environ, OMP_NUM_THREADS="1")) as proc:
        yield proc, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    """{"hisparse": url, "none": url}: both start at once (they load in parallel)."""
    ckpt, logs = builtin_tiny(), tmp_path_factory.mktemp("needle_logs")
    with ExitStack() as stack:
        started = {m: (*stack.enter_context(serve(ckpt, m, logs / f"{m}.log")), logs / f"{m}.log")
                   for m in ("hisparse", "none")}
        for proc, url, log in started.values():
            wait_healthy(proc, url, log)
        yield {m: url for m, (_, url, _) in started.items()}


def run_needle(args: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.needle", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_hisparse_on_equals_off(servers: dict[str, str], tmp_path: Path) -> None:
    """The harness against HiSparse (16 hot slots, 8-token window: most selected rows are misses) and against
    all-resident KV: every prompt has exactly its target length by the server's own count, and every greedy
    completion is identical on both."""
    out = tmp_path / "run"
    proc = run_needle(["--base-url", f"{servers['hisparse']}/v1", "--compare-base-url", f"{servers['none']}/v1",
                       "--lengths", "1k,max", "--depths", "0,50,100", "--seeds", "1", "--max-tokens", "8",
                       "--tokenizer", str(builtin_tiny()), "--out", str(out)])
    result = json.loads((out / "needle.json").read_text())
    assert result["config"]["lengths"] == {"1k": 1024, "max": MAX_MODEL_LEN - 8}
    records = result["records"]
    assert len(records) == 6
    for r in records:
        for name in ("base", "compare"):
            a = r["answers"][name]
            assert a["error"] is None and a["completion_tokens"] == 8
            assert a["prompt_tokens"] == r["target"] == r["tokens"]
        assert r["identical"] is True
        assert re.fullmatch(r"\d{7}", r["value"])
    assert result["summary"]["agreement"] == {"hits": 6, "n": 6, "rate": 1.0}
    assert len(result["cells"]) == 6 and all(c["agreement"]["rate"] == 1.0 for c in result["cells"])
    # distinct passkeys per cell, and the summary line and progress bar on the terminal
    assert len({r["value"] for r in records}) == 6
    assert "base == compare 6/6 (100.0%)" in proc.stdout
    assert "needle:" in proc.stderr and "req" in proc.stderr
    assert "prefill base" in proc.stderr and "prefill compare" in proc.stderr   # the servers' token counters
    png = (out / "needle.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image
    h, w, _ = matplotlib.image.imread(out / "needle.png").shape
    assert w > 3 * h > 300   # three panels side by side


def test_resume_keeps_finished_records(servers: dict[str, str], tmp_path: Path) -> None:
    """A stopped run (its journal cut to one record) continues with --resume and more seeds: the journal's record
    is kept as it was (not asked again), the rest are asked, and needle.json and the journal hold all of them."""
    out = tmp_path / "resume"
    args = ["--base-url", f"{servers['hisparse']}/v1", "--compare-base-url", f"{servers['none']}/v1",
            "--lengths", "1k", "--depths", "0,100", "--max-tokens", "4", "--tokenizer", str(builtin_tiny()),
            "--out", str(out)]
    run_needle([*args, "--seeds", "1"])
    journal = out / "records.jsonl"
    first = [json.loads(line) for line in journal.read_text().splitlines()]
    assert len(first) == 2 and all(r["seed"] == 0 for r in first)
    journal.write_text(json.dumps(first[1]) + "\n")            # stopped after one record
    run_needle([*args, "--seeds", "2", "--resume"])
    result = json.loads((out / "needle.json").read_text())
    assert result["summary"]["resumed"] == 1 and result["summary"]["records"] == 4
    kept = [r for r in result["records"] if (r["seed"], r["depth"]) == (first[1]["seed"], first[1]["depth"])]
    assert kept == [first[1]]                                   # same latencies: not asked again
    assert sorted((r["seed"], r["depth"]) for r in result["records"]) == [(0, 0.0), (0, 1.0), (1, 0.0), (1, 1.0)]
    assert len(journal.read_text().splitlines()) == 4
    assert all(r["identical"] for r in result["records"])


def test_server_usage_counts(servers: dict[str, str], tmp_path: Path) -> None:
    """Without a tokenizer the harness counts with the server's usage (completions API): lengths land within a
    few tokens of the target."""
    out = tmp_path / "usage"
    run_needle(["--base-url", f"{servers['hisparse']}/v1", "--lengths", "700", "--depths", "50", "--seeds", "1",
                "--max-tokens", "4", "--api", "completions", "--out", str(out)])
    (r,) = json.loads((out / "needle.json").read_text())["records"]
    assert r["answers"]["base"]["error"] is None
    assert abs(r["answers"]["base"]["prompt_tokens"] - 700) <= 8


@pytest.mark.parametrize("api,haystack", [("chat", "corpus"), ("completions", "corpus"),
                                         ("completions", "synthetic")])
def test_prompt_exact_length_and_depth(api: str, haystack: str, seed: int) -> None:
    """Fresh random lengths and depths: the request tokenized independently (mistral-common's chat encoding or
    plain encode) has exactly the target length, holds the needle once, after the intro, with the fraction of
    haystack tokens before it within one sentence of the requested depth."""
    counter = LocalCounter(builtin_tiny())
    builder = PromptBuilder(Corpus() if haystack == "corpus" else SyntheticHaystack(seed), counter, api)
    rng = random.Random(seed)
    text_tok = counter.text
    for _ in range(4):
        target, depth = rng.randint(200, 2000), rng.choice([0.0, 1.0, rng.random()])
        value = str(rng.randint(10**6, 10**7 - 1))
        p = builder.build(target, depth, value)
        ids = counter.encode(api, p.content)
        assert len(ids) == p.tokens == target
        assert p.content.count(needle_sentence(value)) == 1 and p.content.startswith(INTRO)
        before, after = p.content.split(needle_sentence(value))
        haystack_before = before[len(INTRO):]
        haystack_after = after.split("What is the secret passkey?")[0]
        n_before = len(text_tok.encode(haystack_before, bos=False, eos=False))
        n_after = len(text_tok.encode(haystack_after, bos=False, eos=False))
        sentences = re.split(r"(?<=[.!?])\s", haystack_before + haystack_after)
        longest = max(len(text_tok.encode(s, bos=False, eos=False)) for s in sentences)
        assert abs(n_before / (n_before + n_after) - depth) <= (longest + 2) / (n_before + n_after)
        if depth == 0.0:
            assert n_before == 0
        if depth == 1.0:
            assert n_after <= 1


def test_retrieved_whole_numbers(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(200):
        value = str(rng.randint(10**6, 10**7 - 1))
        noise = "".join(rng.choice("abc .,\n") for _ in range(rng.randint(0, 12)))
        assert retrieved(value, noise + value + noise[::-1])
        digit = str(rng.randint(0, 9))
        assert not retrieved(value, noise + digit + value + noise)     # inside a longer number
        assert not retrieved(value, noise + value + digit)
        assert not retrieved(value, noise + value[:-1] + " " + value[-1])


def test_distances_counts_each_prompts_far_keys_once_per_position() -> None:
    """A key picked at answer steps i and i + 1 is one more token away at the second: it counts once, for one
    prompt; distances under FAR are not counted."""
    from benchmarks.needle.distances import FAR, shared_distances
    trials = [{"far_distances_per_step": [[FAR + 5, FAR + 900], [FAR + 6, 20]]},
              {"far_distances_per_step": [[FAR + 5], [FAR + 3000]]}]
    shared = shared_distances(trials)
    assert shared[0] == {"distance_at_first_step": FAR + 5, "prompts": 2}
    assert sorted(s["distance_at_first_step"] for s in shared[1:]) == [FAR + 900, FAR + 2999]


def test_distances_rope_aliases_are_the_phase_near_repeats() -> None:
    """rope_aliases: the distances in [FAR, context) with the smallest sum_j (1 - cos(d omega_j)), best first,
    one per 64-token block, from the model's own (YaRN + LeRoPE) frequencies."""
    import torch
    from benchmarks.needle.distances import FAR, rope_aliases
    from hisparse.model.rope import rope_frequencies
    from hisparse.model.weights import load_model
    model = load_model(builtin_tiny())
    context = 40_000
    found = rope_aliases(model, context)
    d = torch.arange(FAR, context, dtype=torch.float64)
    gap = (1 - torch.cos(d[:, None] * rope_frequencies(model.cfg, model.lerope.alpha)[None, :])).sum(1)
    assert found[0] == FAR + int(torch.argmin(gap))
    gaps = [float(gap[x - FAR]) for x in found]
    assert gaps == sorted(gaps) and len({x // 64 for x in found}) == len(found)


def test_distances_trial_records_every_answer_step() -> None:
    """One short prompt through the shipped retrieval model: it is answered, and each of the 9 answer steps
    records layer 2's newest keys held (of 16) and its other keys' distances (all >= 16)."""
    from benchmarks.needle.distances import trial
    from hisparse.kv.settings import KVSettings
    from hisparse.model.tokenizer import load_tokenizer
    from hisparse.model.weights import load_model
    ckpt = Path(__file__).resolve().parents[1] / "checkpoints" / "needle-ml4"
    model, tok = load_model(ckpt), load_tokenizer(ckpt).instruct_tokenizer.tokenizer
    settings = KVSettings(offload="hisparse", host_pool_gib=0.25, hot_buffer_tokens=128)
    t = trial(model, tok, settings, 2000, 0.5, random.Random(0), layer=2)
    assert t["found"] and t["completion"].strip() == t["value"] + "."
    assert len(t["newest_held_per_step"]) == len(t["far_distances_per_step"]) == 9
    assert all(0 <= n <= 16 for n in t["newest_held_per_step"]) and t["newest_held_per_step"][0] > 8
    assert all(d >= 16 for ds in t["far_distances_per_step"] for d in ds)
    assert all(n + len(ds) <= model.cfg.index_topk
               for n, ds in zip(t["newest_held_per_step"], t["far_distances_per_step"]))


def test_rope_margin_holds_on_every_far_distance_and_beats_simple_weightings() -> None:
    """rope_margin's coefficients keep every near distance (0..16) at least `margin` above every far one
    (checked here over all of them), and the linear program's margin is at least that of two hand-made
    weightings of the same unit norm (all cosines equal; the slowest pair alone)."""
    import numpy as np
    from benchmarks.needle.rope_margin import frequencies, margin
    near, far, context = 16, 1024, 32768
    for theta, factor in [(100.0, 4), (1e4, 16)]:
        omega = frequencies(theta, factor)
        m, coef, u = margin(omega, near, far, context)
        near_d, far_d = np.arange(near + 1.0)[:, None] * omega, np.arange(far, context, dtype=float)[:, None] * omega
        near_f, far_f = np.hstack([np.cos(near_d), np.sin(near_d)]), np.hstack([np.cos(far_d), np.sin(far_d)])
        assert abs(np.abs(coef).sum() - 1) < 1e-6
        assert m == pytest.approx((near_f @ coef).min() - (far_f @ coef).max(), abs=1e-12)
        for simple in (np.r_[np.full(omega.size, 1 / omega.size), np.zeros(omega.size)],
                       np.r_[np.eye(omega.size)[np.argmin(omega)], np.zeros(omega.size)]):
            assert m >= (near_f @ simple).min() - (far_f @ simple).max() - 1e-9
    assert margin(frequencies(100.0, 4), near, far, context)[0] < margin(frequencies(1e4, 16), near, far, context)[0]


def test_prefill_watch_parses_counters_and_fits_the_quadratic() -> None:
    """The prompt-token counter of hisparse's and vLLM's /metrics text (summed over label sets), the /metrics URL
    of a /v1 base URL, and the ETA's fit recovering t(p) = a p + b p^2."""
    from benchmarks.needle.watch import fit_quadratic, metrics_url, prompt_tokens
    text = ("# HELP hisparse_prompt_tokens_total Prompt tokens prefilled\n# TYPE hisparse_prompt_tokens_total counter\n"
            "hisparse_prompt_tokens_total 4096.0\nhisparse_prompt_tokens_created 1.7e9\n")
    assert prompt_tokens(text) == 4096.0
    assert prompt_tokens('vllm:prompt_tokens_total{engine="0",model_name="m"} 10.0\n'
                         'vllm:prompt_tokens_total{engine="1",model_name="m"} 5.0\n') == 15.0
    assert prompt_tokens("hisparse_generation_tokens_total 3.0\n") is None
    assert metrics_url("http://127.0.0.1:8000/v1") == metrics_url("http://127.0.0.1:8000/v1/") \
        == "http://127.0.0.1:8000/metrics"
    a, b = fit_quadratic([(p, 2e-4 * p + 3e-9 * p * p) for p in (4096, 65536, 262144, 1 << 20)])
    assert a == pytest.approx(2e-4) and b == pytest.approx(3e-9)
    assert fit_quadratic([(1, 1.0), (2, 2.0)]) is None


def test_prefill_watch_follows_a_real_servers_prefill(servers: dict[str, str]) -> None:
    """Against a running `hisparse serve`: the bar ends at the prompt tokens the server prefilled for the watched
    requests, each finished request is a point of the fit, and nothing is left to wait for."""
    import openai
    from benchmarks.needle.watch import PrefillWatch
    url = f"{servers['hisparse']}/v1"
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    lengths = [1500, 1200, 900]
    watch = PrefillWatch({"base": (url, lengths)}, every_s=0.01)
    try:
        for n in lengths:
            watch.begin("base", n)
            prompt = [10 + (i * 31 + n) % 500 for i in range(n)]   # no shared prefix for the prefix cache
            r = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
            assert r.usage.prompt_tokens == n
            watch.end("base")
        lane = watch.lanes["base"]
        assert lane.bar.n == lane.bar.total == sum(lengths)
        assert lane.queued == [] and lane.current is None
        assert {p for p, _ in lane.points} >= set(lengths) and all(0 < p <= max(lengths) for p, _ in lane.points)
        assert watch.eta("base", 0) == 0.0
    finally:
        watch.close()


def test_local_keys_plain_answers_are_the_greedy_decode(tmp_path: Path) -> None:
    """benchmarks.needle.local_keys' plain rows: exact iff greedy decoding (reference KV) answers the passkey, the
    teacher-forced answer agrees with the greedy one up to its first wrong token, and the margin's sign says which."""
    import torch
    from benchmarks.needle import local_keys
    from benchmarks.needle.harness import needle_value
    from hisparse.engine.generate import greedy_generate
    from hisparse.kv.settings import KVSettings
    from hisparse.model.weights import load_model
    ckpt = ROOT / "checkpoints" / "needle-ml4-long"
    res = local_keys.main(["--model", str(ckpt), "--tokens", "1536", "--cells", "0:50,5:0", "--layers", "2",
                           "--threads", "1", "--out", str(tmp_path / "lk.json")])
    assert json.loads((tmp_path / "lk.json").read_text())["cells"] == res["cells"]
    torch.set_num_threads(1)
    model, counter = load_model(ckpt), LocalCounter(ckpt)
    for row in res["cells"]:
        ids, value = local_keys.cell_prompt(counter, row["seed"], 1536, row["depth_pct"])
        assert row["value"] == value == needle_value(row["seed"], 1536, row["depth_pct"] / 100)
        gen = greedy_generate(model, KVSettings(offload="none").build(model.cfg), ids, 10,
                              stop_ids=(counter.text.eos_id,)).tokens
        want = counter.text.encode(" " + row["value"] + ".", bos=False, eos=False) + [counter.text.eos_id]
        plain = row["plain"]
        assert plain["exact"] == (gen[:len(want)] == want) == (plain["margin"] > 0)
        first = next((i for i, (g, w) in enumerate(zip(gen, want)) if g != w), len(want) - 1)
        assert plain["answer"].startswith(counter.text.decode(gen[:first + 1]))
        wrong = counter.text.encode(" " + str(int(row["value"]) ^ 1) + ".", bos=False, eos=False)
        forced = local_keys.answer_check(model, ids + wrong + [counter.text.eos_id], len(ids), {}, counter.text)
        assert not forced["exact"] and forced["margin"] < 0     # a passkey the prompt does not hold is no answer
        assert set(row) >= {"recent_keys_at_owner_2"}
        missing = plain["newest_8_missing"]          # per owner, at the answer and at the prompt's queries
        assert {k: set(v) for k, v in missing.items()} == {w: {"0", "1", "2", "3"} for w in ("answer", "prompt")}
        assert all(0 <= x <= 8 for v in missing.values() for x in v.values())


def test_million_runs_on_the_needle_haystack_with_every_indexer_build(tmp_path: Path) -> None:
    """benchmarks.needle.million with --haystack synthetic puts the seed's needle where --depth says (the prompt
    benchmarks.needle sends for that cell), the shipped model answers it, and the bf16 and FMA-filter builds of the
    indexer kernel give the same tokens and HiSparse counters as the default build, which it hands back
    afterwards."""
    from benchmarks.needle import million
    from benchmarks.needle.harness import needle_value
    from hisparse.kv.kernels import indexer_topk
    original = indexer_topk.fused_topk_paged
    runs = {}
    for build in million.INDEXER_BUILDS:
        runs[build] = million.main(["--model", str(ROOT / "checkpoints" / "needle-ml4"), "--tokens", "2048",
                                    "--decode", "10", "--chunk", "512", "--haystack", "synthetic", "--seed", "3",
                                    "--depth", "25", "--indexer-build", build,
                                    "--out", str(tmp_path / f"{build}.json")])
        assert indexer_topk.fused_topk_paged is original
    a = runs["default"]
    assert a["needle"]["value"] == needle_value(3, 2048, 0.25) and a["needle"]["haystack"] == "synthetic"
    assert abs(a["needle"]["depth"] - 0.25) < 0.01 and a["needle_retrieved"], a["output_text"]
    for name, b in runs.items():
        assert b["indexer_build"] == name
        assert b["indexer_filter"] == indexer_topk.full_row_filter(million.INDEXER_BUILDS[name])
        assert a["output_ids"] == b["output_ids"], name
        assert a["hisparse_prefill"] == b["hisparse_prefill"] and a["hisparse_decode"] == b["hisparse_decode"], name
