// Fused lightning-indexer scoring + exact stable top-k (spec §3.6) for CPUs; loaded by indexer_topk.py.
//
// I[t, s] = sum_h w[t, h] * relu(sum_d q[t, h, d] * keys[s, d]) over the first n_visible[t] keys, with exactly
// the arithmetic of hisparse.model.indexer.index_scores: every product and sum rounded on its own (no FMA: built
// with -ffp-contract=off), d summed left to right, heads summed left to right. SIMD lanes are consecutive keys
// (keys are transposed to [dI, G] groups first), so every lane does the scalar sum in that order.
//
// The [T, S] scores are never stored: each row keeps a k-heap of its best keys so far and scans keys in
// ascending position, so a later key enters only with a strictly higher score than the heap's worst (ties go
// to the lower position: the normative order). Heads with w <= 0 can only lower a score (their relu terms are
// <= 0 and rounding is monotone), so the sum over the positive heads alone, in the same order, bounds it: a
// group of keys whose bound is <= the threshold is skipped without computing the other heads, and a row with
// no positive head stops once its threshold reaches 0.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <new>
#include <vector>

#ifdef __AVX__
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

constexpr int64_t TILE_ROWS = 256;   // query rows that scan one cached block of keys in turn

// SIMD width in bytes: a zmm register where the CPU has AVX-512 (twice the keys per instruction), else a ymm one.
// Lanes never mix, so the width changes speed only, never a score.
#ifndef VEC_BYTES
#ifdef __AVX512F__
#define VEC_BYTES 64
#else
#define VEC_BYTES 32
#endif
#endif

template <typename T>
struct Indexer {
    typedef T vec __attribute__((vector_size(VEC_BYTES)));
    typedef decltype(vec{} > vec{}) mask;
    static constexpr int L = VEC_BYTES / sizeof(T);

    static bool any(mask m) {
#if defined(__AVX512F__) && VEC_BYTES == 64
        return _mm512_test_epi32_mask((__m512i)m, (__m512i)m) != 0;
#elif defined(__AVX__) && VEC_BYTES == 32
        return !_mm256_testz_si256((__m256i)m, (__m256i)m);
#else
        for (int i = 0; i < L; ++i)
            if (m[i]) return true;
        return false;
#endif
    }

    static unsigned bits(mask m) {   // lane l set -> bit l (a true lane is all ones: negative as an integer)
#if defined(__AVX512F__) && VEC_BYTES == 64
        if constexpr (sizeof(T) == 4) return _mm512_cmplt_epi32_mask((__m512i)m, _mm512_setzero_si512());
        else return _mm512_cmplt_epi64_mask((__m512i)m, _mm512_setzero_si512());
#elif defined(__AVX__) && VEC_BYTES == 32
        if constexpr (sizeof(T) == 4) return _mm256_movemask_ps((__m256)m);
        else return _mm256_movemask_pd((__m256d)m);
#else
        unsigned b = 0;
        for (int i = 0; i < L; ++i) b |= unsigned(m[i] != 0) << i;
        return b;
#endif
    }

    // A row's running top-k: a binary heap whose root is its worst member (lowest score, then highest position).
    struct Row {
        const T* q;          // [HI, dI]
        const T* w;          // [HI]
        int64_t n;           // visible keys
        T thr;               // the root's score once k keys are in (-inf before): a later key needs more
        int64_t count;       // keys in the heap
        T* score;            // [k]
        int64_t* pos;        // [k]
        bool done;
    };

    int64_t HI, dI, k;

    static bool worse(T a, int64_t pa, T b, int64_t pb) { return a < b || (a == b && pa > pb); }

