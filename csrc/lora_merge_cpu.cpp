// CPU kernel of lorarl::merge_lora: cache-blocked, OpenMP-parallel (through at::parallel_for), no full-size temporary.
//
// Each thread takes blocks of 32 rows of W. Within a block, the `right` factor is walked in 64-column panels (packed
// contiguously, r x 64 fp32, so a panel stays in L1 while every 4-row micro-tile of the block uses it); a micro-tile
// accumulates its rank-r product in sixteen fp32 vector registers, adds the W tile and rounds once to the output
// dtype (round to nearest even). Because a block's rows are 4 KiB-multiples apart, the hardware prefetcher does not
// follow them: the W and out lines of the next panel are prefetched in software one panel step ahead.
// Built with -march=native on the machine that runs it, so the vectors map onto that CPU's widest FMA units.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "lora_merge_checks.h"

namespace {

constexpr int64_t kLanes = 16;              // floats per vector
constexpr int64_t kRows = 4;                // rows per micro-tile
constexpr int64_t kVecs = 4;                // vectors per row of a micro-tile
constexpr int64_t kCols = kLanes * kVecs;   // columns per micro-tile (and per packed panel)
constexpr int64_t kBlockRows = 32;           // rows per block: a panel is reused by its 8 micro-tiles

typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint32_t vuint32 __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t vuint16 __attribute__((vector_size(kLanes * sizeof(uint16_t))));

inline vfloat load_floats(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Vector load (widen to fp32) and store (one rounding) of each storage dtype.
template <typename T>
struct Vec;

template <>
struct Vec<float> {
  static vfloat load(const float* p) { return load_floats(p); }
  static void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }
};

template <>
struct Vec<c10::BFloat16> {
  static vfloat load(const c10::BFloat16* p) {
    vuint16 h;
    std::memcpy(&h, p, sizeof h);
    vuint32 bits = __builtin_convertvector(h, vuint32) << 16;
    vfloat f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
  static void store(c10::BFloat16* p, vfloat f) {
#if defined(__AVX512BF16__)
    // vcvtneps2bf16 rounds to nearest even in one instruction, but treats fp32 denormal inputs as zero: only vectors
    // holding a denormal take the exact integer path below.
    if (kLanes == 16) {
      __m512 v;
      std::memcpy(&v, &f, sizeof v);
      if (_mm512_fpclass_ps_mask(v, 0x20) == 0) {
        __m256bh h = _mm512_cvtneps_pbh(v);
        std::memcpy(p, &h, sizeof h);
        return;
      }
    }
#endif
    vuint32 u;
    std::memcpy(&u, &f, sizeof u);
    vuint32 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  // round to nearest even
    vuint32 quiet_nan = (u >> 16) | 0x40u;
    vuint32 bits = ((u & 0x7fffffffu) > 0x7f800000u) ? quiet_nan : rounded;
    vuint16 h = __builtin_convertvector(bits, vuint16);
    std::memcpy(p, &h, sizeof h);
  }
};

#if defined(__FLT16_MANT_DIG__)
typedef _Float16 vhalf __attribute__((vector_size(kLanes * sizeof(_Float16))));
template <>
struct Vec<c10::Half> {
  static vfloat load(const c10::Half* p) {
    vhalf h;
    std::memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, vfloat);
  }
  static void store(c10::Half* p, vfloat f) {
    vhalf h = __builtin_convertvector(f, vhalf);
    std::memcpy(p, &h, sizeof h);
  }
};
#else
template <>
struct Vec<c10::Half> {  // no native _Float16: convert lane by lane with c10's round-to-nearest-even
  static vfloat load(const c10::Half* p) {
    vfloat f;
    for (int64_t l = 0; l < kLanes; ++l) f[l] = static_cast<float>(p[l]);
    return f;
  }
  static void store(c10::Half* p, vfloat f) {
    for (int64_t l = 0; l < kLanes; ++l) p[l] = c10::Half(f[l]);
  }
};
#endif

// One 4 x 64 micro-tile: acc = left[4, r] @ panel[r, 64] in sixteen vector registers, then out = w + scale * acc,
// rounded once. Prefetches the same rows' lines of the next panel (`next_panel` columns ahead; 0 = none).
template <typename TW, typename TO>
inline void merge_micro_tile(const TW* w, TO* out, int64_t ld, const float* left, int64_t r, const float* panel,
                             float scale, int64_t next_panel) {
  if (next_panel) {
    for (int64_t i = 0; i < kRows; ++i) {
      for (int64_t c = 0; c < kCols; c += 64 / sizeof(TW)) __builtin_prefetch(w + i * ld + next_panel + c, 0, 3);
      for (int64_t c = 0; c < kCols; c += 64 / sizeof(TO)) __builtin_prefetch(out + i * ld + next_panel + c, 1, 3);
    }
  }
  vfloat acc[kRows][kVecs] = {};
  for (int64_t k = 0; k < r; ++k) {
    vfloat b[kVecs];
    for (int64_t v = 0; v < kVecs; ++v) b[v] = load_floats(panel + k * kCols + v * kLanes);
    for (int64_t i = 0; i < kRows; ++i) {
      const float a = left[i * r + k];
      for (int64_t v = 0; v < kVecs; ++v) acc[i][v] += a * b[v];
    }
  }
  // All loads of W before any store to out: rows are a multiple of 4 KiB apart, and a load right after a store to the
  // same address modulo 4 KiB stalls on a false dependency (4K aliasing) -- that alone halved the speed.
  for (int64_t i = 0; i < kRows; ++i)
    for (int64_t v = 0; v < kVecs; ++v) acc[i][v] = Vec<TW>::load(w + i * ld + v * kLanes) + scale * acc[i][v];
  for (int64_t i = 0; i < kRows; ++i)
    for (int64_t v = 0; v < kVecs; ++v) Vec<TO>::store(out + i * ld + v * kLanes, acc[i][v]);
}

// Rows [row0, row1) x columns [col0, col1), one element at a time: the edges that do not fill a micro-tile.
template <typename TW, typename TO>
void merge_edge(const TW* w, TO* out, int64_t n, const float* left, const float* right, int64_t r, float scale,
                int64_t row0, int64_t row1, int64_t col0, int64_t col1) {
  for (int64_t i = row0; i < row1; ++i) {
    for (int64_t j = col0; j < col1; ++j) {
      float acc = 0.f;
      for (int64_t k = 0; k < r; ++k) acc += left[i * r + k] * right[k * n + j];
      out[i * n + j] = TO(static_cast<float>(w[i * n + j]) + scale * acc);
    }
  }
}

template <typename TW, typename TO>
void merge_cpu(const TW* w, TO* out, int64_t m, int64_t n, const float* left, const float* right, int64_t r,
               float scale) {
  const int64_t panels = n / kCols;
  const int64_t full_cols = panels * kCols;
  // right [r, n] -> panels [n / 64][r][64]: each micro-tile then reads one contiguous r x 64 block.
  std::vector<float> packed(static_cast<size_t>(panels * r * kCols));
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t k = 0; k < r; ++k)
        std::memcpy(&packed[(p * r + k) * kCols], right + k * n + p * kCols, kCols * sizeof(float));
  });
  const int64_t row_tiles = m / kRows;
  const int64_t tiles_per_block = kBlockRows / kRows;
  const int64_t blocks = (row_tiles + tiles_per_block - 1) / tiles_per_block;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t tile0 = b * tiles_per_block, tile1 = std::min(row_tiles, tile0 + tiles_per_block);
      for (int64_t p = 0; p < panels; ++p) {
        const int64_t next_panel = p + 1 < panels ? kCols : 0;
        for (int64_t t = tile0; t < tile1; ++t) {
          const int64_t row = t * kRows, at = row * n + p * kCols;
          merge_micro_tile(w + at, out + at, n, left + row * r, r, &packed[p * r * kCols], scale, next_panel);
        }
      }
      merge_edge(w, out, n, left, right, r, scale, tile0 * kRows, tile1 * kRows, full_cols, n);
    }
  });
  merge_edge(w, out, n, left, right, r, scale, row_tiles * kRows, m, 0, n);
}

