// Fused lightning-indexer scoring + exact stable top-k (spec §3.6) for CPUs; loaded by indexer_topk.py.
//
// I[t, s] = sum_h w[t, h] * relu(sum_d q[t, h, d] * key_s[d]) over the first n_visible[t] keys, with exactly
// the arithmetic of hisparse.model.indexer.index_scores: every product and sum rounded on its own (no FMA: built
// with -ffp-contract=off), d summed left to right, heads summed left to right. SIMD lanes are consecutive keys
// (keys are transposed to [dI, G] groups first), so every lane does the scalar sum in that order.
//
// The [T, S] scores are never stored: each row keeps a k-heap of its best keys so far and scans keys in
// ascending position, so a later key enters only with a strictly higher score than the heap's worst (ties go
// to the lower position: the normative order). Heads with w <= 0 can only lower a score (their relu terms are
// <= 0 and rounding is monotone), so the sum over the positive heads alone, in the same order, bounds it: a
// group of keys whose bound is <= the threshold is skipped without computing the other heads, and a row with
// no positive head stops once its threshold reaches 0. Once a row's heap is full, groups are first scored with
// explicit FMA intrinsics (an approximation within a rigorous bound of the exact score, see scan), and only the
// vectors that come within that bound of the threshold are scored exactly: selections and scores are unchanged.
//
// Where the CPU has AMX (bf16 tiles) and HI x dI is large enough to pay, the filter of full rows is a tile product
// instead (amx_block): 32 / HI rows (all their heads: two tiles of 16 rows) against 32 keys per step, q and keys
// rounded to bf16, sums in fp32, so each (row, key) costs a few instructions instead of HI x dI FMAs. Its error
// bound (filter_slack) is wider than the FMA filter's, so more vectors are scored exactly; selections and scores
// are the exact ones either way.
//
// Where the AMX filter does not run, the filter of full rows is a dot filter in vectors (dp_sum). With AVX512_VNNI
// it multiplies int8: VPDPBUSD multiplies a broadcast quad of q~'s dims (q rounded to int8 per head, times one
// scale) by 16 keys' int8 quads (the block's keys converted once, one scale per block) and adds the four products
// to each key's int32 sum, exactly, so a 16-key vector costs HI x dI / 4 instructions per row. Without it
// (-DDPINT8=0), VDPBF16PS does the same with bf16 pairs into fp32 sums (HI x dI / 2), the tile filter's
// arithmetic. The heads' ReLU'd dots are then summed with FMA, and the vectors within the bound of the threshold
// are scored exactly.
//
// Keys are paged: each query row belongs to a segment (a request), whose logical key j lives in a shared arena
// at row table[seg][j / page_tokens] * page_tokens + j % page_tokens. Only the key addressing depends on it: a
// block of keys is gathered through the page table while it is transposed, and scores and positions are those
// of the logical keys. One contiguous keys array is the single segment with one page of all its keys.
//
// Keys may instead be the fp8 index cache's records (hisparse/kv/index_cache.py): dI x e4m3 bytes then one
// fp32 power-of-two scale per key. A block of them is decoded (e4m3 x scale, exact in float and double) into a
// per-thread buffer as it is gathered, then scored exactly as plain keys of those values.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <tuple>
#include <utility>
#include <vector>

#ifdef __AVX__
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

// The AMX filter: with AVX-512 lanes (a tile row of 16 fp32 scores is one vector), unless filters are off or
// -DAMX=0 (benchmarks). It also needs the kernel's permission to use tile data, asked for once (amx_ready).
#ifndef AMX
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__linux__) && \
    (!defined(FILTER) || FILTER) && (!defined(VEC_BYTES) || VEC_BYTES == 64)
#define AMX 1
#else
#define AMX 0
#endif
#endif
#if AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif
// The dot filter: AVX-512 vectors of 16 keys, for rows the AMX filter does not take; with 512-bit lanes and
// AVX512_VNNI (int8, DPINT8) or AVX512_BF16 (bf16, the tile filter's arithmetic), unless filters are off or -DDOT=0
// (benchmarks). -DDPINT8=0 picks bf16 where the CPU has both.
#ifndef DOT
#if (defined(__AVX512BF16__) || defined(__AVX512VNNI__)) && defined(__AVX512F__) && (!defined(FILTER) || FILTER) && \
    (!defined(VEC_BYTES) || VEC_BYTES == 64)
#define DOT 1
#else
#define DOT 0
#endif
#endif
#ifndef DPINT8
#if DOT && defined(__AVX512VNNI__)
#define DPINT8 1
#else
#define DPINT8 0
#endif
#endif
#if DOT && !DPINT8 && !defined(__AVX512BF16__)
#undef DOT
#define DOT 0
#endif

namespace {

// Query rows that scan one cached block of keys in turn: more rows share each gathered, transposed block, while
// their heaps ([rows, k] scores and positions) stay within ~1 MB.
int64_t tile_rows(int64_t k) { return std::clamp<int64_t>((int64_t(1) << 16) / std::max<int64_t>(k, 1), 256, 1024); }

// The value of every fp8 e4m3fn byte (bias 7, no infinities, S.1111.111 is NaN), as torch decodes it.
struct E4M3 {
    float v[256];
    E4M3() {
        for (int b = 0; b < 256; ++b) {
            const int e = (b >> 3) & 0xF, m = b & 7;
            float x = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
            if ((b & 0x7F) == 0x7F) x = std::numeric_limits<float>::quiet_NaN();
            v[b] = (b & 0x80) ? -x : x;
        }
    }
};
const E4M3 E4M3_VALUES;

#if DOT
// The dot filter pays from HI x dI = 32 up (benchmarks/indexer/select.py, one thread, against the FMA filter): in
// bf16, 0.58-0.62x the time with 128 (needle-ml4 at 512k-1M keys), 0.81-0.91x with 32 (the random tiny model); on
// random inputs with 8-16 it gains less (0.91-0.98x). The int8 filter takes the same threshold: 0.79-0.91x the
// bf16 filter's time with 128, 0.88-0.96x with 32. -DDOT_MIN_WORK=1 makes every shape take it (tests).
#ifndef DOT_MIN_WORK
#define DOT_MIN_WORK 32
#endif
#endif

#if AMX
// The tile filter pays where a key's FMA dots are long: with HI x dI = 128 (needle-ml4's indexer) it scans
// 1.4-2.7x as fast as the FMA filter, with 32 (the random tiny model: dI = 16 fills half a tile row) 0.84-0.89x
// as fast (benchmarks/indexer/select.py).
constexpr int64_t AMX_MIN_WORK = 128;

// Linux hands out AMX tile state on request (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA), once per process.
bool amx_ready() {
    static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return ok;
}

// The tile shapes: every tile 16 rows of 64 bytes (16 fp32 scores, or 32 bf16 of a row of q or a key pair row).
struct TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
    TileConfig() {
        for (int t = 0; t < 8; ++t) colsb[t] = 64, rows[t] = 16;
    }
};
#endif

#if AMX || DOT