    // Offer key p (visited in ascending position, so it loses every tie) with score s.
    void push(Row& r, T s, int64_t p) const {
        if (!(s > r.thr)) return;
        int64_t i;
        if (r.count < k) {   // sift up from the new leaf
            for (i = r.count++; i > 0 && worse(s, p, r.score[(i - 1) / 2], r.pos[(i - 1) / 2]); i = (i - 1) / 2)
                r.score[i] = r.score[(i - 1) / 2], r.pos[i] = r.pos[(i - 1) / 2];
        } else {             // replace the root, sift down
            for (i = 0;;) {
                int64_t c = 2 * i + 1;
                if (c >= k) break;
                if (c + 1 < k && worse(r.score[c + 1], r.pos[c + 1], r.score[c], r.pos[c])) ++c;
                if (!worse(r.score[c], r.pos[c], s, p)) break;
                r.score[i] = r.score[c], r.pos[i] = r.pos[c];
                i = c;
            }
        }
        r.score[i] = s, r.pos[i] = p;
        if (r.count == k) r.thr = r.score[0];
    }

    static constexpr int U = 8;          // vectors per group: 8 independent sums in flight
    static constexpr int64_t G = U * L;  // keys per group

    // s[u] = sum over heads hs[0..nh) (nh >= 1, in that order) of w[h] * relu(<q[h], keys>), for the G keys of
    // one group of the key block (kt [dI, G], 64-byte aligned). Heads go two at a time, sharing the key loads.
    void head_sum(const T* q, const T* w, const int64_t* hs, int64_t nh, const T* kt, vec* s) const {
        int64_t i = 0;
        for (; i + 1 < nh; i += 2) {
            const T *qa = q + hs[i] * dI, *qb = q + hs[i + 1] * dI;
            const T wa = w[hs[i]], wb = w[hs[i + 1]];
            for (int half = 0; half < U; half += U / 2) {
                vec a[U / 2], b[U / 2];
                for (int u = 0; u < U / 2; ++u) {
                    vec kv = *(const vec*)(kt + (half + u) * L);
                    a[u] = kv * qa[0];
                    b[u] = kv * qb[0];
                }
                for (int64_t d = 1; d < dI; ++d) {
                    const T* row = kt + d * G + half * L;
                    for (int u = 0; u < U / 2; ++u) {
                        vec kv = *(const vec*)(row + u * L);
                        a[u] = a[u] + kv * qa[d];
                        b[u] = b[u] + kv * qb[d];
                    }
                }
                for (int u = 0; u < U / 2; ++u) {
                    vec ta = (a[u] > T(0) ? a[u] : vec{}) * wa;
                    s[half + u] = i == 0 ? ta : s[half + u] + ta;
                    s[half + u] = s[half + u] + (b[u] > T(0) ? b[u] : vec{}) * wb;
                }
            }
        }
        if (i < nh) {
            const T* qa = q + hs[i] * dI;
            const T wa = w[hs[i]];
            vec a[U];
            for (int u = 0; u < U; ++u) a[u] = *(const vec*)(kt + u * L) * qa[0];
            for (int64_t d = 1; d < dI; ++d)
                for (int u = 0; u < U; ++u) a[u] = a[u] + *(const vec*)(kt + d * G + u * L) * qa[d];
            for (int u = 0; u < U; ++u) {
                vec ta = (a[u] > T(0) ? a[u] : vec{}) * wa;
                s[u] = i == 0 ? ta : s[u] + ta;
            }
        }
    }

    // Score keys [base, base + n_blk) of one row; kt: the block as groups of G keys, each transposed to [dI, G]
    // and zero-padded. pos_heads: the row's n_pos heads with w > 0, in index order; all_heads: 0 .. HI-1.
    void scan(Row& r, const int64_t* pos_heads, int64_t n_pos, const int64_t* all_heads, const T* kt,
              int64_t base, int64_t n_blk) const {
        for (int64_t j = 0; j < n_blk; j += G) {
            vec s[U];
            if (n_pos > 0) {   // bound: the positive heads alone (== the score when every head is positive)
                head_sum(r.q, r.w, pos_heads, n_pos, kt + j * dI, s);
                mask hit = s[0] > r.thr;
                for (int u = 1; u < U; ++u) hit |= s[u] > r.thr;
                if (!any(hit)) continue;
            } else if (!(r.thr < T(0))) {   // every score is <= 0
                continue;
            }
            if (n_pos != HI) head_sum(r.q, r.w, all_heads, HI, kt + j * dI, s);
            for (int u = 0; u < U; ++u)   // lanes above the threshold, in position order
                for (unsigned b = bits(s[u] > r.thr); b; b &= b - 1) {
                    int64_t c = j + u * L + __builtin_ctz(b);
                    if (c < n_blk) push(r, s[u][c - j - u * L], base + c);
                }
        }
    }

