"""Host <-> device row copies for the working set.

CUDA: miss rows are gathered from the pinned pool into a pinned staging tensor and copied host -> device with
non_blocking copies on a side stream; each layer gets an event and waits once before its attention reads.
New rows are backed up device -> host eagerly on the same stream and scattered into the pool at flush.
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