// fp32 -> bf16, rounded to nearest even (NaN stays NaN; denormals kept): within 2^-8 relative of x (8-bit
// significands) for normal values.
uint16_t bf16(float x) {
    uint32_t b;
    std::memcpy(&b, &x, sizeof b);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((b >> 16) | 0x40);
    return uint16_t((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

double widen(uint16_t h) {   // bf16 -> its value
    const uint32_t b = uint32_t(h) << 16;
    float x;
    std::memcpy(&x, &b, sizeof x);
    return x;
}
#endif

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
        T slack_q, slack_abs;   // the filter's slack: slack_q * |k| + slack_abs (filter_slack)
        int64_t n_pos;          // heads with w > 0
        int64_t groups, bound_tried, bound_passed;   // filtered groups; those the positive-head bound was tried
                                                     // on, and did not skip
        T bf_q = 0, bf_e = 0, bf_abs = 0;   // the bf16 filters' slack: bf_q |k| + bf_e |k - bf16(k)| + bf_abs
        double a = 0, qmax = 0;     // sum_h |w_h| |q_h| and max_h |q_h|: whether the tile sums stay finite

        // Whether to bound by the positive heads first: it costs n_pos heads per group and saves HI on the groups
        // it skips, judged on the groups it was tried on; tried on every 8th group anyway, as the threshold rises.
        // Speed only: every path selects the same keys.
        bool bound_pays(int64_t HI) {
            return groups++ % 8 == 0 || bound_tried < 8 || (bound_tried - bound_passed) * HI > bound_tried * n_pos;
        }
    };

    int64_t HI, dI, k;
    const uint8_t* records = nullptr;   // fp8 key records [rows, dI + 4] in place of plain keys (nullptr: keys)

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

    // a * b + c: one rounding (FMA) where the CPU has it, else two. Only the filter uses it (see scan).
    static vec fma(vec a, T b, vec c) {
#if defined(__AVX512F__) && VEC_BYTES == 64
        if constexpr (sizeof(T) == 4) return (vec)_mm512_fmadd_ps((__m512)a, _mm512_set1_ps(b), (__m512)c);
        else return (vec)_mm512_fmadd_pd((__m512d)a, _mm512_set1_pd(b), (__m512d)c);
#elif defined(__FMA__) && VEC_BYTES == 32
        if constexpr (sizeof(T) == 4) return (vec)_mm256_fmadd_ps((__m256)a, _mm256_set1_ps(b), (__m256)c);
        else return (vec)_mm256_fmadd_pd((__m256d)a, _mm256_set1_pd(b), (__m256d)c);
#else
        return a * b + c;
#endif
    }

    // Whether to filter (see scan): it pays with FMA, at half the cost of an exact score. -DFILTER=0 turns it off
    // (for benchmarks).
#ifndef FILTER
#define FILTER 1
#endif
#if FILTER && ((defined(__AVX512F__) && VEC_BYTES == 64) || (defined(__FMA__) && VEC_BYTES == 32))
    static constexpr bool filtered = true;
#else
    static constexpr bool filtered = false;
#endif

    // s[u] = sum over heads hs[0..nh) (nh >= 1, in that order) of w[h] * relu(<q[h], keys>), for the G keys of
    // one group of the key block (kt [dI, G], 64-byte aligned). Heads go two at a time, sharing the key loads.
    // Exact (the contract's rounding) unless Fast: then with FMA, within filter_slack of the exact sum.
    template <bool Fast>
    void head_sum(const T* q, const T* w, const int64_t* hs, int64_t nh, const T* kt, vec* s) const {
        auto mad = [](vec a, T b, vec c) { return Fast ? fma(a, b, c) : c + a * b; };
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
                        a[u] = mad(kv, qa[d], a[u]);
                        b[u] = mad(kv, qb[d], b[u]);
                    }
                }
                for (int u = 0; u < U / 2; ++u) {
                    vec ra = a[u] > T(0) ? a[u] : vec{}, rb = b[u] > T(0) ? b[u] : vec{};
                    s[half + u] = i == 0 ? ra * wa : mad(ra, wa, s[half + u]);
                    s[half + u] = mad(rb, wb, s[half + u]);
                }
            }
        }
        if (i < nh) {
            const T* qa = q + hs[i] * dI;
            const T wa = w[hs[i]];
            vec a[U];
            for (int u = 0; u < U; ++u) a[u] = *(const vec*)(kt + u * L) * qa[0];
            for (int64_t d = 1; d < dI; ++d)
                for (int u = 0; u < U; ++u) a[u] = mad(*(const vec*)(kt + d * G + u * L), qa[d], a[u]);
            for (int u = 0; u < U; ++u) {
                vec ra = a[u] > T(0) ? a[u] : vec{};
                s[u] = i == 0 ? ra * wa : mad(ra, wa, s[u]);
            }
        }
    }

    // Adds heads h0 .. h0 + NH - 1 of the exact score of one vector (kv = kt + u * L) to s, in order: NH dot
    // products in flight. NH is a constant so the sums stay in registers (a runtime count spills them to the stack,
    // and every step then waits on a store and a reload).
    template <int NH>
    void exact_heads(const T* q, const T* w, const T* kv, int64_t h0, vec& s) const {
        vec a[NH];
        for (int i = 0; i < NH; ++i) a[i] = *(const vec*)kv * q[(h0 + i) * dI];
        for (int64_t d = 1; d < dI; ++d) {
            vec k = *(const vec*)(kv + d * G);
            for (int i = 0; i < NH; ++i) a[i] = a[i] + k * q[(h0 + i) * dI + d];
        }
        for (int i = 0; i < NH; ++i) {
            vec r = a[i] > T(0) ? a[i] : vec{};
            s = h0 + i == 0 ? r * w[0] : s + r * w[h0 + i];
        }
    }

    // The exact score (all heads, in order) of the L keys of one vector, kv = kt + u * L: heads four at a time.
    vec exact_one(const T* q, const T* w, const T* kv) const {
        vec s{};
        int64_t h0 = 0;
        for (; h0 + 4 <= HI; h0 += 4) exact_heads<4>(q, w, kv, h0, s);
        switch (HI - h0) {
            case 3: exact_heads<3>(q, w, kv, h0, s); break;
            case 2: exact_heads<2>(q, w, kv, h0, s); break;
            case 1: exact_heads<1>(q, w, kv, h0, s); break;
            default: break;
        }
        return s;
    }

    // The dot filter's inputs. A row's q~ (DotRow): words [HI, dp_words()] (bf16 pairs, or int8 quads q8 with
    // q~_h = s_h q8_h, s_h: the head's scale), the int8 sums' offset per head (-128 sum_d q8_hd: the keys are
    // stored as unsigned k8 + 128), and each head's weight (w_h, or fl(w_h s_h) for int8: the block's key scale
    // multiplies it in dp_heads). A block's keys (DotKeys): per 16 keys, dp_words() rows of 16 words (key n: its
    // dims 2p, 2p + 1 or 4p .. 4p + 3 in word n of row p; zero past dI), the int8 keys' scale (k~ = scale k8; 1 for
    // bf16) and ek, the largest |k~ - k| of a key of the block.
    struct DotRow {
        const uint32_t* q;
        const int32_t* off;
        const T* w;
    };
    struct DotKeys {
        const uint32_t* words;
        T scale, ek;
    };

    // Offer the lanes of one vector of scores (keys c0 .. c0 + L - 1 of the block) that beat the threshold.
    void offer(Row& r, vec s, int64_t c0, int64_t n_blk, int64_t base) const {
        for (unsigned b = bits(s > r.thr); b; b &= b - 1) {
            int64_t c = c0 + __builtin_ctz(b);
            if (c < n_blk) push(r, s[c - c0], base + c);
        }
    }

    // Score keys [base, base + n_blk) of one row; kt: the block as groups of G keys, each transposed to [dI, G]
    // and zero-padded; kmax: an upper bound of the block's key norms. pos_heads: the row's n_pos heads with
    // w > 0, in index order; all_heads: 0 .. HI-1.
    //
    // Once the heap is full, a group is first scored over the positive heads with FMA (half the work of the
    // exact sum) and only vectors with a lane above thr - slack are scored exactly: the exact score is at most
    // the positive heads' exact sum, which is within slack/2 of the FMA one (filter_slack), so a skipped key's
    // exact score is <= thr and it could not have entered. Selections and scores stay exact.
    //
    // With the dot filter (dk: the block's keys as dot words, ek their largest residual; dr: the row's q~ words),
    // a full row's group is summed with dp_sum instead, positive heads first (their sum bounds the
    // score: the other heads are added only to the halves of the group, 4 vectors each, that it does not rule
    // out), and the vectors with a lane above thr - its slack (bf_q |k| + bf_e ek + bf_abs) are scored exactly.
    // Rows without a positive head take it too while their threshold is below 0 (at 0 they are done).
    void scan(Row& r, const int64_t* pos_heads, const int64_t* all_heads, const T* kt, int64_t base, int64_t n_blk,
              T kmax, const DotKeys* keys = nullptr, const DotRow* dr = nullptr) const {
        const int64_t n_pos = r.n_pos;
        const T slack = r.slack_q * kmax + r.slack_abs;
        const bool filter = filtered && slack < std::numeric_limits<T>::infinity();   // not for inf / NaN inputs
#if DOT
        const bool dp = keys && bf_fits(r, kmax, keys->ek);
        const T dslack = dp ? r.bf_q * kmax + r.bf_e * keys->ek + r.bf_abs : T(0);
#else
        (void)keys, (void)dr;
#endif
        for (int64_t j = 0; j < n_blk; j += G) {
            const T* g = kt + j * dI;
#if DOT
            if constexpr (sizeof(T) == 4)
                if (dp && r.count == k && (n_pos > 0 || r.thr < T(0))) {   // pos_heads: positive heads, then the rest
                    const __m512 lim = _mm512_set1_ps(r.thr - dslack);
                    const DotRow& q = *dr;
                    const uint32_t* kg = keys->words + j * dp_words();
                    __m512 d[U];
                    int64_t h0 = 0;
                    unsigned halves = 3;   // bit h: vectors 4h .. 4h + 3 still in
                    if (n_pos > 0 && n_pos < HI) {   // the positive heads' sum bounds the score: add the rest
                        dp_sum(q, keys->scale, pos_heads, n_pos, kg, true, d);   // only to the halves it leaves in
                        halves = 0;
                        for (int u = 0; u < U; ++u)
                            if (_mm512_cmp_ps_mask(d[u], lim, _CMP_NLE_UQ)) halves |= 1u << (u / 4);
                        if (!halves) continue;
                        h0 = n_pos;
                    }
                    dp_sum(q, keys->scale, pos_heads + h0, HI - h0, kg, h0 == 0, d, halves);
                    for (int u = 0; u < U; ++u)   // NaN sums (unordered) go on too
                        if (halves >> (u / 4) & 1 && _mm512_cmp_ps_mask(d[u], lim, _CMP_NLE_UQ))
                            offer(r, exact_one(r.q, r.w, g + u * L), j + u * L, n_blk, base);
                    continue;
                }
#endif
            vec s[U];
            if (n_pos == 0) {
                if (!(r.thr < T(0))) continue;   // every score is <= 0
                head_sum<false>(r.q, r.w, all_heads, HI, g, s);
            } else if (filter && r.count == k) {
                const T lim = r.thr - slack;
                if (n_pos < HI && r.bound_pays(HI)) {   // the positive heads' FMA sum bounds the score too
                    head_sum<true>(r.q, r.w, pos_heads, n_pos, g, s);
                    mask hit = s[0] > lim;
                    for (int u = 1; u < U; ++u) hit |= s[u] > lim;
                    ++r.bound_tried;
                    if (!any(hit)) continue;
                    ++r.bound_passed;
                }
                head_sum<true>(r.q, r.w, all_heads, HI, g, s);
                for (int u = 0; u < U; ++u)
                    if (any(s[u] > lim)) offer(r, exact_one(r.q, r.w, g + u * L), j + u * L, n_blk, base);
                continue;
            } else {   // bound: the positive heads alone (== the score when every head is positive)
                head_sum<false>(r.q, r.w, pos_heads, n_pos, g, s);
                mask hit = s[0] > r.thr;
                for (int u = 1; u < U; ++u) hit |= s[u] > r.thr;
                if (!any(hit)) continue;
                if (n_pos != HI) head_sum<false>(r.q, r.w, all_heads, HI, g, s);
            }
            for (int u = 0; u < U; ++u) offer(r, s[u], j + u * L, n_blk, base);   // in position order
        }
    }

