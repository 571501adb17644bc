"""The `hisparse` command line, run as a subprocess: make-tiny, generate, logits, and clear errors for bad ids."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hisparse.cli import main
from hisparse.engine.generate import greedy_generate
from hisparse.engine.kv_settings import KVSettings
from hisparse.model.batch import Segment
from hisparse.model.kv import ResidentKV
from hisparse.model.tokenizer import load_tokenizer
from hisparse.model.weights import load_model

pytestmark = pytest.mark.usefixtures("single_thread")


def hisparse(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`python -m hisparse.cli ARGS` with one intra-op thread (as the in-process side of each comparison)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "hisparse.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`hisparse make-tiny DIR` with the Tekken tokenizer (vocab 131072); made once per module (a few seconds)."""
    out = tmp_path_factory.mktemp("cli") / "tiny"
    proc = hisparse("make-tiny", str(out))
    assert str(out) in proc.stdout
    return out


@pytest.fixture(scope="module")
def model(served: Path):
    return load_model(served)


def test_make_tiny_writes_a_servable_checkpoint(served: Path, model) -> None:
    assert {p.name for p in served.iterdir()} >= {"params.json", "consolidated.safetensors", "tekken.json"}
    assert model.cfg.vocab_size == 131072 and model.cfg.n_layers == 8


def test_generate_prints_ids(served: Path, model) -> None:
    proc = hisparse("generate", "--model", str(served), "--prompt", "hello", "--max-tokens", "8",
                    "--kv-offload", "none")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("ids:")]
    assert len(line) == 1, proc.stdout
    ids = [int(t) for t in line[0].removeprefix("ids:").split(",")]
    assert len(ids) == 8 and all(0 <= i < 131072 for i in ids)
    tok = load_tokenizer(served).instruct_tokenizer.tokenizer
    prompt = tok.encode("hello", bos=True, eos=False)
    want = greedy_generate(model, KVSettings(offload="none").build(model.cfg), prompt, 8).tokens
    assert ids == want


def test_logits_writes_full_forward(served: Path, model, tmp_path: Path) -> None:
    out = tmp_path / "f.npy"
    hisparse("logits", "--model", str(served), "--prompt-ids", "1,2,3", "--out", str(out))
    got = np.load(out)
    assert got.shape == (3, 131072) and got.dtype == np.float32
    want = model(torch.tensor([1, 2, 3]), [Segment(0, 0, 3)], ResidentKV(model.cfg, layout=None))
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6, atol=1e-6)


def test_bad_prompt_ids_exit_without_traceback(served: Path, tmp_path: Path) -> None:
    proc = hisparse("logits", "--model", str(served), "--prompt-ids", "1,x,3", "--out", str(tmp_path / "f.npy"),
                    check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "--prompt-ids" in proc.stderr and "comma-separated integers" in proc.stderr
    assert not (tmp_path / "f.npy").exists()


@pytest.mark.parametrize("cmd,bad,message", [
    ("logits", "1,x,3", "comma-separated integers"), ("logits", "", "empty"), ("logits", " , ", "empty"),
    ("logits", "1,512,3", "outside the vocabulary [0, 512)"), ("logits", "-1", "token id -1"),
    ("generate", "7,1.5", "comma-separated integers"), ("generate", "3,9999", "outside the vocabulary")])
def test_bad_prompt_ids_error_clearly(cmd: str, bad: str, message: str, tiny_ckpt: Path, tmp_path: Path) -> None:
    """The same checks in-process (fast) on the vocab-512 checkpoint, for both commands that take ids."""
    extra = ["--out", str(tmp_path / "f.npy")] if cmd == "logits" else ["--kv-offload", "none"]
    with pytest.raises(SystemExit) as e:
        main([cmd, "--model", str(tiny_ckpt), "--prompt-ids", bad, *extra])
    assert "--prompt-ids" in str(e.value) and message in str(e.value)
