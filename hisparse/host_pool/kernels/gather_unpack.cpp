// Fused CPU row read: out[i] = RowLayout.unpack(store[idx[i]]) (hisparse/host_pool/layout.py, the torch
// reference) in one pass over the selected rows, bit-identical to it: every value is the same IEEE operation
// torch performs (an exact fp8 / bf16 -> fp32 conversion, one fp32 product c8 * scale, an exact widening to
// fp64), so no -ffast-math and no contraction. Rows are dealt to OpenMP threads where the build has it.

#include <cstdint>
#include <cstring>

namespace {

enum Error : int { OK = 0, BAD_INDEX = 1, BAD_LAYOUT = 2 };

constexpr int64_t PARALLEL_ELEMS = int64_t(1) << 15;   // below this many outputs one thread is faster

// fp8 e4m3fn byte -> fp32 value, as torch converts it: exact normals and subnormals, and torch's NaN bits for the
// two NaN bytes 0x7f / 0xff (e4m3fn has no infinities).
struct Fp8Table {
    float value[256];
    Fp8Table() {
        for (int b = 0; b < 256; ++b) {
            const uint32_t sign = uint32_t(b >> 7) << 31;
            const int exp = (b >> 3) & 0xF, mant = b & 0x7;
            uint32_t bits;
            if (exp == 0xF && mant == 0x7) {
                bits = sign | 0x7FF00000u;
            } else if (exp == 0) {                                          // subnormal: mant * 2^-9
                float v = float(mant) * (1.0f / 512.0f);
                std::memcpy(&bits, &v, 4);
                bits |= sign;
            } else {                                                        // rebias 7 -> 127
                bits = sign | (uint32_t(exp + 120) << 23) | (uint32_t(mant) << 20);
            }
            std::memcpy(&value[b], &bits, 4);
        }
    }
};
const Fp8Table FP8;

inline float load_f32(const uint8_t* p) {
    float v;
    std::memcpy(&v, p, 4);
    return v;
}

inline float bf16_to_f32(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    const uint32_t bits = uint32_t(h) << 16;
    float v;
    std::memcpy(&v, &bits, 4);
    return v;
}

// One stored row -> rank + rope values. tile > 0: fp8_ds_mla (rank fp8 || rank / tile fp32 scales || rope bf16);
// tile == 0: bf16 (rank + rope bf16).
template <typename Out>
void unpack_row(const uint8_t* src, Out* dst, int64_t rank, int64_t rope, int64_t tile) {
    int64_t n_bf16 = rank + rope;
    if (tile > 0) {
        const uint8_t* scales = src + rank;
        for (int64_t t = 0; t < rank / tile; ++t) {
            const float scale = load_f32(scales + 4 * t);
            const uint8_t* c = src + t * tile;
            Out* o = dst + t * tile;
            for (int64_t j = 0; j < tile; ++j) o[j] = Out(FP8.value[c[j]] * scale);   // fp32 product, then widen
        }
        src = scales + 4 * (rank / tile);
        dst += rank;
        n_bf16 = rope;
    }
    for (int64_t j = 0; j < n_bf16; ++j) dst[j] = Out(bf16_to_f32(src + 2 * j));
}

template <typename Out>
int gather_unpack(const uint8_t* store, int64_t n_rows, int64_t row_bytes, const int64_t* idx, int64_t m,
                  int64_t rank, int64_t rope, int64_t tile, Out* out, int n_threads) {
    if (rank < 0 || rope < 0 || tile < 0 || (tile > 0 && rank % tile)) return BAD_LAYOUT;
    if (row_bytes != (tile > 0 ? rank + 4 * (rank / tile) + 2 * rope : 2 * (rank + rope))) return BAD_LAYOUT;
    for (int64_t i = 0; i < m; ++i)
        if (idx[i] < 0 || idx[i] >= n_rows) return BAD_INDEX;
    const int64_t width = rank + rope;
#pragma omp parallel for schedule(static) num_threads(n_threads) if (m * width >= PARALLEL_ELEMS)
    for (int64_t i = 0; i < m; ++i) unpack_row(store + idx[i] * row_bytes, out + i * width, rank, rope, tile);
    return OK;
}

}  // namespace

extern "C" {

// store [n_rows, row_bytes] (contiguous bytes), idx [m] -> out [m, rank + rope]: row i = store[idx[i]] decoded.
// tile > 0: the fp8_ds_mla layout with that fp8 tile; 0: the bf16 layout. Returns 0, or 1 / 2: an idx outside
// [0, n_rows) / row_bytes or tile not matching the layout (nothing written then).
int hisparse_gather_unpack_f32(const uint8_t* store, int64_t n_rows, int64_t row_bytes, const int64_t* idx,
                               int64_t m, int64_t rank, int64_t rope, int64_t tile, float* out, int n_threads) {
    return gather_unpack<float>(store, n_rows, row_bytes, idx, m, rank, rope, tile, out, n_threads);
}

int hisparse_gather_unpack_f64(const uint8_t* store, int64_t n_rows, int64_t row_bytes, const int64_t* idx,
                               int64_t m, int64_t rank, int64_t rope, int64_t tile, double* out, int n_threads) {
    return gather_unpack<double>(store, n_rows, row_bytes, idx, m, rank, rope, tile, out, n_threads);
}

}  // extern "C"