#if AMX
    // Rows i0 .. i0 + R - 1 of the tile (R = 32 / HI, or 1 with HI / 16 tile rows each: M = R * HI tile rows,
    // their bf16 queries qb [M, dIp] and keys kb16 in pair rows: per 16 keys [dIp / 2, 16, 2]) against the
    // block's keys, the rows marked in `on` only (their heaps full). Each step, the tile products give every
    // head's dot for 32 keys (tile_step); each row then sums its heads with FMA and scores exactly the vectors
    // that come within its slack of its threshold (tile_sums), in key order. A step's sums are taken after the
    // next step's products are issued (cbuf: two slots of [2, M, 16] fp32), so a tile store is read back a step
    // later, from L1.
    void amx_block(Row* rows, const bool* on, int64_t R, const uint16_t* qb, int64_t dIp, const uint16_t* kb16,
                   const T* kt, int64_t b0, int64_t kb, T kmax, T ek, float* cbuf) const {
        const int64_t M = R * HI;
        int64_t n_chunks = 0;
        for (int64_t i = 0; i < R; ++i)
            if (on[i]) n_chunks = std::max(n_chunks, (std::min(kb, rows[i].n - b0) + 15) / 16);
        const bool resident_a = dIp == 32 && (M == 16 || M == 32);   // A tiles loaded once, in tiles 2 and 5
        if (resident_a) {
            _tile_loadd(2, qb, dIp * 2);
            if (M == 32) _tile_loadd(5, qb + 16 * dIp, dIp * 2);
        }
        const int64_t steps = (n_chunks + 1) / 2;
        for (int64_t st = 0; st <= steps; ++st) {
            if (st < steps) tile_step(qb, dIp, M, resident_a, kb16 + 2 * st * dIp * 16, cbuf + st % 2 * 2 * M * 16);
            if (st > 0) tile_sums(rows, on, R, kt, b0, kb, kmax, ek, 2 * (st - 1), cbuf + (st - 1) % 2 * 2 * M * 16);
        }
    }

    // The dots of all M tile rows with keys 2 x 16 (b: their pair rows) -> c [2, M, 16]. Tiles: 0, 1 and 6, 7
    // results, 2 and 5 queries, 3 and 4 keys.
    void tile_step(const uint16_t* qb, int64_t dIp, int64_t M, bool resident_a, const uint16_t* b, float* c) const {
        const int64_t chunk = dIp * 16;
        if (resident_a) {   // one B tile load serves both A tiles
            _tile_loadd(3, b, 64);
            _tile_loadd(4, b + chunk, 64);
            _tile_zero(0);
            _tile_zero(1);
            _tile_dpbf16ps(0, 2, 3);
            _tile_dpbf16ps(1, 2, 4);
            if (M == 32) {
                _tile_zero(6);
                _tile_zero(7);
                _tile_dpbf16ps(6, 5, 3);
                _tile_dpbf16ps(7, 5, 4);
            }
            _tile_stored(0, c, 64);
            _tile_stored(1, c + M * 16, 64);
            if (M == 32) {
                _tile_stored(6, c + 16 * 16, 64);
                _tile_stored(7, c + (M + 16) * 16, 64);
            }
            return;
        }
        for (int64_t mt = 0; mt < M / 16; ++mt) {
            _tile_zero(0);
            _tile_zero(1);
            for (int64_t j = 0; j < dIp / 32; ++j) {
                _tile_loadd(2, qb + mt * 16 * dIp + j * 32, dIp * 2);
                _tile_loadd(3, b + j * 512, 64);
                _tile_loadd(4, b + chunk + j * 512, 64);
                _tile_dpbf16ps(0, 2, 3);
                _tile_dpbf16ps(1, 2, 4);
            }
            _tile_stored(0, c + mt * 16 * 16, 64);
            _tile_stored(1, c + (M + mt * 16) * 16, 64);
        }
    }

    // For chunks c0, c0 + 1 of the block (their dots in c [2, M, 16]): each marked row's approximate scores,
    // and the exact ones of the vectors within its slack of its threshold, offered in key order.
    void tile_sums(Row* rows, const bool* on, int64_t R, const T* kt, int64_t b0, int64_t kb, T kmax, T ek,
                   int64_t c0, const float* c) const {
        const int64_t M = R * HI;
        for (int64_t i = 0; i < R; ++i) {
            if (!on[i]) continue;
            Row& r = rows[i];
            const int64_t n_blk = std::min(kb, r.n - b0);
            const T slack = r.bf_q * kmax + r.bf_e * ek + r.bf_abs;
            const float* cr = c + i * HI * 16;
            __m512 sum[2];
            for (int e = 0; e < 2; ++e, cr += M * 16) {   // both chunks first: two independent chains
                sum[e] = _mm512_mul_ps(_mm512_max_ps(_mm512_load_ps(cr), _mm512_setzero_ps()), _mm512_set1_ps(r.w[0]));
                for (int64_t h = 1; h < HI; ++h)
                    sum[e] = _mm512_fmadd_ps(_mm512_max_ps(_mm512_load_ps(cr + h * 16), _mm512_setzero_ps()),
                                             _mm512_set1_ps(r.w[h]), sum[e]);
            }
            for (int64_t cc = c0; cc < c0 + 2 && cc * 16 < n_blk; ++cc)   // NaN sums (unordered) go on too
                if (_mm512_cmp_ps_mask(sum[cc - c0], _mm512_set1_ps(r.thr - slack), _CMP_NLE_UQ))
                    offer(r, exact_one(r.q, r.w, kt + cc / U * G * dI + cc % U * L), cc * 16, n_blk, b0);
        }
    }

    // Whether a full row's block may go through amx_block (see bf_fits).
    bool amx_fits(const Row& r, T kmax, T ek) const { return r.count == k && !r.done && bf_fits(r, kmax, ek); }
