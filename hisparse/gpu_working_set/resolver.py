"""The resolver: map every request's selected positions of one index group to where their rows are, in one
vectorised pass over the whole batch (no loop over requests, fixed-size outputs).

An index group (an indexer owner and the layers sharing its selection) resolves once per step; the plan serves
every member layer, each copying only its own bytes. A selected position is, in this order of precedence:
  PAGE    on a resident page (hybrid offload: `PageMap`; its row is in the page region, the page is stamped)
  STEP    written by this very step (its row is in the arena's step region)
  WINDOW  resident (one of the first `sinks` positions, or in the request's window [lo, length))
  HOT     held by a slot of the request's hot buffer (a hit), or copied into one now (a filled miss)
  EXTRA   a miss beyond the free slots: copied for this step only (transient)
LRU: a hit refreshes its slot's stamp; misses take the least recently used slots not hit this step (empty slots
first, stable on ties), in position order.

On the CPU a fused kernel (kernels/resolve.cpp) computes the same plan and LRU updates in one native pass; the
torch code (`resolve_torch`) is the reference and the path on other devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from .arena import DeviceArena
from .kernels import resolve as native

EMPTY = -1
STEP, WINDOW, HOT, EXTRA, NONE, PAGE = range(6)
KEY_SPAN = 1 << 40            # entry key = segment * KEY_SPAN + position (positions < 2^40)
NO_KEY = torch.iinfo(torch.long).max
NATIVE = True   # resolve CPU tensors with the fused kernel when it builds (False: always the torch code)


class HotSlots:
    """LRU metadata of one index group's hot buffers, every request slot at once: the position each slot holds
    and its last-use stamp, flat [R * n_slots + 1] (the last entry absorbs masked-out scatters)."""

    def __init__(self, n_slots: int, device: torch.device):
        self.n_slots, self.device, self.slots = n_slots, device, 0
        self.pos = torch.full((1,), EMPTY, dtype=torch.long, device=device)
        self.stamp = torch.full((1,), EMPTY, dtype=torch.long, device=device)
        self.key_base = torch.zeros(0, dtype=torch.long, device=device)    # [R * n_slots] slot's request * KEY_SPAN

    def fit(self, slots: int) -> None:
        """Room for `slots` request slots (new slots empty; called between steps)."""
        if slots <= self.slots:
            return
        n = slots * self.n_slots
        for name in ("pos", "stamp"):
            old = getattr(self, name)
            new = torch.full((n + 1,), EMPTY, dtype=torch.long, device=self.device)
            new[: old.numel() - 1] = old[:-1]
            setattr(self, name, new)
        self.slots = slots
        self.key_base = torch.arange(slots, device=self.device).repeat_interleave(self.n_slots) * KEY_SPAN

    @property
    def scratch(self) -> int:
        return self.slots * self.n_slots

    def clear(self, slot: int, from_position: int = 0) -> None:
        """Forget every position >= from_position held by request slot `slot` (release, rollback)."""
        part = slice(slot * self.n_slots, (slot + 1) * self.n_slots)
        stale = self.pos[part] >= from_position
        self.pos[part] = self.pos[part].masked_fill(stale, EMPTY)
        self.stamp[part] = self.stamp[part].masked_fill(stale, EMPTY)

    def held(self, slot: int) -> torch.Tensor:
        """Positions held by request slot `slot`'s hot buffer (any order)."""
        part = self.pos[slot * self.n_slots: (slot + 1) * self.n_slots]
        return part[part >= 0]

    def lookup(self, slot: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat slot index (slot * n_slots + j) holding each position, or EMPTY; slot/positions [E]."""
        if self.n_slots == 0:
            return torch.full_like(positions, EMPTY)
        held = self.pos[:-1]
        keys = torch.where(held >= 0, self.key_base + held, EMPTY)
        sorted_keys, order = torch.sort(keys)
        want = slot * KEY_SPAN + positions
        j = torch.searchsorted(sorted_keys, want).clamp(max=sorted_keys.numel() - 1)
        return torch.where(sorted_keys[j] == want, order[j], EMPTY)

    def nbytes_per_slot(self) -> int:
        return 2 * self.n_slots * 8


@dataclass
class PageMap:
    """The resident pages a resolver sees (hybrid offload): dev [S, max_pages] the device page of each segment's
    pages (-1: host only), and the pages' last-use stamps [n_pages + 1] (the last entry absorbs masked-out
    scatters), which the resolver sets for every page it reads."""
    dev: torch.Tensor
    page_tokens: int
    stamp: torch.Tensor

    def page_of(self, seg: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The device page (-1: host only) of positions >= 0 of segments seg (same shape), one flat gather."""
        return torch.take(self.dev, seg * self.dev.shape[1] + positions // self.page_tokens)


@dataclass
class Plan:
    """One index group's resolution for one step. Entries are the step's (segment, position) pairs sorted by
    key = segment * KEY_SPAN + position, then one NO_KEY entry (kind NONE) that empty selections find; a query
    row's selection finds its entries by binary search (`locate`).

    kind [E + 1] (PAGE / STEP / WINDOW / HOT / EXTRA / NONE), local [E + 1]: the row inside the kind's region
    (add the layer's region base; 0 for EXTRA and NONE), extra [E + 1]: an EXTRA entry's index among the fetched
    misses. miss_seg/miss_pos [M]: the entries copied from the host this step (M is the plan's one data-dependent
    size); miss_dest [M]: their flat hot slot, or -1 for a transient miss. n_transient of them are transient.
    n_unique distinct positions were selected, n_resident of them on resident pages."""
    keys: torch.Tensor
    kind: torch.Tensor
    local: torch.Tensor
    extra: torch.Tensor
    miss_seg: torch.Tensor
    miss_pos: torch.Tensor
    miss_dest: torch.Tensor
    n_unique: int
    n_transient: int
    n_resident: int

    @property
    def n_misses(self) -> int:
        return self.miss_seg.numel()

    def locate(self, seg: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
        """Entry index [n, k] of every position of a selection sel [n, k] (-1 padded) of rows of segments seg."""
        want = torch.where(sel >= 0, seg[:, None] * KEY_SPAN + sel, NO_KEY)
        return torch.searchsorted(self.keys, want)


def resolve(hot: HotSlots, slot_of_seg: torch.Tensor, step_start: torch.Tensor, step_row0: torch.Tensor,
            win_lo: torch.Tensor, win_len: torch.Tensor, sinks: int, window: int, seg: torch.Tensor,
            sel: torch.Tensor, stamp: int, pages: PageMap | None = None) -> Plan:
    """Resolve the selections sel [n, k] of query rows of segments seg [n] (all requests of the step at once)
    against the requests' resident pages (`pages`, hybrid offload), step rows, windows and hot buffers; updates
    `hot` (LRU) for the filled misses and the resident pages' stamps.

    slot_of_seg/step_start/step_row0 [S]: per segment its request slot (distinct), its first position written
    this step and that position's row in the step region; win_lo/win_len [R]: per request slot the resident
    window [lo, len); sinks, window: the window regions' layout (`DeviceArena.window_index`).

    CPU int64 inputs take the fused kernel when it builds and NATIVE is set, others `resolve_torch`."""
    tensors = (slot_of_seg, step_start, step_row0, win_lo, win_len, seg, sel, hot.pos, hot.stamp)
    paged = () if pages is None else (pages.dev, pages.stamp)
    if (NATIVE and all(t.is_cpu and t.dtype == torch.long for t in tensors + paged) and sel.dim() == 2
            and seg.shape == sel.shape[:1] and all(t.dim() == 1 for t in tensors[:5])
            and all(t.is_contiguous() for t in (hot.pos, hot.stamp, *paged)) and native.available()):
        out, n_unique, n_transient, m, n_resident = native.fused_resolve(
            hot.pos, hot.stamp, hot.slots, hot.n_slots, slot_of_seg, step_start, step_row0, win_lo, win_len,
            int(sinks), int(window), seg, sel, int(stamp), pages)
        return Plan(out[0], out[1], out[2], out[3], out[4, :m], out[5, :m], out[6, :m], n_unique, n_transient,
                    n_resident)
    return resolve_torch(hot, slot_of_seg, step_start, step_row0, win_lo, win_len, sinks, window, seg, sel, stamp,
                         pages)


def entries(hot: HotSlots, slot_of_seg: torch.Tensor, step_start: torch.Tensor, win_lo: torch.Tensor,
            win_len: torch.Tensor, sinks: int, seg: torch.Tensor, sel: torch.Tensor, pages: PageMap | None,
            stamp: int | torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The plan's entries [E + 1] and their classes: (keys sorted, head (first of its key), segment, position,
    request slot, on_page, page row (device page * P + position % P), in_step, in_window, hot slot found (or
    EMPTY), hit, miss); sizes fixed by sel's shape. Stamps the resident pages read with `stamp`."""
    keys = torch.where(sel >= 0, seg[:, None] * KEY_SPAN + sel, NO_KEY).flatten()
    keys, _ = torch.sort(torch.cat((keys, keys.new_full((1,), NO_KEY))))
    valid = keys != NO_KEY
    head = valid.clone()
    head[1:] &= keys[1:] != keys[:-1]                                    # first entry of each distinct key
    e_seg = torch.where(valid, keys // KEY_SPAN, 0)
    e_pos = torch.where(valid, keys % KEY_SPAN, 0)
    r = slot_of_seg[e_seg]
    if pages is None:
        on_page, page_row = torch.zeros_like(valid), torch.zeros_like(e_pos)
    else:
        d = pages.page_of(e_seg, e_pos)
        on_page = valid & (d >= 0)
        page = torch.where(on_page, d, pages.stamp.numel() - 1)
        pages.stamp.index_fill_(0, page, stamp)
        page_row = page * pages.page_tokens + e_pos % pages.page_tokens
    in_step = valid & ~on_page & (e_pos >= step_start[e_seg])
    in_win = valid & ~on_page & ~in_step & ((e_pos < sinks) | ((e_pos >= win_lo[r]) & (e_pos < win_len[r])))
    rest = head & ~on_page & ~in_step & ~in_win
    found = hot.lookup(r, e_pos)
    hit = rest & (found >= 0)
    return keys, head, e_seg, e_pos, r, on_page, page_row, in_step, in_win, found, hit, rest & ~hit


def resolve_torch(hot: HotSlots, slot_of_seg: torch.Tensor, step_start: torch.Tensor, step_row0: torch.Tensor,
                  win_lo: torch.Tensor, win_len: torch.Tensor, sinks: int, window: int, seg: torch.Tensor,
                  sel: torch.Tensor, stamp: int, pages: PageMap | None = None) -> Plan:
    """`resolve` in vectorised torch ops on any device: the reference the fused kernel reproduces."""
    keys, head, e_seg, e_pos, r, on_page, page_row, in_step, in_win, found, hit, miss = entries(
        hot, slot_of_seg, step_start, win_lo, win_len, sinks, seg, sel, pages, stamp)

    n = hot.n_slots
    hit_at = torch.where(hit, found, hot.scratch)
    hot.stamp[hit_at] = stamp
    miss_idx = miss.nonzero().squeeze(1)            # the plan's one data-dependent size: how many rows to copy
    if n and miss_idx.numel():   # victims per request: least recently used slots not hit this step
        st = hot.stamp.clone()
        st[hit_at] = NO_KEY
        order = torch.argsort(st[:-1].view(hot.slots, n), dim=1, stable=True)          # [R, n]
        n_seg = slot_of_seg.numel()
        hits_per_seg = torch.zeros(n_seg, dtype=torch.long, device=sel.device).index_add_(0, e_seg, hit.long())
        misses_per_seg = torch.zeros_like(hits_per_seg).index_add_(0, e_seg, miss.long())
        rank = torch.cumsum(miss.long(), 0) - 1 - (torch.cumsum(misses_per_seg, 0) - misses_per_seg)[e_seg]
        fill = miss & (rank < n - hits_per_seg[e_seg])
        victim = r * n + order[r, rank.clamp(0, n - 1)]
        fill_at = torch.where(fill, victim, hot.scratch)
        hot.pos[fill_at] = e_pos
        hot.stamp[fill_at] = stamp
        found = torch.where(fill, victim, found)
    else:
        fill = torch.zeros_like(miss)
    transient = miss & ~fill

    kind, local = classify(on_page, page_row, in_step, in_win, hit | fill, transient, found, e_seg, e_pos, r,
                           step_start, step_row0, window, sinks)
    miss_dest = torch.where(fill[miss_idx], found[miss_idx], EMPTY)
    n_unique, n_transient, n_resident = torch.stack((head.sum(), transient.sum(), (head & on_page).sum())).tolist()
    return Plan(keys, kind, local, torch.cumsum(miss.long(), 0) - 1, e_seg[miss_idx], e_pos[miss_idx], miss_dest,
                n_unique, n_transient, n_resident)


def classify(on_page: torch.Tensor, page_row: torch.Tensor, in_step: torch.Tensor, in_win: torch.Tensor,
             in_hot: torch.Tensor, transient: torch.Tensor, found: torch.Tensor, e_seg: torch.Tensor,
             e_pos: torch.Tensor, r: torch.Tensor, step_start: torch.Tensor, step_row0: torch.Tensor, window: int,
             sinks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan's (kind, local) of every entry from its class (see the module docstring's precedence)."""
    kind = torch.where(on_page, PAGE, torch.where(in_step, STEP, torch.where(in_win, WINDOW, torch.where(
        in_hot, HOT, torch.where(transient, EXTRA, NONE)))))
    local = torch.where(on_page, page_row, torch.where(
        in_step, step_row0[e_seg] + e_pos - step_start[e_seg],
        torch.where(in_win, _window_index(r, e_pos, window, sinks), torch.where(in_hot, found, 0))))
    return kind, local


def _window_index(slot: torch.Tensor, positions: torch.Tensor, window: int, sinks: int) -> torch.Tensor:
    """DeviceArena.window_index (the window layout's one definition) for a (window, sinks) layout."""
    layout = SimpleNamespace(window=window, sinks=sinks, win_rows=window + sinks)
    return DeviceArena.window_index(layout, slot, positions)
