"""The vocab-parallel embedding and output head of tensor parallelism against the unsharded model over every token
id, so every shard boundary is checked on every run. The ranks are threads of this process holding their share as
`TensorParallel` loads it; their collectives meet at a barrier and add (or stack) in rank order, as gloo's do."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conftest import tiny_model
from hisparse.model.ml4 import ML4
from hisparse.model.weights import load_model, save_model
from hisparse.parallel.tp import TensorParallel

pytestmark = pytest.mark.usefixtures("single_thread")


class Meeting:
    """Where `size` rank threads exchange their tensors; `sent` keeps every all-reduce's inputs by `what`."""

    def __init__(self, size: int):
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list[torch.Tensor | None] = [None] * size
        self.sent: dict[str, list[torch.Tensor | None]] = {}


class ThreadGroup:
    """One rank of a Meeting, with RankGroup's collectives (every rank gets the same bits)."""

    def __init__(self, rank: int, meeting: Meeting):
        self.rank, self.size, self.meeting = rank, len(meeting.slots), meeting

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        m = self.meeting
        m.slots[self.rank] = x.clone()
        m.barrier.wait()
        every = list(m.slots)
        m.barrier.wait()       # nobody overwrites a slot before every rank has read them all
        return every

    def all_reduce(self, x: torch.Tensor, what: str) -> torch.Tensor:
        every = self._exchange(x)
        self.meeting.sent.setdefault(what, [None] * self.size)[self.rank] = every[self.rank]
        out = every[0].clone()
        for y in every[1:]:
            out += y
        return out

    def all_gather(self, x: torch.Tensor, what: str) -> torch.Tensor:
        return torch.stack(self._exchange(x))


def on_ranks(ckpt: Path, size: int, fn: Callable[[ML4], torch.Tensor]) -> tuple[list[torch.Tensor], Meeting]:
    """Load each rank's share of `ckpt` as `hisparse serve -tp size` does, run fn on every rank at once (threads)
    and return each rank's result."""
    meeting = Meeting(size)
    models = []
    for rank in range(size):
        tp = TensorParallel(rank, size)
        models.append(load_model(ckpt, dtype=torch.float64, shard=tp.shard, progress=False))
        tp.bind(ThreadGroup(rank, meeting))
    results: list[torch.Tensor | None] = [None] * size
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            with torch.no_grad():
                results[rank] = fn(models[rank])
        except BaseException as e:   # noqa: BLE001 - re-raised on the test's thread
            errors.append(e)
            meeting.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results, meeting


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory, seed: int) -> tuple[Path, ML4]:
    """A random tiny checkpoint (fp64 weights) and the unsharded model loaded from it."""
    path = tmp_path_factory.mktemp("tp_vocab")
    save_model(tiny_model(seed, sharp=False), path)
    return path, load_model(path, dtype=torch.float64, progress=False)


@pytest.mark.parametrize("size", (2, 4))
def test_sharded_embedding_equals_unsharded_for_every_token(ckpt, seed: int, size: int) -> None:
    """Every token id of the vocabulary (in a seeded order, as a 2-D batch) embeds exactly as on one rank, and
    exactly one rank contributes each row: its own shard, [r V/size, (r+1) V/size)."""
    path, full = ckpt
    V = full.cfg.vocab_size
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(seed)).view(4, V // 4)
    results, meeting = on_ranks(path, size, lambda m: m.tok_embeddings(ids))
    with torch.no_grad():
        want = full.tok_embeddings(ids)
    sent = torch.stack(meeting.sent["the token embeddings"])            # [size, 4, V/4, D]: each rank's part
    owner = torch.arange(size)[:, None, None] == (ids // (V // size))[None]
    held = sent.ne(0).any(-1)
    bad = (held != owner).nonzero().tolist()
    assert not bad, f"{size} ranks: (rank, row, col) embedded by the wrong ranks, e.g. {bad[:4]}; token ids " \
                    f"{sorted({int(ids[i, j]) for _, i, j in bad})[:8]}"
    for rank, got in enumerate(results):
        assert got.shape == want.shape and torch.equal(got, want), f"rank {rank} of {size}: embeddings differ"


@pytest.mark.parametrize("size", (2, 4))
def test_sharded_head_equals_unsharded_over_the_whole_vocabulary(ckpt, seed: int, size: int) -> None:
    """The gathered logits of every rank cover the whole vocabulary in order and equal the unsharded head's."""
    path, full = ckpt
    h = torch.randn(3, full.cfg.dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    results, _ = on_ranks(path, size, lambda m: m.output(h))
    with torch.no_grad():
        want = full.output(h)
    for rank, got in enumerate(results):
        assert got.shape == want.shape == (3, full.cfg.vocab_size)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0, msg=f"rank {rank} of {size}: logits differ")