#endif

#if AMX || DOT
    // Whether a row's block may go through a bf16 filter: its slack is finite and its fp32 sums cannot overflow
    // (|q_h| |k| and sum_h |w_h| |q_h| |k| far below the fp32 range); else it takes the FMA filter.
    bool bf_fits(const Row& r, T kmax, T ek) const {
        const double big = std::ldexp(1.0, 60);
        return r.qmax <= big && double(kmax) <= big && r.a * double(kmax) <= big * big &&
               r.bf_q * kmax + r.bf_e * ek + r.bf_abs < std::numeric_limits<T>::infinity();
    }

    // The block's keys (kt: groups of G, each [dI, G], zero-padded) -> kb16: per 16 keys, dIp / 2 pair rows of
    // (key n: dims 2p, 2p + 1) in bf16, zero past dI: the B tiles of amx_block (dIp: dI padded to 32), or
    // dp_sum's key vectors (dIp: dI padded to even). Returns the largest rounding
    // residual |k~ - k| of a key of the block (rounded up).
    T to_pairs(const T* kt, int64_t nb, int64_t dIp, uint16_t* kb16) const {
        const int64_t n_chunks = (nb + G - 1) / G * (G / 16);
        double e2[16], worst = 0;
        for (int64_t c = 0; c < n_chunks; ++c) {
            const T* g = kt + c * 16 / G * G * dI + c * 16 % G;
            uint16_t* out = kb16 + c * dIp * 16;
            std::fill(e2, e2 + 16, 0.0);
            for (int64_t d = 0; d < dIp; ++d)
                for (int64_t n = 0; n < 16; ++n) {
                    const uint16_t b = d < dI ? bf16(float(g[d * G + n])) : 0;
                    out[d / 2 * 32 + n * 2 + d % 2] = b;
                    if (d < dI) e2[n] += (widen(b) - double(g[d * G + n])) * (widen(b) - double(g[d * G + n]));
                }
            for (int n = 0; n < 16; ++n) worst = std::max(worst, e2[n]);
        }
        return T(std::sqrt(worst) * (1 + 1e-6));
    }
#endif

#if DOT
    // The words per head or key: dims padded to a multiple of 4 (int8 quads) or 2 (bf16 pairs), over 4 or 2.
    int64_t dp_words() const { return DPINT8 ? (dI + 3) / 4 : (dI + 1) / 2; }

#if DPINT8
    // The int8 scale of n values: max |x| / 127, so that x / scale rounds into -127 .. 127 (0 when every x is
    // 0); NaN when one is not finite (the bound is then not finite, and the FMA filter runs: bf_fits).
    static float int8_scale(const T* x, int64_t n) {
        const float big = std::numeric_limits<float>::max();
        float m = 0;
        bool bad = false;
        int64_t i = 0;
        if constexpr (sizeof(T) == 4) {
            __m512 mv = _mm512_setzero_ps();
            __mmask16 b = 0;
            for (; i + 16 <= n; i += 16) {
                const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + i));
                b |= _mm512_cmp_ps_mask(a, _mm512_set1_ps(big), _CMP_NLE_UQ);
                mv = _mm512_max_ps(mv, a);
            }
            m = _mm512_reduce_max_ps(mv), bad = b;
        }
        for (; i < n; ++i) {
            const float a = std::abs(float(x[i]));
            bad |= !(a <= big), m = std::max(m, a);
        }
        return bad ? std::numeric_limits<float>::quiet_NaN() : m / 127;
    }

    // x as a multiple of scale, rounded (x~ = scale * the result): 0 when scale is not > 0.
    static int32_t int8_of(T x, float scale) {
        return scale > 0 ? int32_t(std::clamp(std::nearbyint(float(x) / scale), -127.0f, 127.0f)) : 0;
    }

    // The block's keys (kt: groups of G, each [dI, G], zero-padded) -> kw: quads of unsigned k8 + 128 (as
    // DotKeys), one scale for the block; 16 keys at a time, as int8_of does one. Returns (scale, the largest
    // |k~ - k|, rounded up; infinite for keys that are not finite).
    std::pair<T, T> to_quads(const T* kt, int64_t nb, uint32_t* kw) const {
        if constexpr (sizeof(T) == 4) {
            const int64_t n_chunks = (nb + G - 1) / G * (G / 16), W = dp_words();
            const float scale = int8_scale(kt, n_chunks * 16 * dI);
            if (!(scale >= 0)) return {T(0), std::numeric_limits<T>::infinity()};
            const __m512 sc = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-127), hi = _mm512_set1_ps(127);
            const __m512d scd = _mm512_set1_pd(scale);
            double worst = 0;
            for (int64_t c = 0; c < n_chunks; ++c) {
                const T* g = kt + c * 16 / G * G * dI + c * 16 % G;
                __m512d e2a = _mm512_setzero_pd(), e2b = _mm512_setzero_pd();   // keys 0-7, 8-15
                for (int64_t p = 0; p < W; ++p) {
                    __m512i word = _mm512_setzero_si512();
                    for (int64_t e = 0; e < 4; ++e) {
                        const int64_t d = 4 * p + e;
                        __m512i v = _mm512_setzero_si512();
                        if (d < dI && scale > 0) {
                            const __m512 x = _mm512_load_ps(g + d * G);
                            const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(x, sc), _MM_FROUND_TO_NEAREST_INT |
                                                                                          _MM_FROUND_NO_EXC);
                            v = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));
                            const __m512d ea = _mm512_sub_pd(
                                _mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_castsi512_si256(v)), scd),
                                _mm512_cvtps_pd(_mm512_castps512_ps256(x)));
                            const __m512d eb = _mm512_sub_pd(
                                _mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(v, 1)), scd),
                                _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1))));
                            e2a = _mm512_add_pd(e2a, _mm512_mul_pd(ea, ea));
                            e2b = _mm512_add_pd(e2b, _mm512_mul_pd(eb, eb));
                        }
                        const __m512i b = _mm512_and_si512(_mm512_add_epi32(v, _mm512_set1_epi32(128)),
                                                           _mm512_set1_epi32(0xFF));
                        word = _mm512_or_si512(word, _mm512_slli_epi32(b, unsigned(8 * e)));
                    }
                    _mm512_store_si512(kw + (c * W + p) * 16, word);
                }
                worst = std::max({worst, _mm512_reduce_max_pd(e2a), _mm512_reduce_max_pd(e2b)});
            }
            return {T(scale), T(std::sqrt(worst) * (1 + 1e-6))};
        } else {   // fp32 rows only
            return {T(0), std::numeric_limits<T>::infinity()};
        }
    }
