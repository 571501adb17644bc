"""Triton kernel for the resolver's position -> slot lookup on CUDA (the torch sort+searchsorted path in
`resolver.HotState.lookup` is the reference and runs everywhere; tests compare the two where CUDA exists).

Each program takes a block of requested positions and scans the hot buffer's slot positions in blocks,
keeping the matching slot id (slot positions are unique, so at most one matches). O(U * N) compares with no
sort: at N = 2 x 2048 slots this is one pass over 32 KiB of slot metadata per block of positions.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU installs: the torch path is used
    triton = None


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:
    @triton.jit
    def _lookup_kernel(slot_pos_ptr, pos_ptr, out_ptr, n_slots, n_pos,
                       BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr):
        pid = tl.program_id(0)
        offs_p = pid * BLOCK_P + tl.arange(0, BLOCK_P)
        pos = tl.load(pos_ptr + offs_p, mask=offs_p < n_pos, other=-2)
        found = tl.full((BLOCK_P,), -1, tl.int64)
        for s0 in range(0, n_slots, BLOCK_S):
            offs_s = s0 + tl.arange(0, BLOCK_S)
            held = tl.load(slot_pos_ptr + offs_s, mask=offs_s < n_slots, other=-3)
            match = pos[:, None] == held[None, :]
            cand = tl.where(match, offs_s[None, :].to(tl.int64), -1)
            found = tl.maximum(found, tl.max(cand, axis=1))
        tl.store(out_ptr + offs_p, found, mask=offs_p < n_pos)


def lookup(slot_pos: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Slot holding each position [U] (int64), or -1; slot_pos [N] int64 with -1 for empty slots."""
    out = torch.empty_like(positions)
    if positions.numel():
        grid = (triton.cdiv(positions.numel(), 64),)
        _lookup_kernel[grid](slot_pos, positions, out, slot_pos.numel(), positions.numel(), BLOCK_P=64, BLOCK_S=128)
    return out
