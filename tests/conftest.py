"""Shared fixtures: a per-session random seed, fresh random tiny ML4 models and a tiny on-disk checkpoint.

Every run draws a fresh seed (printed in the pytest header); set HISPARSE_TEST_SEED to replay a failure.
"""

from __future__ import annotations

import importlib.util
import os
import random
from pathlib import Path

import pytest
import torch

# Without CUDA the Triton kernels run on CPU tensors under Triton's interpreter. Triton chooses compiled or
# interpreted for each function when it is decorated (its own library included), so the variable is set before
# anything imports triton, every kernel module is imported, and the variable is removed again so that the
# subprocesses tests start (servers, vLLM, ahead-of-time compilation) run as users would.
if (not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ
        and importlib.util.find_spec("triton") is not None):
    os.environ["TRITON_INTERPRET"] = "1"
    import hisparse.triton_kernels  # noqa: E402,F401
    import triton.experimental.gluon  # noqa: E402,F401  (imported lazily at the first launch otherwise)
    del os.environ["TRITON_INTERPRET"]

from hisparse.core.batch import ForwardTrace, Segment
from hisparse.core.config import preset_params
from hisparse.kv.base import LatentKV
from hisparse.kv.resident import ResidentKV
from hisparse.model.ml4 import ML4
from hisparse.model.tiny import make_tiny, random_model

SEED = int(os.environ.get("HISPARSE_TEST_SEED", random.SystemRandom().randrange(2**31)))
os.environ["HISPARSE_TEST_SEED"] = str(SEED)   # pytest-xdist workers inherit it: one seed for the whole run


def pytest_report_header(config: pytest.Config) -> str:
    return f"hisparse test seed: {SEED} (replay with HISPARSE_TEST_SEED={SEED})"


SUMMARY: list[str] = []   # lines for the end of the run (e.g. how many kernels compiled), from every xdist worker


def summarize(request: pytest.FixtureRequest, line: str) -> None:
    """Print `line` at the end of the run: through the test's report, which pytest-xdist sends to the controller."""
    request.node.user_properties.append(("summary", line))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call":
        SUMMARY.extend(value for key, value in report.user_properties if key == "summary")


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    for line in SUMMARY:
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def seed() -> int:
    return SEED


@pytest.fixture
def single_thread():
    """Run a test with one intra-op thread: tiny-model ops gain nothing from threads, and on a busy 2-core machine
    OpenMP spin-waiting makes them up to 100x slower. Opt in per module with
    `pytestmark = pytest.mark.usefixtures("single_thread")`."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@torch.no_grad()
def sharpen(model: ML4, seed: int) -> ML4:
    """Make every part of the math matter to the logits: peaky attention and indexer scores (the spec's N(0, 0.02^2)
    init gives near-uniform softmaxes), strong SSMax and LeRoPE, and logits spread over the soft cap's whole range
    (pre-cap spread about twice the cap: the bulk in its non-linear range, each row's top few in its saturated
    tail, where top-2 gaps are ~1e-4 and an fp32 rounding can swap them; greedy comparisons across batch shapes
    belong in fp64). Without this a reference test cannot tell, e.g., exp(alpha) from exp(-alpha)."""
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if name.endswith("ssmax_scaling"):
            s = 0.2 + 0.4 * torch.rand(p.shape[0], generator=g)
            b = 0.5 + torch.rand(p.shape[0], generator=g)
            p.copy_(torch.stack((s, b), dim=1))
        elif name.endswith("lerope.alpha"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.7)
        elif any(k in name for k in (".wq.", ".wkv_a_with_mqa.", ".wkv_b.", ".wq_b.", ".wk.")):
            p.mul_(8.0)
        elif name.startswith("output.") or (model.output is None and name == "tok_embeddings.weight"):
            p.mul_(400.0)
    return model


def tiny_model(seed: int, dtype: torch.dtype = torch.float64, sharp: bool = True, **overrides) -> ML4:
    """A fresh random tiny ML4 (preset 'tiny' with params overridden) in `dtype`."""
    params = preset_params("tiny")
    for key, val in overrides.items():
        if isinstance(val, dict):
            params[key] = dict(params[key], **val)
        else:
            params[key] = val
    model = random_model(params, seed)
    if sharp:
        sharpen(model, seed)
    return model.to(dtype)


def random_tokens(n: int, vocab: int, seed: int) -> torch.Tensor:
    """n distinct token ids (no repeated token: repeated tokens give bit-identical keys, whose order fp rounding may
    legitimately swap, spec §1.1)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(vocab, generator=g)[:n]


def kv_for(model: ML4, layout: str | None = None) -> LatentKV:
    return ResidentKV(model.cfg, layout=layout, dtype=model.dtype)


def full_forward(model: ML4, tokens: torch.Tensor, layout: str | None = None, req: object = 0
                 ) -> tuple[torch.Tensor, ForwardTrace]:
    """One forward over the whole sequence: logits [T, V] and its trace."""
    trace = ForwardTrace()
    logits = model(tokens, [Segment(req, 0, len(tokens))], kv_for(model, layout), trace=trace)
    return logits, trace


def selection_sets(sel: torch.Tensor) -> list[list[int]]:
    """[T, k] positions (-1 padded) -> per query the sorted list of selected positions."""
    return [sorted(p for p in row.tolist() if p >= 0) for row in sel]


@pytest.fixture
def tiny64(seed: int) -> ML4:
    """Fresh random fp64 tiny model with non-degenerate SSMax/LeRoPE and sharp attention."""
    return tiny_model(seed)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint (vocab 512, no tokenizer, seed 0) written once per session; treat as read-only."""
    return make_tiny(tmp_path_factory.mktemp("tiny_ckpt"), with_tokenizer=False)
