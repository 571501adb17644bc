"""StepInputs: what changes between steps (tokens, positions, page tables, lengths, slots), gathered on the host
and sent to the device in one copy per step.

Every part is staged as a host int64 tensor; `commit` packs them into one host buffer (pinned on CUDA) and copies
it to the device at once. With `static` set, the buffers of a layout (the parts' names and shapes, in order) are
kept and reused: a step of the same layout gets views at the same device addresses, which is what a captured
CUDA graph reads on replay.
"""

from __future__ import annotations

import torch


class StepInputs:
    def __init__(self, device: torch.device | str, static: bool = False):
        self.device, self.static = torch.device(device), static
        self.parts: list[tuple[str, torch.Tensor]] = []
        # static: layout -> (host staging, device buffer, the event of its last copy)
        self.buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor, object | None]] = {}

    def stage(self, name: str, values: torch.Tensor) -> None:
        """Add a host tensor (any integer or bool dtype; sent as int64) to this step's copy."""
        self.parts.append((name, values))

    def commit(self) -> dict[str, torch.Tensor]:
        """Send every staged part in one host->device copy: name -> its device view (int64, its staged shape)."""
        parts, self.parts = self.parts, []
        layout = tuple((name, tuple(t.shape)) for name, t in parts)
        total = sum(t.numel() for _, t in parts)
        cuda = self.device.type == "cuda"
        if self.static and layout in self.buffers:
            host, dev, done = self.buffers[layout]
            if done is not None:        # the last copy out of this staging buffer has run
                done.synchronize()
        else:
            host = torch.empty(total, dtype=torch.long, pin_memory=cuda)
            dev = torch.empty(total, dtype=torch.long, device=self.device)
        if parts:
            torch.cat([t.reshape(-1).to(torch.long) for _, t in parts], out=host)
        dev.copy_(host, non_blocking=cuda)
        done = None
        if cuda:
            done = torch.cuda.Event()
            done.record()
        if self.static:
            self.buffers[layout] = (host, dev, done)
        views, at = {}, 0
        for name, t in parts:
            views[name] = dev[at: at + t.numel()].view(t.shape)
            at += t.numel()
        return views
