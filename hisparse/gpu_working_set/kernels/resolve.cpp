// Fused CPU resolver: hisparse/gpu_working_set/resolver.py `resolve` (the torch reference) in one pass over the
// step's sorted entries. Same Plan, same updates to the HotSlots tensors (including the scratch entry that the
// torch path's masked scatters write), for inputs that path accepts; single-threaded.
//
// Entries (key = segment << 40 | position, sorted, then NO_KEY) come in runs of one segment each, and each
// segment is one request slot r (checked), so the LRU update of r depends only on its own run: a position on a
// resident page (hybrid offload: the segment's page map) reads its page, a hash of r's hot buffer finds the hits,
// and the misses take r's least recently used slots not hit this step.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <new>
#include <utility>
#include <vector>

namespace {

constexpr int KEY_SHIFT = 40;                                       // resolver.KEY_SPAN = 1 << 40
constexpr int64_t KEY_MASK = (int64_t(1) << KEY_SHIFT) - 1;
constexpr int64_t NO_KEY = std::numeric_limits<int64_t>::max();
constexpr int64_t EMPTY = -1;
enum Kind : int64_t { STEP = 0, WINDOW = 1, HOT = 2, EXTRA = 3, NONE = 4, PAGE = 5 };
enum Error : int { OK = 0, BAD_SEGMENT = 1, BAD_SLOT = 2, SHARED_SLOT = 3, NO_MEMORY = 4, BAD_PAGE = 5 };

// Python's floor modulo (torch's % on integers).
inline int64_t floor_mod(int64_t a, int64_t b) {
    int64_t m = a % b;
    return (m != 0 && ((m < 0) != (b < 0))) ? m + b : m;
}

// Row of a resident position in the window regions: mirrors DeviceArena.window_index (arena.py), the layout's
// one definition on the torch path.
inline int64_t window_index(int64_t slot, int64_t pos, int64_t window, int64_t sinks) {
    int64_t local = pos < sinks ? window + pos : (window ? floor_mod(pos, window) : 0);
    return slot * (window + sinks) + local;
}

// Open-addressing map position -> flat hot slot, over one request's hot buffer (load factor <= 1/2).
struct SlotMap {
    struct Cell { int64_t pos, slot; };
    std::vector<Cell> cells;
    int shift = 64;

    static uint64_t hash(int64_t p) { return uint64_t(p) * 0x9E3779B97F4A7C15ull; }

    void build(const int64_t* pos, int64_t base, int64_t n) {
        int bits = 4;
        while ((int64_t(1) << bits) < 2 * n) ++bits;
        cells.assign(size_t(1) << bits, Cell{EMPTY, EMPTY});
        shift = 64 - bits;
        const size_t mask = cells.size() - 1;
        for (int64_t j = 0; j < n; ++j) {
            const int64_t p = pos[base + j];
            if (p < 0) continue;                                        // empty slot
            size_t h = hash(p) >> shift;
            while (cells[h].pos != EMPTY) h = (h + 1) & mask;
            cells[h] = {p, base + j};
        }
    }

    int64_t find(int64_t p) const {
        const size_t mask = cells.size() - 1;
        for (size_t h = hash(p) >> shift; cells[h].pos != EMPTY; h = (h + 1) & mask)
            if (cells[h].pos == p) return cells[h].slot;
        return EMPTY;
    }
};

struct Run { int64_t begin, end, seg, slot; };                       // entries [begin, end) of one segment

}  // namespace

