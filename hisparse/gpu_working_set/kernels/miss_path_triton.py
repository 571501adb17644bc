"""The miss path in one Triton launch per index group per step: resolve every request's selected positions
against its device slot table (LRU on the device), copy every miss row straight from the host pool into its
slot, and write every query row's arena row indices (-1 padded).

The plan and the LRU updates are those of `resolver.resolve_torch` (the reference): entries are the step's
distinct (segment, position) pairs sorted by key = segment * KEY_SPAN + position (one `torch.sort`, as in the
reference, before the launch); one program per segment walks its entries in position order:
  1. sorts its request's hot table by position (tl.sort) and marks the hot slots hit this step;
  2. classifies every entry (PAGE: on a resident page under hybrid offload, whose stamp it refreshes; STEP,
     WINDOW, hit, miss), refreshes the hits' stamps and ranks the misses;
  3. sorts the request's slots by (stamp, slot id) with the hit slots last: the victims of the misses in order;
  4. fills the victims (position, stamp) and copies each miss row of every member layer from the host pool
     (CUDA: pinned memory mapped into the device address space, read directly over UVA) into its hot slot, or,
     past the free slots, into this step's `extra` rows (a transient miss);
  5. writes the arena row of every selected position of its query rows for every member layer.
Rows move as 32-bit words (every layout's row is a multiple of 4 bytes).

Query rows must be grouped by segment in ascending order (the batch's flat layout): each program finds its rows
by binary search in `seg`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import resolver
from ..resolver import EXTRA, KEY_SPAN, NO_KEY, NONE, HotSlots, PageMap
from ...core.triton_support import launch, next_pow2, require

SLOT_BITS = 20      # a hot slot id packed under a position or a stamp: n_slots < 2^20
# the kernel's constants (Triton reads module globals only as constexpr)
_BITS, _SLOT_MASK = tl.constexpr(SLOT_BITS), tl.constexpr((1 << SLOT_BITS) - 1)
_STEP, _WINDOW, _HOT, _EXTRA, _NONE, _PAGE = (tl.constexpr(v) for v in (
    resolver.STEP, resolver.WINDOW, resolver.HOT, resolver.EXTRA, resolver.NONE, resolver.PAGE))
N_KINDS = resolver.PAGE + 1
_KINDS = tl.constexpr(N_KINDS)
_MISS = tl.constexpr(N_KINDS)   # an entry's kind between the passes: a miss not yet given a slot


@dataclass
class MissPath:
    """The result of one launch: idx [M, n, k] arena rows of every member layer's selected rows (-1: nothing
    selected; >= arena rows: row idx - arena rows of `extra[m]`, a transient miss), extra [M, E + 1, row_bytes]
    uint8 (None when no transient miss is possible), kind/local [E + 1] the plan's entries (as the reference),
    counts [S, 3] per segment its distinct selected positions, its misses and its positions on resident pages
    (device counters: no host read)."""
    idx: torch.Tensor
    extra: torch.Tensor | None
    keys: torch.Tensor
    kind: torch.Tensor
    local: torch.Tensor
    counts: torch.Tensor

    def rows_of(self, seg: torch.Tensor, sel: torch.Tensor, kind_base: torch.Tensor, n_arena_rows: int
                ) -> torch.Tensor:
        """Arena rows (as `idx`) of a selection sel [n', k] of rows seg [n'] that are a subset of the launch's
        rows, for one member layer (kind_base [N_KINDS]): its entries found by key, as `resolver.Plan.locate`."""
        j = torch.searchsorted(self.keys, torch.where(sel >= 0, seg[:, None] * KEY_SPAN + sel, NO_KEY))
        kind, local = self.kind[j], self.local[j]
        rows = torch.where(kind == EXTRA, n_arena_rows + local, kind_base[kind] + local)
        return torch.where(sel >= 0, rows, -1)


def _miss_path_kernel(
        keys_ptr, ent_lo_ptr, row_lo_ptr,                    # [E + 1] sorted keys; [S + 1] entry / query row bounds
        sel_ptr, sel_s0, sel_s1, k,                          # selection [n, k] (strided)
        slot_of_seg_ptr, step_start_ptr, step_row0_ptr,      # [S]
        win_lo_ptr, win_len_ptr, sinks, window,              # [R] resident window [lo, len); its layout
        hot_pos_ptr, hot_stamp_ptr, n_slots, stamp_ptr,      # LRU metadata [R * n_slots + 1]; [] this step's stamp
        pages_ptr, pages_s0, page_tokens,                    # [S, max_pages] host pool page ids
        dev_ptr, dev_s0, page_stamp_ptr,                     # [S, max_dev] device pages (-1: host only); stamps
        pool_ptr, pool_off_ptr,                              # host pool words [rows, W]; [M] a member's first row
        arena_ptr, n_arena_rows, kind_base_ptr, n_members,   # arena words [rows, W]; [M, N_KINDS] region bases
        extra_ptr, n_entries,                                # [M, E + 1, W] transient rows
        ent_kind_ptr, ent_local_ptr,                         # [E + 1] the plan (out)
        sorted_ptr, hit_ptr,                                 # [S, BLOCK_N] scratch
        out_ptr, n_rows, log_e,                              # [M, n, k] arena rows (out); log2(E + 1) rounded up
        counts_ptr,                                          # [S, 3] distinct positions, misses, resident (out)
        W: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr, LOG_N: tl.constexpr,
        BLOCK_E: tl.constexpr, KEY_SPAN_C: tl.constexpr, HAS_PAGES: tl.constexpr):
    s = tl.program_id(0)
    r = tl.load(slot_of_seg_ptr + s)
    start = tl.load(step_start_ptr + s)
    row0 = tl.load(step_row0_ptr + s)
    lo_w = tl.load(win_lo_ptr + r)
    len_w = tl.load(win_len_ptr + r)
    e_lo = tl.load(ent_lo_ptr + s)
    e_hi = tl.load(ent_lo_ptr + s + 1)
    seg_key = s.to(tl.int64) * KEY_SPAN_C
    big = 9223372036854775807
    hot0 = r * n_slots
    stamp = tl.load(stamp_ptr)

    # 1. the request's hot table sorted by (position, slot): a hit is found by binary search
    j = tl.arange(0, BLOCK_N)
    held = tl.load(hot_pos_ptr + hot0 + j, mask=j < n_slots, other=-1)
    by_pos = tl.sort(tl.where(held >= 0, (held << _BITS) | j, big))
    tl.store(sorted_ptr + s * BLOCK_N + j, by_pos)
    tl.store(hit_ptr + s * BLOCK_N + j, tl.zeros([BLOCK_N], tl.int32))
    tl.debug_barrier()

    # 2. classify the entries in position order; hits refresh their stamps; misses are ranked
    n_miss = 0
    n_hit = 0
    n_unique = 0
    n_res = 0
    for t0 in range(e_lo, e_hi, BLOCK_E):
        e = t0 + tl.arange(0, BLOCK_E)
        live = e < e_hi
        key = tl.load(keys_ptr + e, mask=live, other=0)
        prev = tl.load(keys_ptr + e - 1, mask=live & (e > e_lo), other=-1)
        head = live & (key != prev)
        pos = key - seg_key
        if HAS_PAGES:    # a position on a resident page reads its page (and stamps it) whatever else it is
            d = tl.load(dev_ptr + s * dev_s0 + pos // page_tokens, mask=live, other=-1)
        else:
            d = tl.full([BLOCK_E], -1, tl.int64)
        on_page = live & (d >= 0)
        tl.store(page_stamp_ptr + d, tl.zeros([BLOCK_E], tl.int64) + stamp, mask=on_page)
        in_step = (~on_page) & (pos >= start)
        in_win = (~on_page) & (~in_step) & ((pos < sinks) | ((pos >= lo_w) & (pos < len_w)))
        rest = head & (~on_page) & (~in_step) & (~in_win)
        want = pos << _BITS
        base = tl.zeros([BLOCK_E], tl.int32)
        for b in tl.static_range(LOG_N):       # lower bound of want in the sorted hot table
            stride = BLOCK_N >> (b + 1)
            probe = tl.load(sorted_ptr + s * BLOCK_N + base + stride - 1)
            base = tl.where(probe < want, base + stride, base)
        cand = tl.load(sorted_ptr + s * BLOCK_N + tl.minimum(base, BLOCK_N - 1))
        hit = rest & (base < BLOCK_N) & ((cand >> _BITS) == pos) & (cand != big)
        slot = (cand & _SLOT_MASK).to(tl.int64)
        tl.store(hot_stamp_ptr + hot0 + slot, tl.zeros([BLOCK_E], tl.int64) + stamp, mask=hit)
        tl.store(hit_ptr + s * BLOCK_N + slot, tl.zeros([BLOCK_E], tl.int32) + 1, mask=hit)
        miss = rest & ~hit
        rank = n_miss + tl.cumsum(miss.to(tl.int32), 0) - 1
        n_miss += tl.sum(miss.to(tl.int32), 0)
        n_hit += tl.sum(hit.to(tl.int32), 0)
        n_unique += tl.sum(head.to(tl.int32), 0)
        n_res += tl.sum((head & on_page).to(tl.int32), 0)
        win_row = tl.where(pos < sinks, window + pos, tl.where(window > 0, pos % tl.maximum(window, 1), 0))
        kind = tl.where(on_page, _PAGE, tl.where(in_step, _STEP, tl.where(in_win, _WINDOW, tl.where(
            hit, _HOT, tl.where(miss, _MISS, _NONE)))))
        local = tl.where(on_page, d * page_tokens + pos % page_tokens, tl.where(
            in_step, row0 + pos - start, tl.where(in_win, r * (window + sinks) + win_row,
                                                  tl.where(hit, hot0 + slot, tl.where(miss, rank.to(tl.int64), 0)))))
        tl.store(ent_kind_ptr + e, kind.to(tl.int64), mask=live)
        tl.store(ent_local_ptr + e, local, mask=live)
    tl.store(counts_ptr + 3 * s, n_unique.to(tl.int64))
    tl.store(counts_ptr + 3 * s + 1, n_miss.to(tl.int64))
    tl.store(counts_ptr + 3 * s + 2, n_res.to(tl.int64))
    tl.debug_barrier()

    # 3. victims: the slots not hit this step, least recently used first (empty slots first, ties by slot id)
    st = tl.load(hot_stamp_ptr + hot0 + j, mask=j < n_slots, other=0)
    was_hit = tl.load(hit_ptr + s * BLOCK_N + j) != 0
    by_age = tl.sort(tl.where(was_hit | (j >= n_slots), big, ((st + 1) << _BITS) | j))
    tl.store(sorted_ptr + s * BLOCK_N + j, by_age)
    tl.debug_barrier()

    # 4. fill the victims and copy every miss row of every member layer from the host pool
    n_free = n_slots - n_hit
    w = tl.arange(0, BLOCK_W)
    for t0 in range(e_lo, e_hi, BLOCK_E):
        e = t0 + tl.arange(0, BLOCK_E)
        live = e < e_hi
        kind = tl.load(ent_kind_ptr + e, mask=live, other=_NONE)
        miss = live & (kind == _MISS)
        rank = tl.load(ent_local_ptr + e, mask=miss, other=0)
        fill = miss & (rank < n_free)
        victim = tl.load(sorted_ptr + s * BLOCK_N + tl.minimum(rank, BLOCK_N - 1), mask=fill, other=0) & _SLOT_MASK
        pos = tl.load(keys_ptr + e, mask=live, other=0) - seg_key
        # every warp's loads of these entries come before any warp's stores to them: the compiler may load an
        # entry once per register layout, in different warps, and a warp that lags would read the stored kind
        tl.debug_barrier()
        tl.store(hot_pos_ptr + hot0 + victim, pos, mask=fill)
        tl.store(hot_stamp_ptr + hot0 + victim, tl.zeros([BLOCK_E], tl.int64) + stamp, mask=fill)
        tl.store(ent_kind_ptr + e, tl.where(fill, _HOT, _EXTRA).to(tl.int64), mask=miss)
        tl.store(ent_local_ptr + e, tl.where(fill, hot0 + victim, e.to(tl.int64)), mask=miss)
        page = tl.load(pages_ptr + s * pages_s0 + pos // page_tokens, mask=miss, other=0)
        host = page * page_tokens + pos % page_tokens
        cp = miss[:, None] & (w[None, :] < W)
        for m in range(n_members):
            src = (tl.load(pool_off_ptr + m) + host) * W
            row = tl.load(pool_ptr + src[:, None] + w[None, :], mask=cp, other=0)
            hot_row = tl.load(kind_base_ptr + m * _KINDS + _HOT) + hot0 + victim
            dest = tl.where(fill, arena_ptr + hot_row * W, extra_ptr + (m * n_entries + e.to(tl.int64)) * W)
            tl.store(dest[:, None] + w[None, :], row, mask=cp)
        tl.debug_barrier()             # this block's stores before the next block's loads

    # 5. every selected position of this segment's query rows -> its arena row, for every member layer
    q_lo = tl.load(row_lo_ptr + s)
    q_hi = tl.load(row_lo_ptr + s + 1)
    total = (q_hi - q_lo) * k
    for t0 in range(0, total, BLOCK_E):
        t = t0 + tl.arange(0, BLOCK_E)
        live = t < total
        i = q_lo + t // k
        c = t % k
        sel = tl.load(sel_ptr + i.to(tl.int64) * sel_s0 + c * sel_s1, mask=live, other=-1)
        want = seg_key + sel
        base = tl.zeros([BLOCK_E], tl.int64) + e_lo
        length = e_hi - e_lo
        for _ in range(log_e):                 # lower bound of want in keys[e_lo, e_hi)
            half = length // 2
            probe = tl.load(keys_ptr + base + half, mask=live, other=0)
            base = tl.where((half > 0) & (probe < want), base + half, base)
            length -= half
        ent = tl.where(tl.load(keys_ptr + base, mask=live, other=0) < want, base + 1, base)
        kind = tl.load(ent_kind_ptr + ent, mask=live & (sel >= 0), other=_NONE)
        local = tl.load(ent_local_ptr + ent, mask=live & (sel >= 0), other=0)
        for m in range(n_members):
            region = tl.load(kind_base_ptr + m * _KINDS + tl.minimum(kind, _KINDS - 1))
            row = tl.where(kind == _EXTRA, n_arena_rows + local, region + local)
            row = tl.where(sel >= 0, row, -1)
            tl.store(out_ptr + (m * n_rows + i.to(tl.int64)) * k + c, row, mask=live)


_kernel = triton.jit(_miss_path_kernel)


def miss_path(hot: HotSlots, slot_of_seg: torch.Tensor, step_start: torch.Tensor, step_row0: torch.Tensor,
              win_lo: torch.Tensor, win_len: torch.Tensor, sinks: int, window: int, seg: torch.Tensor,
              sel: torch.Tensor, stamp: torch.Tensor, pages: torch.Tensor, page_tokens: int, pool: torch.Tensor,
              pool_offsets: torch.Tensor, arena: torch.Tensor, kind_base: torch.Tensor,
              max_rows_per_seg: int | None = None, block_e: int = 64, resident: PageMap | None = None) -> MissPath:
    """Resolve sel [n, k] (rows of segments seg [n], ascending) against `hot` (updated in place, as
    `resolver.resolve_torch` updates it), copy the misses of M member layers from pool [rows, B] uint8
    (member m's row i at pool_offsets[m] + i; CUDA: pinned and mapped) into arena [arena rows, B] uint8, and
    return the arena rows of every selected position (see MissPath). stamp: this step's LRU stamp, a 0-dim
    device tensor (a captured launch reads it on replay). kind_base [M, N_KINDS]: each member's region
    bases by kind (`DeviceArena.kind_base`). pages [S, max_pages]: host pool page ids of each segment.
    resident: the resident pages (hybrid offload; their page_tokens are `page_tokens`), None without.
    max_rows_per_seg: the most query rows one segment has (known on the host; None: n), which decides whether
    a transient miss is possible and so whether `extra` is allocated."""
    require(sel)
    n, k = sel.shape
    S, M, B = slot_of_seg.numel(), kind_base.shape[0], arena.shape[1]
    if B % 4 or pool.shape[1] != B:
        raise ValueError(f"row_bytes: pool ({pool.shape[1]}) and arena ({B}) rows must match and be whole words")
    if hot.n_slots >= 1 << SLOT_BITS:
        raise ValueError(f"hot_buffer_tokens: {hot.n_slots} slots exceed the kernel's {1 << SLOT_BITS}")
    dev = sel.device
    keys = torch.where(sel >= 0, seg[:, None] * KEY_SPAN + sel, NO_KEY).flatten()
    keys, _ = torch.sort(torch.cat((keys, keys.new_full((1,), NO_KEY))))                   # [E + 1]
    bounds = torch.arange(S + 1, dtype=torch.long, device=dev)
    ent_lo = torch.searchsorted(keys, bounds * KEY_SPAN)
    row_lo = torch.searchsorted(seg.contiguous(), bounds)
    E1 = keys.numel()
    # a transient miss needs more distinct misses in one segment than its free slots: impossible when no
    # segment selects more positions than there are slots (decode with hot_buffer_tokens >= k)
    transient = (n if max_rows_per_seg is None else max_rows_per_seg) * k > hot.n_slots
    extra = torch.empty(M, E1 if transient else 1, B, dtype=torch.uint8, device=dev)
    kind = torch.full((E1,), NONE, dtype=torch.long, device=dev)
    local = torch.zeros(E1, dtype=torch.long, device=dev)
    block_n = max(2, next_pow2(hot.n_slots))
    sorted_scratch = torch.empty(S, block_n, dtype=torch.long, device=dev)
    hit_scratch = torch.empty(S, block_n, dtype=torch.int32, device=dev)
    idx = torch.empty(M, n, k, dtype=torch.long, device=dev)
    counts = torch.zeros(S, 3, dtype=torch.long, device=dev)
    dev_pages, page_stamp = (pages, counts) if resident is None else (resident.dev.contiguous(), resident.stamp)
    W = B // 4
    if S and n and k:
        launch(_kernel, (S,),
            keys, ent_lo, row_lo, sel, sel.stride(0), sel.stride(1), k,
            slot_of_seg.contiguous(), step_start.contiguous(), step_row0.contiguous(), win_lo.contiguous(),
            win_len.contiguous(), sinks, window, hot.pos, hot.stamp, hot.n_slots, stamp,
            pages.contiguous(), pages.shape[1], page_tokens, dev_pages, dev_pages.shape[1], page_stamp,
            pool.view(torch.int32), pool_offsets.contiguous(), arena.view(torch.int32), arena.shape[0],
            kind_base.contiguous(), M,
            extra.view(torch.int32), extra.shape[1], kind, local, sorted_scratch, hit_scratch, idx, n, E1.bit_length(),
            counts,
            W=W, BLOCK_W=next_pow2(W), BLOCK_N=block_n, LOG_N=block_n.bit_length() - 1, BLOCK_E=block_e,
            KEY_SPAN_C=KEY_SPAN, HAS_PAGES=resident is not None)
    return MissPath(idx, extra if transient else None, keys, kind, local, counts)