// Calls fn with a null pointer of the C++ type of `dtype` (float32, bfloat16 or float16).
template <typename Fn>
void with_storage_type(at::ScalarType dtype, const char* name, Fn&& fn) {
  switch (dtype) {
    case at::kFloat:
      return fn(static_cast<float*>(nullptr));
    case at::kBFloat16:
      return fn(static_cast<c10::BFloat16*>(nullptr));
    case at::kHalf:
      return fn(static_cast<c10::Half*>(nullptr));
    default:
      TORCH_CHECK(false, "merge_lora: ", name, " must be float32, bfloat16 or float16, got ", dtype);
  }
}

void merge_lora_cpu(const at::Tensor& weight, const at::Tensor& left, const at::Tensor& right, double scale,
                    const at::Tensor& out) {
  lorarl::check_merge_args(weight, left, right, out);
  const at::Tensor left_f = left.to(at::kFloat).contiguous();
  const at::Tensor right_f = right.to(at::kFloat).contiguous();
  with_storage_type(weight.scalar_type(), "weight", [&](auto* tw) {
    with_storage_type(out.scalar_type(), "out", [&](auto* to) {
      using TW = std::remove_pointer_t<decltype(tw)>;
      using TO = std::remove_pointer_t<decltype(to)>;
      merge_cpu(static_cast<const TW*>(weight.const_data_ptr()), static_cast<TO*>(out.mutable_data_ptr()),
                weight.size(0), weight.size(1), left_f.const_data_ptr<float>(), right_f.const_data_ptr<float>(),
                left.size(1), static_cast<float>(scale));
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(lorarl, CPU, m) { m.impl("merge_lora", &merge_lora_cpu); }