#endif

    // The dot filter's sums for NH heads hs[0 .. NH) and V vectors of 16 keys: per head, the dot of q~_h (q.q
    // [HI, W] words) with each key's words (kg: V vectors cs words apart, each [W, 16]), one instruction per word,
    // a q word broadcast against 16 keys: VPDPBUSD (int8: four exact products into an int32 sum, then the head's
    // offset, which removes the keys' +128) or VDPBF16PS (bf16: two into an fp32 sum); then s[v] = FMA sum
    // of w_h relu(dot_h) over the heads in order (int8: fl(w_h s_h) times the keys' scale, times relu of the exact
    // integer dot, converted exactly), after s[v]'s own value unless `first`. SP = 2 splits each dot into two sums
    // (even and odd words) added at the end, so that 12-16 sums are in flight where NH x V is 4 or 8 (the
    // instruction's latency is several of its issue slots). ReLU as max(0, dot): a NaN bf16 dot stays NaN, so its
    // keys are scored exactly.
    template <int NH, int V, int SP>
    void dp_heads(const DotRow& q, int64_t W, T scale, const int64_t* hs, const uint32_t* kg, int64_t cs, bool first,
                  __m512* s) const {
#if DPINT8
        __v16si a[SP][NH][V];   // int32 lanes (as __m512i, GCC copies each sum around every instruction)
#else
        __m512 a[SP][NH][V];
#endif
        const uint32_t* qh[NH];
        for (int i = 0; i < NH; ++i) {
            qh[i] = q.q + hs[i] * W;
            for (int v = 0; v < V; ++v)
                for (int e = 0; e < SP; ++e)
#if DPINT8
                    a[e][i][v] = __v16si{};
#else
                    a[e][i][v] = _mm512_setzero_ps();
#endif
        }
        auto step = [&](int64_t p, int e) {
            __m512i kv[V];
            for (int v = 0; v < V; ++v) {
                __m512i x = _mm512_load_si512(kg + v * cs + p * 16);
                __asm__("" : "+v"(x));   // kept in a register for all NH heads (GCC would reload it per head)
                kv[v] = x;
            }
            for (int i = 0; i < NH; ++i) {
                const __m512i qv = _mm512_set1_epi32(int(qh[i][p]));
                for (int v = 0; v < V; ++v)
#if DPINT8
                    a[e][i][v] = (__v16si)_mm512_dpbusd_epi32((__m512i)a[e][i][v], kv[v], qv);   // unsigned keys,
                                                                                                // signed q
#else
                    a[e][i][v] = _mm512_dpbf16_ps(a[e][i][v], (__m512bh)qv, (__m512bh)kv[v]);
#endif
            }
        };
        int64_t p = 0;
        for (; p + SP <= W; p += SP)
            for (int e = 0; e < SP; ++e) step(p + e, e);
        for (; p < W; ++p) step(p, 0);
        for (int i = 0; i < NH; ++i) {
            const __m512 wv = _mm512_set1_ps(float(q.w[hs[i]] * scale));
            for (int v = 0; v < V; ++v) {
#if DPINT8
                const __v16si dot = (SP == 2 ? a[0][i][v] + a[SP - 1][i][v] : a[0][i][v]) + q.off[hs[i]];
                const __m512 r = _mm512_cvtepi32_ps(_mm512_max_epi32((__m512i)dot, _mm512_setzero_si512()));
#else
                const __m512 dot = SP == 2 ? _mm512_add_ps(a[0][i][v], a[SP - 1][i][v]) : a[0][i][v];
                const __m512 r = _mm512_max_ps(_mm512_setzero_ps(), dot);
#endif
                s[v] = first && i == 0 ? _mm512_mul_ps(r, wv) : _mm512_fmadd_ps(r, wv, s[v]);
            }
        }
    }

    // s[u] (u < U = 8: the vectors of one group; kg: its key words) = the FMA sum over heads hs[0 .. nh) of
    // w_h relu(dot~_h), after s[u]'s own value unless `first`: within filter_slack's dot-filter bound of the exact
    // sum over those heads. Only the halves of the group (vectors 0-3, 4-7) set in `halves` (bits 0, 1). Up to 4
    // heads per pass, 12-16 sums in flight, each key vector loaded once per pass.
    void dp_sum(const DotRow& q, T scale, const int64_t* hs, int64_t nh, const uint32_t* kg, bool first, __m512* s,
                unsigned halves = 3) const {
        static_assert(U == 8, "dp_sum covers a group as 2 x 4 or 8 vectors");
        const int64_t W = dp_words(), cs = W * 16;
        for (int64_t i = 0; i < nh;) {
            const bool f = first && i == 0;
            const int64_t n = std::min<int64_t>(nh - i, 4);
            if (n <= 2 && halves == 3) {
                if (n == 1) dp_heads<1, 8, 2>(q, W, scale, hs + i, kg, cs, f, s);
                else dp_heads<2, 8, 1>(q, W, scale, hs + i, kg, cs, f, s);
            } else {
                for (int hf = 0; hf < 2; ++hf)
                    if (halves >> hf & 1) switch (n) {
                        case 1: dp_heads<1, 4, 2>(q, W, scale, hs + i, kg + 4 * hf * cs, cs, f, s + 4 * hf); break;
                        case 2: dp_heads<2, 4, 2>(q, W, scale, hs + i, kg + 4 * hf * cs, cs, f, s + 4 * hf); break;
                        case 3: dp_heads<3, 4, 1>(q, W, scale, hs + i, kg + 4 * hf * cs, cs, f, s + 4 * hf); break;
                        default: dp_heads<4, 4, 1>(q, W, scale, hs + i, kg + 4 * hf * cs, cs, f, s + 4 * hf);
                    }
            }
            i += n;
        }
    }