    // The row's selected columns, ascending, and their scores; -1 / -inf padded to `width`.
    void finish(Row& r, int64_t* cols, T* scores, int64_t width) const {
        std::vector<int64_t> order(r.count);
        for (int64_t i = 0; i < r.count; ++i) order[i] = i;
        std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return r.pos[a] < r.pos[b]; });
        for (int64_t i = 0; i < width; ++i) {
            cols[i] = i < r.count ? r.pos[order[i]] : -1;
            if (scores) scores[i] = i < r.count ? r.score[order[i]] : -std::numeric_limits<T>::infinity();
        }
    }

    // Keys [b0, b0 + nb) -> kt: groups of G keys, each transposed to [dI, G], zero-padded to whole groups.
    void transpose(const T* keys, int64_t b0, int64_t nb, T* kt) const {
        const int64_t padded = (nb + G - 1) / G * G;
        int64_t j = 0;
#ifdef __AVX__
        if constexpr (sizeof(T) == 4) {   // 8 keys x 8 dims at a time, transposed in registers
            if (dI % 8 == 0)
                for (; j + 8 <= nb; j += 8) {
                    T* dst = kt + (j / G) * G * dI + j % G;
                    for (int64_t d0 = 0; d0 < dI; d0 += 8) {
                        const T* src = keys + (b0 + j) * dI + d0;
                        __m256 r[8], t[8], u[8];
                        for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * dI);
                        for (int i = 0; i < 8; i += 2) {
                            t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
                            t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
                        }
                        for (int i = 0; i < 8; i += 4) {
                            u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
                            u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
                            u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
                            u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
                        }
                        for (int i = 0; i < 4; ++i) {
                            _mm256_store_ps(dst + (d0 + i) * G, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
                            _mm256_store_ps(dst + (d0 + i + 4) * G, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
                        }
                    }
                }
        }
#endif
        for (; j < padded; ++j) {
            const T* src = keys + (b0 + j) * dI;
            T* dst = kt + (j / G) * G * dI + j % G;
            for (int64_t d = 0; d < dI; ++d) dst[d * G] = j < nb ? src[d] : T(0);
        }
    }

    // Rows `rows` of keys [S, dI]: per tile of rows, each block of keys is transposed once into an L1-sized buffer,
    // then scanned by every row of the tile that sees it.
    void run_rows(const T* q, const T* w, const T* keys, const int64_t* n_visible, int64_t width, int64_t* cols,
                  T* scores, const std::vector<int64_t>& rows) const {
        const int64_t kb = std::max<int64_t>(G, ((int64_t(1) << 15) / (dI * sizeof(T))) / G * G);   // ~L1
        std::vector<T> kt_buf(kb * dI + 64 / sizeof(T));   // 64-byte aligned: split loads halve the throughput
        T* kt = (T*)(((uintptr_t)kt_buf.data() + 63) & ~uintptr_t(63));
        std::vector<T> score(TILE_ROWS * k);
        std::vector<int64_t> pos(TILE_ROWS * k), heads(TILE_ROWS * HI), n_pos(TILE_ROWS), all_heads(HI);
        for (int64_t h = 0; h < HI; ++h) all_heads[h] = h;
        std::vector<Row> tile(TILE_ROWS);
        for (size_t t0 = 0; t0 < rows.size(); t0 += TILE_ROWS) {
            int64_t nt = std::min<int64_t>(TILE_ROWS, rows.size() - t0), n_max = 0;
            for (int64_t i = 0; i < nt; ++i) {
                int64_t t = rows[t0 + i];
                Row& r = tile[i];
                r = Row{q + t * HI * dI, w + t * HI, n_visible[t], -std::numeric_limits<T>::infinity(), 0,
                        &score[i * k], &pos[i * k], false};
                n_pos[i] = 0;
                for (int64_t h = 0; h < HI; ++h)
                    if (r.w[h] > T(0)) heads[i * HI + n_pos[i]++] = h;
                n_max = std::max(n_max, r.n);
            }
            for (int64_t b0 = 0; b0 < n_max; b0 += kb) {
                bool needed = false;
                for (int64_t i = 0; i < nt && !needed; ++i)
                    needed = !tile[i].done && tile[i].n > b0;
                if (!needed) break;
                transpose(keys, b0, std::min(kb, n_max - b0), kt);
                for (int64_t i = 0; i < nt; ++i) {
                    Row& r = tile[i];
                    if (r.done || r.n <= b0) continue;
                    if (n_pos[i] == 0 && r.thr >= T(0)) {   // every score is <= 0 <= thr: nothing can enter
                        r.done = true;
                        continue;
                    }
                    scan(r, &heads[i * HI], n_pos[i], all_heads.data(), kt, b0, std::min(kb, r.n - b0));
                }
            }
            for (int64_t i = 0; i < nt; ++i) {
                int64_t t = rows[t0 + i];
                finish(tile[i], cols + t * width, scores ? scores + t * width : nullptr, width);
            }
        }
    }
};

