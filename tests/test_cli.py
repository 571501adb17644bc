"""The `hisparse` command line, run as a subprocess: make-tiny, generate, logits, clear errors for bad ids and bad
--model folders, a default in every flag's help, and the note that the built-in checkpoint is random."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hisparse.cli import TRAINED_CHECKPOINT, build_parser, main
from hisparse.engine.generate import greedy_generate
from hisparse.kv.settings import KVSettings
from hisparse.core.batch import Segment
from hisparse.kv.resident import ResidentKV
from hisparse.model.tokenizer import load_tokenizer
from hisparse.model.weights import load_model

pytestmark = pytest.mark.usefixtures("single_thread")


BUILTIN_NOTE = "the built-in tiny checkpoint has random weights"


def hisparse(*args: str, check: bool = True, umask: int = -1) -> subprocess.CompletedProcess:
    """`python -m hisparse.cli ARGS` with one intra-op thread (as the in-process side of each comparison), under
    `umask` (-1: this process's)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "hisparse.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300, umask=umask)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`hisparse make-tiny DIR` with the Tekken tokenizer (vocab 131072), under umask 022; made once per module (a
    few seconds)."""
    out = tmp_path_factory.mktemp("cli") / "tiny"
    proc = hisparse("make-tiny", str(out), umask=0o022)
    assert str(out) in proc.stdout
    return out


@pytest.fixture(scope="module")
def model(served: Path):
    return load_model(served)


def test_make_tiny_writes_a_servable_checkpoint(served: Path, model) -> None:
    assert {p.name for p in served.iterdir()} >= {"params.json", "consolidated.safetensors", "tekken.json"}
    assert model.cfg.vocab_size == 131072 and model.cfg.n_layers == 8


def test_make_tiny_files_get_the_umask_mode(served: Path, tmp_path: Path) -> None:
    """Every file make-tiny writes, the weights included, has mode 0666 less the umask, as open() creates files."""
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in served.iterdir()} == \
        dict.fromkeys(["params.json", "consolidated.safetensors", "tekken.json"], oct(0o644))
    out = tmp_path / "private"
    hisparse("make-tiny", str(out), umask=0o027)
    assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {oct(0o640)}


def test_generate_prints_ids(served: Path, model) -> None:
    proc = hisparse("generate", "--model", str(served), "--prompt", "hello", "--max-tokens", "8",
                    "--kv-offload", "none")
    assert BUILTIN_NOTE not in proc.stderr
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


def test_generate_on_the_builtin_checkpoint_says_it_is_random() -> None:
    """Without --model, one line on stderr says the built-in weights are random and names the trained model."""
    proc = hisparse("generate", "--prompt-ids", "1,2,3", "--max-tokens", "1", "--kv-offload", "none")
    (note,) = [ln for ln in proc.stderr.splitlines() if BUILTIN_NOTE in ln]
    assert "meaningless" in note and f"--model {TRAINED_CHECKPOINT}" in note and "ids:" in proc.stdout


@pytest.mark.parametrize("cmd,case", [
    ("generate", "missing"), ("logits", "missing"), ("serve", "missing"),
    ("generate", "empty"), ("logits", "empty"), ("serve", "empty"),
    ("serve", "no weights"), ("serve", "no tokenizer"), ("generate", "no tokenizer")])
def test_bad_model_folder_is_one_line_and_status_2(cmd: str, case: str, tiny_ckpt: Path, tmp_path: Path) -> None:
    """A --model folder that is missing or lacks a file the command needs: one line on stderr naming the path and
    the missing part, exit status 2, no traceback."""
    folder, missing = {
        "missing": (tmp_path / "nope", "no such folder"),
        "empty": (tmp_path, "no params.json (not a Mistral-native checkpoint folder)"),
        "no weights": (tmp_path, "no consolidated*.safetensors"),
        "no tokenizer": (tiny_ckpt, "no tekken.json"),    # a checkpoint without a tokenizer cannot serve text
    }[case]
    if case == "no weights":
        shutil.copy(tiny_ckpt / "params.json", tmp_path)
    args = {"generate": ["--prompt", "hi"] if case == "no tokenizer" else ["--prompt-ids", "1"],
            "logits": ["--prompt-ids", "1", "--out", str(tmp_path / "f.npy")],
            "serve": ["--port", "1", "--device", "cpu"]}[cmd]
    proc = hisparse(cmd, "--model", str(folder), *args, check=False)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"hisparse: --model {folder}: ") and missing in line
    assert proc.stdout == "" and not (tmp_path / "f.npy").exists()


def help_entries(text: str) -> dict[str, str]:
    """argparse --help output -> {option string: its help text on one line}."""
    entries: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("  -"):
            spec, _, rest = line.strip().partition("  ")
            current = [rest]
            for opt in spec.split(", "):
                entries[opt.split()[0]] = current
        elif current is not None and line.startswith("   "):
            current.append(line)
        else:
            current = None
    return {opt: " ".join(" ".join(lines).split()) for opt, lines in entries.items()}


@pytest.mark.parametrize("cmd", ["serve", "generate", "logits", "make-tiny", "train-needle", "train-drafter"])
def test_help_shows_every_default(cmd: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`hisparse CMD --help`: every flag has a help line that states its default (the value itself where it has
    one); on/off switches and required flags only need a help line."""
    monkeypatch.delenv("HISPARSE_API_KEY", raising=False)    # the subprocess's --api-key default, as there
    monkeypatch.setenv("COLUMNS", "1000")                     # argparse breaks long lines at hyphens
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[cmd]
    required = {a for g in sub._mutually_exclusive_groups if g.required for a in g._group_actions}
    entries = help_entries(hisparse(cmd, "--help").stdout)
    for action in sub._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        for opt in action.option_strings:
            assert entries.get(opt), f"{cmd} {opt}: no help line"
        text = entries[action.option_strings[-1]]
        if action.nargs == 0 or action.required or action in required:
            continue
        assert "(default: " in text, f"{cmd} {action.option_strings[-1]}: no default in {text!r}"
        if action.default is not None:
            assert f"(default: {action.default})" in text, f"{cmd} {action.option_strings[-1]}: {text!r}"


@pytest.mark.parametrize("flags, message", [
    (["-tp", "8"], "--tensor-parallel-size: tensor parallelism over 8 ranks: n_heads (4) does not divide by 8"),
    (["-tp", "2", "-dcp", "3"], "--decode-context-parallel-size: dcp_size: 3 must divide tensor_parallel_size 2"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size: tp_size: must be >= 1, got 0"),
    (["--device", "cpu", "--cuda-graph", "piecewise"],
     "--cuda-graph piecewise: needs a CUDA device and --kernels triton")])
def test_bad_parallel_sizes_fail_before_any_rank_starts(flags: list[str], message: str) -> None:
    """Sizes the checkpoint (built-in tiny: 4 heads) or each other cannot take, or graphs without CUDA: one
    message naming the flag."""
    proc = hisparse("serve", "--port", "1", *flags, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
