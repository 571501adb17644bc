"""Host <-> device row copies for the working set.

CUDA, torch path (`--kernels torch`): miss rows are gathered from the pinned pool into a pinned staging tensor and
copied host -> device with non_blocking copies on a side stream; each layer gets an event and waits once before
its attention reads; every tensor one stream makes and the other uses is recorded on the other (record_stream).
The Triton path copies misses inside the miss-path kernel (UVA reads of the pool) on the main stream.
A step's new rows are backed up device -> host at its end (one copy on the side stream, ordered after the main
stream's work) and scattered into the pool at flush.
CPU (or any non-CUDA device): the same calls run as batched index_select / index_put, synchronously.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


class Copier:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.pending_backups: list[tuple[torch.Tensor, Callable[[torch.Tensor], None], torch.cuda.Event]] = []

    @contextmanager
    def side(self) -> Iterator[list]:
        """Run the enclosed copies on the side stream (CUDA); yields a list that receives the done-event."""
        done: list = []
        if not self.cuda:
            yield done
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield done
            event = torch.cuda.Event()
            event.record(self.stream)
        done.append(event)

    def read_on_side(self, *tensors: torch.Tensor) -> None:
        """Main-stream tensors the side stream uses: the caching allocator keeps their memory until the side
        stream's work queued so far is done (record_stream), even if they are freed on the host before."""
        if self.cuda:
            for t in tensors:
                t.record_stream(self.stream)

    def read_on_main(self, *tensors: torch.Tensor) -> None:
        """Side-stream tensors the main stream uses (see read_on_side)."""
        if self.cuda:
            for t in tensors:
                t.record_stream(torch.cuda.current_stream(self.device))

    def to_device(self, host_view: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Gather host rows [n] of host_view onto the device (non_blocking from pinned staging on CUDA)."""
        staged = torch.index_select(host_view, 0, rows.cpu())
        if not self.cuda:
            return staged.to(self.device)
        return staged.pin_memory().to(self.device, non_blocking=True)

    def wait(self, event: object | None) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def backup(self, data: torch.Tensor, store: Callable[[torch.Tensor], None]) -> None:
        """Eagerly copy device rows to the host and hand them to `store` (immediately on CPU, at flush on CUDA)."""
        if not self.cuda:
            store(data)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        data.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
            host.copy_(data, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.pending_backups.append((host, store, event))

    def flush(self) -> None:
        """Finish every pending device -> host backup."""
        for host, store, event in self.pending_backups:
            event.synchronize()
            store(host)
        self.pending_backups.clear()