extern "C" {

// seg [n_rows], sel [n_rows, k] (-1 padded); slot_of_seg, step_start, step_row0 [n_seg]; win_lo, win_len [n_win];
// hot_pos, hot_stamp [hot_slots * n_slots + 1] (updated in place); seg_pages [n_seg, max_pages] the device page
// of each segment's pages (-1: host only; null: no resident pages), page_stamp [n_pages + 1] (updated in place).
// out [7, n_rows * k + 1]: keys, kind, local, extra, then miss_seg, miss_pos, miss_dest in their first counts[2]
// columns. counts: n_unique, n_transient, n_misses, n_resident. Returns an Error; on BAD_SEGMENT, BAD_SLOT,
// SHARED_SLOT and BAD_PAGE nothing is written to hot_pos/hot_stamp/page_stamp.
int hisparse_resolve(const int64_t* seg, const int64_t* sel, int64_t n_rows, int64_t k,
                     const int64_t* slot_of_seg, const int64_t* step_start, const int64_t* step_row0, int64_t n_seg,
                     const int64_t* win_lo, const int64_t* win_len, int64_t n_win, int64_t sinks, int64_t window,
                     int64_t* hot_pos, int64_t* hot_stamp, int64_t hot_slots, int64_t n_slots, int64_t stamp,
                     const int64_t* seg_pages, int64_t max_pages, int64_t page_tokens, int64_t* page_stamp,
                     int64_t n_pages, int64_t* out, int64_t* counts) {
    try {
        const int64_t E = n_rows * k, width = E + 1;
        int64_t *keys = out, *kind = out + width, *local = out + 2 * width, *extra = out + 3 * width;
        int64_t *miss_seg = out + 4 * width, *miss_pos = out + 5 * width, *miss_dest = out + 6 * width;

        // the sorted keys: valid entries first (the same wrapping arithmetic as the torch path), then NO_KEY
        int64_t m = 0;
        for (int64_t t = 0; t < n_rows; ++t) {
            const uint64_t high = uint64_t(seg[t]) << KEY_SHIFT;
            for (int64_t j = 0; j < k; ++j) {
                const int64_t p = sel[t * k + j];
                if (p >= 0) keys[m++] = int64_t(high + uint64_t(p));
            }
        }
        // selections ascend, so a step whose rows come in segment order is often sorted already
        if (!std::is_sorted(keys, keys + m)) std::sort(keys, keys + m);
        std::fill(keys + m, keys + width, NO_KEY);

        // segment runs, checked before anything is written
        static thread_local std::vector<Run> runs;
        static thread_local std::vector<int64_t> slots;
        runs.clear();
        slots.clear();
        for (int64_t i = 0; i < width && keys[i] != NO_KEY;) {
            const int64_t s = keys[i] >> KEY_SHIFT;                      // floor division, as torch's //
            int64_t e = i + 1;
            while (keys[e] != NO_KEY && (keys[e] >> KEY_SHIFT) == s) ++e;
            if (s < 0 || s >= n_seg) return BAD_SEGMENT;
            const int64_t r = slot_of_seg[s];
            if (r < 0 || r >= n_win || (n_slots && r >= hot_slots)) return BAD_SLOT;
            if (seg_pages) {                                            // the run's pages are mapped and in range
                const int64_t last = (keys[e - 1] & KEY_MASK) / page_tokens;
                if (last >= max_pages) return BAD_PAGE;
                for (int64_t q = 0; q <= last; ++q)
                    if (seg_pages[s * max_pages + q] >= n_pages) return BAD_PAGE;
            }
            runs.push_back({i, e, s, r});
            slots.push_back(r);
            i = e;
        }
        std::sort(slots.begin(), slots.end());
        if (std::adjacent_find(slots.begin(), slots.end()) != slots.end()) return SHARED_SLOT;

        static thread_local SlotMap map;
        static thread_local std::vector<int64_t> hits, misses, order;
        static thread_local std::vector<std::pair<int64_t, int64_t>> lru;   // (stamp, slot) of the victims
        int64_t n_unique = 0, n_transient = 0, n_miss = 0, n_resident = 0;
        for (const Run& run : runs) {
            const int64_t s = run.seg, r = run.slot, start = step_start[s], row0 = step_row0[s];
            const int64_t lo = win_lo[r], len = win_len[r], base = r * n_slots;
            bool mapped = false;
            hits.clear();
            misses.clear();
            for (int64_t i = run.begin; i < run.end; ++i) {
                const int64_t key = keys[i], p = key & KEY_MASK;        // floor modulo, as torch's %
                const bool head = i == 0 || keys[i - 1] != key;
                n_unique += head;
                kind[i] = NONE;
                local[i] = 0;
                const int64_t d = seg_pages ? seg_pages[s * max_pages + p / page_tokens] : EMPTY;
                if (d >= 0) {
                    kind[i] = PAGE;
                    local[i] = d * page_tokens + p % page_tokens;
                    page_stamp[d] = stamp;
                    n_resident += head;
                } else if (p >= start) {
                    kind[i] = STEP;
                    local[i] = row0 + p - start;
                } else if (p < sinks || (p >= lo && p < len)) {
                    kind[i] = WINDOW;
                    local[i] = window_index(r, p, window, sinks);
                } else if (head) {
                    int64_t found = EMPTY;
                    if (n_slots) {
                        if (!mapped) map.build(hot_pos, base, n_slots), mapped = true;
                        found = map.find(p);
                    }
                    if (found >= 0) {
                        kind[i] = HOT;
                        local[i] = found;
                        hits.push_back(found - base);
                    } else {
                        misses.push_back(i);
                        ++n_miss;
                    }
                }
                extra[i] = n_miss - 1;                                  // cumsum(miss) - 1
            }
            // misses take the least recently used slots not hit this step (empty slots first, ties by slot),
            // in position order; the rest are transient. As on the torch path, the order is over (stamp, slot)
            // with the hit slots' stamps at NO_KEY: with T the n_fill-th smallest stamp, the victims are the
            // slots below T by (stamp, slot), then the first slots at T
            const int64_t n_fill = std::min<int64_t>(misses.size(), n_slots - int64_t(hits.size()));
            if (n_fill > 0) {
                for (int64_t j : hits) hot_stamp[base + j] = NO_KEY;
                const int64_t* st = hot_stamp + base;
                order.resize(n_slots);
                int64_t n_below = 0;                                    // stamps below NO_KEY (the hits' stamp)
                for (int64_t j = 0; j < n_slots; ++j) order[n_below] = st[j], n_below += st[j] != NO_KEY;
                int64_t T = NO_KEY;
                if (n_fill <= n_below) {
                    std::nth_element(order.begin(), order.begin() + (n_fill - 1), order.begin() + n_below);
                    T = order[n_fill - 1];
                }
                lru.resize(n_slots);
                int64_t n_lru = 0;
                for (int64_t j = 0; j < n_slots; ++j) lru[n_lru] = {st[j], j}, n_lru += st[j] < T;
                std::sort(lru.begin(), lru.begin() + n_lru);
                for (int64_t j = 0; n_lru < n_fill; ++j)
                    if (st[j] == T) lru[n_lru++] = {T, j};
            }
            for (int64_t j : hits) hot_stamp[base + j] = stamp;
            const int64_t m0 = n_miss - int64_t(misses.size());
            for (int64_t q = 0; q < int64_t(misses.size()); ++q) {
                const int64_t i = misses[q], p = keys[i] & KEY_MASK;
                miss_seg[m0 + q] = s;
                miss_pos[m0 + q] = p;
                if (q < n_fill) {
                    const int64_t victim = base + lru[q].second;
                    hot_pos[victim] = p;
                    hot_stamp[victim] = stamp;
                    kind[i] = HOT;
                    local[i] = miss_dest[m0 + q] = victim;
                } else {
                    kind[i] = EXTRA;
                    miss_dest[m0 + q] = EMPTY;
                    ++n_transient;
                }
            }
        }
        const int64_t tail = runs.empty() ? 0 : runs.back().end;       // NO_KEY entries
        std::fill(kind + tail, kind + width, NONE);
        std::fill(local + tail, local + width, 0);
        std::fill(extra + tail, extra + width, n_miss - 1);

        // the torch path's masked scatters land in the scratch entry: every one writes the stamp, the last fill
        // scatter (run when a slot exists and something missed) the NO_KEY entry's position, 0
        const int64_t scratch = hot_slots * n_slots;
        hot_stamp[scratch] = stamp;
        if (n_slots && n_miss) hot_pos[scratch] = 0;
        if (seg_pages) page_stamp[n_pages] = stamp;                     // (every non-resident entry's scatter)
        counts[0] = n_unique;
        counts[1] = n_transient;
        counts[2] = n_miss;
        counts[3] = n_resident;
        return OK;
    } catch (const std::bad_alloc&) {
        return NO_MEMORY;
    }
}

}  // extern "C"