#endif

    // The filter's slack for one row: |FMA sum - exact sum| over any heads is at most
    // sum_h |w_h| sum_d |q_hd k_d| (2 gamma_dI + 2 gamma_HI (1 + gamma_dI)) (Higham's dot-product bound, both
    // ways of rounding), plus underflow; sum_d |q_hd k_d| <= |q_h| |k| (Cauchy-Schwarz). Twice that, with a
    // rounded-up u, covers the rounding of the slack itself and of thr - slack: slack = slack_q |k| + slack_abs.
    //
    // The bf16 filters, AMX tiles (amx_block) and VDPBF16PS (dp_sum), round q and the keys to bf16 (q~, k~),
    // treat bf16 denormal inputs as 0, multiply exactly, and sum a head's n = dims products (dI zero-padded: to a
    // multiple of 32 for tiles, to even for VDPBF16PS) in fp32, in an order of the hardware's, flushing denormal
    // results to 0; each row then adds its heads' ReLU'd dots with FMA. Per head and key:
    //  - |q~ . k~ - q . k| <= |q~| |k~ - k| + |q~ - q| |k|: the rounding residuals, measured (a row's per head for
    //    q, the block's largest for its keys);
    //  - the inputs taken as 0 (|x| < 2^-126) drop at most 2^-126 sum_d (|k~_d| + |q~_d|) <= 2^-126 sqrt(dI)
    //    (|k~| + |q~|), and |k~| <= |k| (1 + 2^-8);
    //  - the fp32 sum rounds at most n + 1 times: tiles add n products in n - 1 roundings; VDPBF16PS adds two
    //    products to a lane per instruction, n / 2 instructions, each in one rounding or two (either is covered),
    //    and dp_heads may add two such sums at the end. Every rounding errs by at most 2^-24 of a partial sum,
    //    itself <= sum_d |q~_d k~_d| <= |q~| |k~| <= |q| |k| (1 + 2^-8)^2, so n u |q| |k| (1 + 2^-8)^2 bounds them
    //    all (u = 2^-23: twice the unit roundoff; (n + 1) 2^-24 <= n u);
    //  - flushing loses < 2^-126 at each rounding, and at each product should the hardware round the products
    //    first: (2n + 1) 2^-126 in all.
    // ReLU is 1-Lipschitz, the FMA head sum adds HI u, and the exact score is within (dI + HI) u sum_h |w_h| |q_h|
    // |k| of the real one. The sum B of these bounds, rounded up, is bf_q |k| + bf_e |k~ - k| + bf_abs (times 2
    // for tiles, a margin kept from before; the residual terms, exact by Cauchy-Schwarz, dominate B). B with its
    // (1 + 1e-6) factors is enough for the skip test: scan's lim = fl(thr - slack), slack >= B (1 + 1e-6) after
    // its own roundings, so a skipped key's exact score E <= s + B <= lim + B < thr + 2^-24 |thr|, and the float
    // next above thr lies at least that far: E <= thr, and the key could not have entered.
    //
    // The int8 dot filter (DPINT8, dp_sum) rounds q to q~_h = s_h q8_h per head and the block's keys to k~ = c k8
    // (int8_of), and its integer dots q8_h . k8 are exact, as are their ReLU and their conversion to fp32 (|dot|
    // <= D = dI 127^2 < 2^24). Per head and key:
    //  - the residuals as for bf16: |q~_h . k~ - q_h . k| <= |q~_h| |k~ - k| + |q~_h - q_h| |k|;
    //  - the head's factor fl(fl(w_h s_h) c) is w_h s_h c within two roundings, 2 x 2^-24 relative, and two
    //    underflows, each < 2^-149 (1 + c) with c <= |k| / 127, times relu(dot) <= D;
    //  - the FMA head sum rounds HI times, each within 2^-24 of a partial sum <= sum_h |w_h| |q~_h| |k~|, and
    //    |k~| <= |k| + |k~ - k|, plus 2^-149 where a result underflows;
    //  - the exact score is within (dI + HI) u sum_h |w_h| |q_h| |k| of the real one, as above.
    // u = 2^-23 covers each 2^-24 with its (1 + 2^-24) factors. dims = 0: the row takes no dot or tile filter.
    void filter_slack(Row& r, int64_t dims, bool tiles) const {
        const double u = std::numeric_limits<T>::epsilon();   // 2x the unit roundoff
        double a = 0, wsum = 0, qmax = 0;
        for (int64_t h = 0; h < HI; ++h) {
            double n2 = 0;
            for (int64_t d = 0; d < dI; ++d) n2 += double(r.q[h * dI + d]) * double(r.q[h * dI + d]);
            a += std::abs(double(r.w[h])) * std::sqrt(n2);
            wsum += std::abs(double(r.w[h]));
            qmax = std::max(qmax, std::sqrt(n2));
        }
        const double dm = std::numeric_limits<T>::denorm_min();
        r.slack_q = T(2 * (dI + HI + 2) * u * a * (1 + 1e-6));
        r.slack_abs = T(2 * (wsum + 1) * (2 * dI + 2 * HI + 2) * dm) + std::numeric_limits<T>::denorm_min();
        r.a = a, r.qmax = qmax;
#if AMX || DOT
        if constexpr (sizeof(T) == 4) {
#if DPINT8
            if (dims > 0 && !tiles) {
                double wqt = 0, weq = 0;   // sum_h |w_h| |q~_h|, sum_h |w_h| |q~_h - q_h|
                for (int64_t h = 0; h < HI; ++h) {
                    const float sh = int8_scale(r.q + h * dI, dI);
                    double t2 = 0, e2 = 0;
                    for (int64_t d = 0; d < dI; ++d) {
                        const double x = r.q[h * dI + d], xq = double(int8_of(r.q[h * dI + d], sh)) * sh;
                        t2 += xq * xq, e2 += (xq - x) * (xq - x);
                    }
                    wqt += std::abs(double(r.w[h])) * std::sqrt(t2);
                    weq += std::abs(double(r.w[h])) * std::sqrt(e2);
                }
                const double up = 1 + 1e-6, D = double(dI) * 127 * 127;
                r.bf_q = T((weq + (dI + HI + 2) * u * a + (HI + 3) * u * wqt + HI * dm * D / 64) * up * up);
                r.bf_e = T(wqt * (1 + (HI + 3) * u) * up * up);
                r.bf_abs = T(HI * (D + 2) * dm * up * up) + r.slack_abs;
                return;
            }
#endif
            if (dims > 0) {
                double wqt = 0, weq = 0;   // sum_h |w_h| |q~_h|, sum_h |w_h| |q~_h - q_h|
                for (int64_t h = 0; h < HI; ++h) {
                    double t2 = 0, e2 = 0;
                    for (int64_t d = 0; d < dI; ++d) {
                        const double x = r.q[h * dI + d], xb = widen(bf16(float(x)));
                        t2 += xb * xb, e2 += (xb - x) * (xb - x);
                    }
                    wqt += std::abs(double(r.w[h])) * std::sqrt(t2);
                    weq += std::abs(double(r.w[h])) * std::sqrt(e2);
                }
                const double flush = std::ldexp(1.0, -126), n = double(dims), rd = std::sqrt(double(dI));
                const double g = 1 + std::ldexp(1.0, -8), up = 1 + 1e-6;
                // the parts, per unit of |k| (bf_q), of |k~ - k| (bf_e), and absolute (bf_abs)
                const double resid_q = weq;                                    // |q~ - q| |k|
                const double sums = (n + dI + 2 * HI + 4) * u * a * g * g;     // fp32 sums, head sum, exact score
                const double daz_q = flush * rd * g * wsum;                    // q~'s denormals as 0: |k~|
                const double resid_k = wqt;                                    // |q~| |k~ - k|
                const double daz_k = flush * rd * wqt;                         // k~'s denormals as 0: |q~|
                const double flushes = flush * (2 * n + 1) * wsum;             // denormal results flushed
                const double m = tiles ? 2 : 1;
                r.bf_q = T(m * (resid_q + sums + daz_q) * up * up);
                r.bf_e = T(m * resid_k * up * up);
                r.bf_abs = T(m * (daz_k + flushes) * up * up) + r.slack_abs;
            }
        }
#endif
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

    // kp[j] = the arena row of logical key b0 + j, j < nb, for a segment's page list `pages`: one division per
    // block, then page and offset are stepped (within a page the rows are consecutive).
    void key_ptrs(const T* keys, const int64_t* pages, int64_t page_tokens, int64_t b0, int64_t nb,
                  const T** kp) const {
        int64_t p = b0 / page_tokens, o = b0 % page_tokens;
        const T* row = keys + (pages[p] * page_tokens + o) * dI;
        for (int64_t j = 0; j < nb; ++j) {
            kp[j] = row;
            row += dI;
            if (++o == page_tokens && j + 1 < nb) o = 0, row = keys + pages[++p] * page_tokens * dI;
        }
    }

    // fp8 records of logical keys b0 .. b0 + nb - 1 -> their values in dec [nb, dI]; kp[j] = key j's row there.
    void decode_records(const int64_t* pages, int64_t page_tokens, int64_t b0, int64_t nb, T* dec,
                        const T** kp) const {
        const int64_t stride = dI + 4;
        int64_t p = b0 / page_tokens, o = b0 % page_tokens;
        for (int64_t j = 0; j < nb; ++j) {
            const uint8_t* r = records + (pages[p] * page_tokens + o) * stride;
            float scale;
            std::memcpy(&scale, r + dI, sizeof scale);
            T* out = dec + j * dI;
            for (int64_t d = 0; d < dI; ++d) out[d] = T(E4M3_VALUES.v[r[d]] * scale);
            kp[j] = out;
            if (++o == page_tokens) o = 0, ++p;
        }
    }

    // Keys kp[0 .. nb) -> kt: groups of G keys, each transposed to [dI, G], zero-padded to whole groups.
    void transpose(const T* const* kp, int64_t nb, T* kt) const {
        const int64_t padded = (nb + G - 1) / G * G;
        int64_t j = 0;
#ifdef __AVX__
        if constexpr (sizeof(T) == 4) {   // 8 keys x 8 dims at a time, transposed in registers
            if (dI % 8 == 0)
                for (; j + 8 <= nb; j += 8) {
                    T* dst = kt + (j / G) * G * dI + j % G;
                    const T* const* src = kp + j;   // 8 keys, each through its own pointer (pages may split them)
                    for (int64_t d0 = 0; d0 < dI; d0 += 8) {
                        __m256 r[8], t[8], u[8];
                        for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src[i] + d0);
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
            T* dst = kt + (j / G) * G * dI + j % G;
            if (j < nb)
                for (int64_t d = 0; d < dI; ++d) dst[d * G] = kp[j][d];
            else
                for (int64_t d = 0; d < dI; ++d) dst[d * G] = T(0);
        }
    }

    // An upper bound of the norms of the keys of a transposed block kt of nb keys (computed in double, rounded
    // up): lanes are keys, so the per-key sums (d ascending) vectorise across keys; zero padding adds nothing.
    T max_norm(const T* kt, int64_t nb) const {
        double n2[G], m = 0;
        for (int64_t j = 0; j < nb; j += G) {
            const T* g = kt + j * dI;
            for (int64_t c = 0; c < G; ++c) n2[c] = double(g[c]) * double(g[c]);
            for (int64_t d = 1; d < dI; ++d)
                for (int64_t c = 0; c < G; ++c) n2[c] += double(g[d * G + c]) * double(g[d * G + c]);
            for (int64_t c = 0; c < G; ++c) m = std::max(m, n2[c]);
        }
        return T(std::sqrt(m) * (1 + 1e-6));
    }

    // Rows `rows`, each over its segment's paged keys: per tile of rows (consecutive entries of `rows` of one
    // segment, so they share its keys), each block of keys is gathered and transposed once into an L1-sized
    // buffer, then scanned by every row of the tile that sees it.
    void run_rows(const T* q, const T* w, const T* keys, const int64_t* table, int64_t table_stride,
                  int64_t page_tokens, const int64_t* row_seg, const int64_t* n_visible, int64_t width,
                  int64_t* cols, T* scores, const std::vector<int64_t>& rows) const {
        const int64_t kb = std::max<int64_t>(G, ((int64_t(1) << 15) / (dI * sizeof(T))) / G * G);   // ~L1
        std::vector<T> kt_buf(kb * dI + 64 / sizeof(T));   // 64-byte aligned: split loads halve the throughput
        T* kt = (T*)(((uintptr_t)kt_buf.data() + 63) & ~uintptr_t(63));
        std::vector<const T*> kp(kb);   // the block's keys in the arena (or, for records, in dec)
        std::vector<T> dec(records ? kb * dI : 0);
        const int64_t TILE_ROWS = tile_rows(k);
        std::vector<T> score(TILE_ROWS * k);
        std::vector<int64_t> pos(TILE_ROWS * k), heads(TILE_ROWS * HI), all_heads(HI);
        for (int64_t h = 0; h < HI; ++h) all_heads[h] = h;
        std::vector<Row> tile(TILE_ROWS);
        std::vector<char> amx_rows(TILE_ROWS);   // rows whose block goes through amx_block
        const int64_t n_rows = rows.size();
        bool amx = false;    // the AMX filter runs
        int64_t dims = 0;    // the padded dims of the bf16 filter that runs (filter_slack); 0: none
        (void)amx;
#if AMX
        // the AMX filter: 32 / HI rows per group (two A tiles), or one row of HI / 16 tiles; q and keys in bf16
        amx = sizeof(T) == 4 && (16 % HI == 0 || HI % 16 == 0) && HI * dI >= AMX_MIN_WORK && amx_ready();
        const int64_t R = HI < 16 ? 32 / HI : 1, dIp = (dI + 31) / 32 * 32;
        if (amx) dims = dIp;
        std::vector<uint16_t> qb(amx ? (TILE_ROWS + R) * HI * dIp : 0), kb16(amx ? kb * dIp : 0);
        std::vector<float> c_buf(amx ? 4 * R * HI * 16 + 16 : 0);
        float* cbuf = (float*)(((uintptr_t)c_buf.data() + 63) & ~uintptr_t(63));
        bool on[32];
        if (amx) {
            const TileConfig cfg;
            _tile_loadconfig(&cfg);
        }
#endif
#if DOT
        // the dot filter, where AMX does not run (int8: while an exact integer dot fits fp32, dI <= 1040): the
        // rows' q~ words [HI, W] (qd), int8 offsets (qo) and int8 head weights (qw; bf16 reads the row's w); a block's
        // keys as words per 16 keys [W, 16] (kd, 64-byte aligned)
        const bool dp = sizeof(T) == 4 && !amx && HI * dI >= DOT_MIN_WORK && (!DPINT8 || dI <= 1040);
        const int64_t W = dp_words();
        std::vector<uint32_t> qd(dp ? TILE_ROWS * HI * W : 0), kd_buf(dp ? kb * W + 16 : 0);
        std::vector<int32_t> qo(dp ? TILE_ROWS * HI : 0);
        std::vector<T> qw(dp && DPINT8 ? TILE_ROWS * HI : 0);
        std::vector<DotRow> dot_rows(dp ? TILE_ROWS : 0);
        uint32_t* kd = (uint32_t*)(((uintptr_t)kd_buf.data() + 63) & ~uintptr_t(63));
        if (dp) dims = 2 * W;   // bf16: dI padded to even
#endif
        for (int64_t t0 = 0, nt; t0 < n_rows; t0 += nt) {
            const int64_t seg = row_seg[rows[t0]];
            for (nt = 1; nt < TILE_ROWS && t0 + nt < n_rows && row_seg[rows[t0 + nt]] == seg; ++nt) {}
            const int64_t* pages = table + seg * table_stride;
            int64_t n_max = 0;
            for (int64_t i = 0; i < nt; ++i) {
                int64_t t = rows[t0 + i];
                Row& r = tile[i];
                r = Row{q + t * HI * dI, w + t * HI, n_visible[t], -std::numeric_limits<T>::infinity(), 0,
                        &score[i * k], &pos[i * k], false, T(0), T(0), 0, 0, 0, 0};
                filter_slack(r, dims, amx);
                for (int64_t h = 0; h < HI; ++h)   // the positive heads, then (for dp_sum) the others
                    if (r.w[h] > T(0)) heads[i * HI + r.n_pos++] = h;
                for (int64_t h = 0, m = r.n_pos; h < HI; ++h)
                    if (!(r.w[h] > T(0))) heads[i * HI + m++] = h;
                n_max = std::max(n_max, r.n);
#if AMX
                if (amx)
                    for (int64_t h = 0; h < HI; ++h)
                        for (int64_t d = 0; d < dI; ++d) qb[(i * HI + h) * dIp + d] = bf16(float(r.q[h * dI + d]));
#endif
#if DOT
                if (dp) {
                    uint32_t* words = &qd[i * HI * W];
                    for (int64_t h = 0; h < HI; ++h) {
                        const T* x = r.q + h * dI;
#if DPINT8   // word p of head h: q8 of dims 4p .. 4p + 3 (byte e: dim 4p + e; 0 past dI)
                        const float sh = int8_scale(x, dI);
                        int32_t sum = 0;
                        for (int64_t p = 0; p < W; ++p) {
                            uint32_t word = 0;
                            for (int64_t e = 0; e < 4 && 4 * p + e < dI; ++e) {
                                const int32_t v = int8_of(x[4 * p + e], sh);
                                sum += v, word |= uint32_t(uint8_t(int8_t(v))) << (8 * e);
                            }
                            words[h * W + p] = word;
                        }
                        qo[i * HI + h] = -128 * sum;
                        qw[i * HI + h] = T(float(r.w[h]) * sh);
#else        // word p of head h: bf16 of dims 2p (low half), 2p + 1 (high half; 0 past dI)
                        for (int64_t p = 0; p < W; ++p) {
                            const uint32_t hi = 2 * p + 1 < dI ? bf16(float(x[2 * p + 1])) : 0;
                            words[h * W + p] = bf16(float(x[2 * p])) | hi << 16;
                        }
#endif
                    }
                    dot_rows[i] = DotRow{words, &qo[i * HI], DPINT8 ? &qw[i * HI] : r.w};
                }
#endif
            }
            for (int64_t b0 = 0; b0 < n_max; b0 += kb) {
                bool needed = false;
                for (int64_t i = 0; i < nt && !needed; ++i)
                    needed = !tile[i].done && tile[i].n > b0;
                if (!needed) break;
                const int64_t nb = std::min(kb, n_max - b0);
                if (records)
                    decode_records(pages, page_tokens, b0, nb, dec.data(), kp.data());
                else
                    key_ptrs(keys, pages, page_tokens, b0, nb, kp.data());
                transpose(kp.data(), nb, kt);
                const T kmax = max_norm(kt, nb);
                std::fill(amx_rows.begin(), amx_rows.end(), false);
                for (int64_t i = 0; i < nt; ++i)
                    if (tile[i].n_pos == 0 && tile[i].thr >= T(0))   // every score is <= 0 <= thr: nothing can enter
                        tile[i].done = true;
#if AMX
                if (amx) {
                    bool any = false;
                    for (int64_t i = 0; i < nt; ++i) any |= tile[i].count == k && !tile[i].done && tile[i].n > b0;
                    const T ek = any ? to_pairs(kt, nb, dIp, kb16.data()) : T(0);
                    any = false;
                    for (int64_t i = 0; i < nt; ++i) any |= amx_rows[i] = tile[i].n > b0 && amx_fits(tile[i], kmax, ek);
                    if (any) {
                        for (int64_t g0 = 0; g0 < nt; g0 += R) {
                            bool some = false;
                            for (int64_t i = 0; i < R; ++i) some |= on[i] = g0 + i < nt && amx_rows[g0 + i];
                            if (some)
                                amx_block(&tile[g0], on, R, qb.data() + g0 * HI * dIp, dIp, kb16.data(), kt, b0, kb,
                                          kmax, ek, cbuf);
                        }
                    }
                }
#endif
#if DOT
                DotKeys dot_keys{kd, T(1), T(0)};   // the block's keys for dp_sum, if a row can be full in it
                bool dot = false;
                if (dp) {
                    for (int64_t i = 0; i < nt; ++i)
                        dot |= !tile[i].done && tile[i].n > b0 && tile[i].count + std::min(kb, tile[i].n - b0) >= k;
#if DPINT8
                    if (dot) std::tie(dot_keys.scale, dot_keys.ek) = to_quads(kt, nb, kd);
#else
                    if (dot) dot_keys.ek = to_pairs(kt, nb, 2 * W, (uint16_t*)kd);
#endif
                }
#endif
                for (int64_t i = 0; i < nt; ++i) {
                    Row& r = tile[i];
                    if (r.done || r.n <= b0 || amx_rows[i]) continue;
#if DOT
                    if (dot) {
                        scan(r, &heads[i * HI], all_heads.data(), kt, b0, std::min(kb, r.n - b0), kmax, &dot_keys,
                             &dot_rows[i]);
                        continue;
                    }
#endif
                    scan(r, &heads[i * HI], all_heads.data(), kt, b0, std::min(kb, r.n - b0), kmax);
                }
            }
            for (int64_t i = 0; i < nt; ++i) {
                int64_t t = rows[t0 + i];
                finish(tile[i], cols + t * width, scores ? scores + t * width : nullptr, width);
            }
        }
#if AMX
        if (amx) _tile_release();
#endif
    }
};

// Top-k columns of every row t among the first n_visible[t] keys of its segment; rows are dealt to the threads
// round-robin.
template <typename T>
int topk(const T* q, const T* w, const T* keys, const int64_t* table, int64_t table_stride, int64_t page_tokens,
         const int64_t* row_seg, const int64_t* n_visible, int64_t T_, int64_t HI, int64_t dI, int64_t S, int64_t k,
         int64_t* cols, T* scores, int n_threads, const uint8_t* records) {
    if (HI < 1 || dI < 1 || k < 1 || page_tokens < 1 || table_stride < 0 || S < 0) return 1;
    if (S > table_stride * page_tokens) return 1;   // a visible key would lie past its segment's page list
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
            Indexer<T>{HI, dI, k, records}.run_rows(q, w, keys, table, table_stride, page_tokens, row_seg, n_visible,
                                                    width, cols, scores, rows);
        } catch (const std::bad_alloc&) {
#pragma omp atomic write
            oom = true;
        }
    }
    return oom ? 3 : 0;
}

}  // namespace