// Top-k columns of every row t among its first n_visible[t] keys; rows are dealt to the threads round-robin.
template <typename T>
int topk(const T* q, const T* w, const T* keys, const int64_t* n_visible, int64_t T_, int64_t HI, int64_t dI,
         int64_t S, int64_t k, int64_t* cols, T* scores, int n_threads) {
    if (HI < 1 || dI < 1 || k < 1) return 1;
    for (int64_t t = 0; t < T_; ++t)
        if (n_visible[t] < 0 || n_visible[t] > S) return 2;
    const int64_t width = std::min(k, S);
    bool oom = false;
#pragma omp parallel num_threads(n_threads)
    {
#ifdef _OPENMP
        int tid = omp_get_thread_num(), nth = omp_get_num_threads();
#else
        int tid = 0, nth = 1;
#endif
        try {
            std::vector<int64_t> rows;   // rows tid, tid + nth, ...: balanced under the causal mask
            for (int64_t t = tid; t < T_; t += nth) rows.push_back(t);
            Indexer<T>{HI, dI, k}.run_rows(q, w, keys, n_visible, width, cols, scores, rows);
        } catch (const std::bad_alloc&) {
#pragma omp atomic write
            oom = true;
        }
    }
    return oom ? 3 : 0;
}

}  // namespace

extern "C" {

// q [T, HI, dI], w [T, HI] (scaled head weights), keys [S, dI] in position order, n_visible [T] -> cols [T, width]
// (width = min(k, S)) and, when not null, scores [T, width]. Returns 0, or 1 / 2 / 3: bad sizes / bad n_visible /
// out of memory.
int indexer_topk_f32(const float* q, const float* w, const float* keys, const int64_t* n_visible, int64_t T,
                     int64_t HI, int64_t dI, int64_t S, int64_t k, int64_t* cols, float* scores, int n_threads) {
    return topk<float>(q, w, keys, n_visible, T, HI, dI, S, k, cols, scores, n_threads);
}

int indexer_topk_f64(const double* q, const double* w, const double* keys, const int64_t* n_visible, int64_t T,
                     int64_t HI, int64_t dI, int64_t S, int64_t k, int64_t* cols, double* scores, int n_threads) {
    return topk<double>(q, w, keys, n_visible, T, HI, dI, S, k, cols, scores, n_threads);
}

}
