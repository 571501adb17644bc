"""The resolver of a static step: `resolver.resolve_torch`'s plan and LRU updates with every size fixed by the
step's shape (full-step CUDA graphs replay it; on the CPU it is the torch code of that replay).

The eager resolver lists the misses (`nonzero`: a size only the device knows) and the host copies exactly those.
Here every entry of the plan keeps its place: the misses are a mask, each entry's host row is fetched (entries
that are not misses land in the arena's scratch row), the LRU stamp is a device tensor and the counters stay on
the device. The plan, the hot slots it fills and the rows it reads are those of the eager resolver.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .resolver import EMPTY, KEY_SPAN, NO_KEY, HotSlots, PageMap, classify, entries


@dataclass
class StaticPlan:
    """One index group's static resolution: entries as `resolver.Plan` (keys, kind, local; `extra`: an entry's
    row among `fetched` rows, which is its own index), and per entry its segment and position, its hot slot when
    a miss fills one (-1 otherwise) and the device counters [3] (distinct positions, misses, resident positions)
    of real segments.
    n_transient: 1 when a transient miss is possible at this step's shape (host-known), else 0."""
    keys: torch.Tensor
    kind: torch.Tensor
    local: torch.Tensor
    extra: torch.Tensor
    seg: torch.Tensor
    pos: torch.Tensor
    fill_dest: torch.Tensor
    counts: torch.Tensor
    n_transient: int

    def locate(self, seg: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
        """Entry index [n, k] of every position of a selection sel [n, k] (-1 padded) of rows of segments seg."""
        want = torch.where(sel >= 0, seg[:, None] * KEY_SPAN + sel, NO_KEY)
        return torch.searchsorted(self.keys, want)


def resolve_static(hot: HotSlots, slot_of_seg: torch.Tensor, step_start: torch.Tensor, step_row0: torch.Tensor,
                   win_lo: torch.Tensor, win_len: torch.Tensor, sinks: int, window: int, seg: torch.Tensor,
                   sel: torch.Tensor, stamp: torch.Tensor, real: torch.Tensor, transient: bool,
                   pages: PageMap | None = None) -> StaticPlan:
    """`resolver.resolve` of sel [n, k] (rows of segments seg [n]) with static shapes: stamp is a 0-dim device
    tensor, real [S] is 1 for a segment counted in the statistics (0: padding), transient whether more positions
    than free slots can be selected in one segment (`StaticPlan.n_transient`)."""
    keys, head, e_seg, e_pos, r, on_page, page_row, in_step, in_win, found, hit, miss = entries(
        hot, slot_of_seg, step_start, win_lo, win_len, sinks, seg, sel, pages, stamp)
    n = hot.n_slots
    hit_at = torch.where(hit, found, hot.scratch)
    hot.stamp.index_put_((hit_at,), stamp.expand(hit_at.shape))
    fill = torch.zeros_like(miss)
    if n:   # victims per request: least recently used slots not hit this step (every entry ranked, misses fill)
        st = hot.stamp.clone()
        st[hit_at] = NO_KEY
        order = torch.argsort(st[:-1].view(hot.slots, n), dim=1, stable=True)          # [R, n]
        per_seg = torch.zeros(2, slot_of_seg.numel(), dtype=torch.long, device=sel.device)
        per_seg[0].index_add_(0, e_seg, hit.long())
        per_seg[1].index_add_(0, e_seg, miss.long())
        rank = torch.cumsum(miss.long(), 0) - 1 - (torch.cumsum(per_seg[1], 0) - per_seg[1])[e_seg]
        fill = miss & (rank < n - per_seg[0][e_seg])
        victim = r * n + order[r, rank.clamp(0, n - 1)]
        fill_at = torch.where(fill, victim, hot.scratch)
        hot.pos.index_put_((fill_at,), e_pos)
        hot.stamp.index_put_((fill_at,), stamp.expand(fill_at.shape))
        found = torch.where(fill, victim, found)

    kind, local = classify(on_page, page_row, in_step, in_win, hit | fill, miss & ~fill, found, e_seg, e_pos, r,
                           step_start, step_row0, window, sinks)
    counted = real[e_seg] > 0
    counts = torch.stack(((head & counted).sum(), (miss & counted).sum(), (head & on_page & counted).sum()))
    return StaticPlan(keys, kind, local, torch.arange(keys.numel(), device=sel.device), e_seg, e_pos,
                      torch.where(fill, found, EMPTY), counts, int(transient))