extern "C" {

// q [T, HI, dI], w [T, HI] (scaled head weights), keys: the arena [rows, dI]; table [segments, table_stride]:
// each segment's page ids, page p = arena rows p * page_tokens .. + page_tokens - 1; row_seg [T]: each row's
// segment; n_visible [T] (0..S): row t sees its segment's logical keys 0 .. n_visible[t] - 1, key j at arena row
// table[row_seg[t] * table_stride + j / page_tokens] * page_tokens + j % page_tokens. -> cols [T, width] (width =
// min(k, S); logical key indices) and, when not null, scores [T, width]. records, when not null: fp8 key records
// [rows, dI + 4] read in place of keys (same addressing). Page ids and row_seg are not checked (the caller's
// job). Returns 0, or 1 / 2 / 3: bad sizes / bad n_visible / out of memory.
int indexer_topk_f32(const float* q, const float* w, const float* keys, const int64_t* table, int64_t table_stride,
                     int64_t page_tokens, const int64_t* row_seg, const int64_t* n_visible, int64_t T, int64_t HI,
                     int64_t dI, int64_t S, int64_t k, int64_t* cols, float* scores, int n_threads,
                     const uint8_t* records) {
    return topk<float>(q, w, keys, table, table_stride, page_tokens, row_seg, n_visible, T, HI, dI, S, k, cols,
                       scores, n_threads, records);
}

int indexer_vec_bytes() { return VEC_BYTES; }

// Whether the dot filter is built in (it runs where the AMX filter does not, HI x dI >= DOT_MIN_WORK).
int indexer_dot() { return DOT; }

// Whether the dot filter multiplies int8 (VPDPBUSD) rather than bf16 (VDPBF16PS).
int indexer_dot_int8() { return DPINT8; }

int indexer_amx() {
#if AMX
    return amx_ready();
#else
    return 0;
#endif
}

int indexer_topk_f64(const double* q, const double* w, const double* keys, const int64_t* table,
                     int64_t table_stride, int64_t page_tokens, const int64_t* row_seg, const int64_t* n_visible,
                     int64_t T, int64_t HI, int64_t dI, int64_t S, int64_t k, int64_t* cols, double* scores,
                     int n_threads, const uint8_t* records) {
    return topk<double>(q, w, keys, table, table_stride, page_tokens, row_seg, n_visible, T, HI, dI, S, k, cols,
                        scores, n_threads, records);
}

}
