// CPU kernel of lorarl::merge_lora: out = weight + scale * left @ right with fp32 accumulation and one rounding, no
// full-size temporary, parallel over blocks of rows (at::parallel_for). Each choice below was kept because it measured
// faster (lora_merge/README.md has the benchmark and its current figures); the reasons:
// - A micro-tile is 6 rows x 64 columns: 24 fp32 accumulators in vector registers (of 32). A step of the rank loop
//   loads 4 vectors of the right factor and broadcasts 6 values of `left` for 24 FMAs. The loop starts with a
//   product, so no register is zeroed; the W tile is loaded before any store to out (rows are often 4 KiB multiples
//   apart, and a load after a store to the same address modulo 4 KiB stalls on a false dependency).
// - The right factor is packed once per call into 64-column panels ([r][64] contiguous), multiplied by scale there.
//   For 16-bit outputs the accumulators then start from W itself (acc = w + left @ (scale * right)), which saves
//   the epilogue's FMA; the extra roundings (one per scaled factor, and the accumulation on top of W) stay within
//   r + 2 fp32 epsilons of the terms, far below an ulp of bf16/fp16. fp32 outputs add W after the rank loop, so their
//   error does not grow with |W|.
// - A work item is a block of two micro-tiles (12 rows) swept across a chunk of panels: both tiles reuse each panel
//   from L1, the second two panels behind the first (rows 4 KiB multiples apart would otherwise crowd the same L1
//   sets). W and out are walked as 12 sequential row streams the hardware prefetcher follows, helped by a software
//   prefetch of the W lines of the tile that comes next on the same rows (the next panel, or the next block's first
//   one), one line in each of the rank loop's first steps rather than a burst at the tile's start. The last tile of
//   each step also prefetches the panel the first tile takes next from L2, one panel row per rank step, for panels
//   of 4 to 16 KiB (ranks 16 to 64: larger ones crowd W out of L1, smaller ones cost more than they save). Taller
//   blocks give more streams than the prefetcher tracks, and single-tile blocks stream each panel from L2 twice as
//   often.
// - Each thread sweeps all of its blocks across one column chunk before the next: the chunk's packed factor (half of
//   L2, at most 512 KiB) stays in L2, where sweeping whole rows re-read the entire packed factor for every block,
//   from L3 once it outgrew L2 (r x n x 4 bytes: 5.6 MB at rank 128 and n = 11008).
// - Outputs of at least kStreamBytes are written with non-temporal stores (not in place: see stream_output): lines
//   that are overwritten whole are not read first (a third of a plain merge's memory traffic), and the caches are
//   not flushed by a tensor that is handed on, not read back here.
// - bf16 is rounded by AVX512-BF16's vcvtne2ps2bf16 (nearest even, 32 values per instruction). It flushes fp32
//   denormals to zero, so when a tile's results hold a zero, its pairs of vectors are checked for denormals and
//   those that have any are rounded again by the exact integer path (one branch per tile, not per pair).
// - bf16 factors of an even rank (adapters kept in bf16) are multiplied as pairs of ranks by AVX512-BF16's vdpbf16ps:
//   products of bf16 are exact in fp32, so only the order of the fp32 sums differs, at twice the multiply-adds per
//   instruction; the panel then holds the factor unscaled and the tile scales its sums. The instruction counts
//   denormal factors and sums (below 1.2e-38) as zero: far beneath an ulp of any normal weight.
// Built with -march=native on the machine that runs it. Without AVX-512 (AVX2: 16 registers of 8 floats) a micro-tile
// is merged as four 6 x 16 register tiles (12 accumulators each: one 6 x 64 tile would spill), so blocks, panels,
// chunks and prefetches stay as above, and stores stream as above (16-bit outputs through an L1 staging tile: see
// merge_tile). bf16 is widened, rounded and packed with AVX2 intrinsics, bf16 W into bf16 in paired columns (see
// kPairedColumns).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <unistd.h>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "lora_merge_checks.h"

namespace {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;  // floats per vector
constexpr int64_t kVecs = 4;    // vectors per row of a micro-tile: 6 x 4 accumulators in 32 registers
#else
constexpr int64_t kLanes = 8;  // AVX2: 6 x 2 accumulators, 2 factor vectors and a broadcast in 16 registers
constexpr int64_t kVecs = 2;
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr bool kPairsBuilt = true;  // bf16 factors multiplied in pairs by vdpbf16ps (see multiply_add)
#else
constexpr bool kPairsBuilt = false;
#endif
constexpr int64_t kRegCols = kLanes * kVecs;    // columns per register tile
constexpr int64_t kCols = 64;                   // columns per micro-tile and per packed panel
constexpr int64_t kSubTiles = kCols / kRegCols;  // register tiles per micro-tile, merged in turn (AVX2: 4)
constexpr int64_t kRows = 6;                    // rows per micro-tile
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr bool kAvx2Tiles = true;  // register tiles of 6 x 16 in AVX2 registers
#else
constexpr bool kAvx2Tiles = false;
#endif
// With AVX2, bf16 W into bf16 out is merged in paired columns: a register tile's first vector holds its even columns
// and its second the odd ones (the packed panel is permuted to match). A 32-bit lane of W then holds one column of
// each, widened by a shift or a mask, and a rounded pair is put back together by one blend, where contiguous columns
// need two widening loads, and a pack and a cross-lane permute per store.
template <typename TW, typename TO>
constexpr bool kPairedColumns =
    kAvx2Tiles && std::is_same_v<TW, c10::BFloat16> && std::is_same_v<TO, c10::BFloat16>;
constexpr int64_t kBlockRows = 2 * kRows;       // rows per work item: two micro-tiles share each panel
// The second micro-tile of a block works this many panels behind the first. Rows of W are often a multiple of 4 KiB
// apart (4096 or 8192 columns), so the same columns of all 12 rows share L1 sets: 12 lines, and 12 more prefetched
// for the next tile, in 8-way sets. Two panels apart, each tile and its prefetch have sets of their own.
constexpr int64_t kSkewPanels = 2;
constexpr int64_t kStreamBytes = int64_t{4} << 20;  // outputs at least this large bypass the caches
constexpr int64_t kPrefetchPanelBytes = int64_t{16} << 10;  // larger panels: two would crowd W out of L1
constexpr int64_t kMinPrefetchPanelBytes = int64_t{4} << 10;  // smaller panels: the prefetches cost more than they save

// Fully unrolled small loops keep a micro-tile in registers (the compiler would otherwise keep it on the stack), and
// give the prefetches in the first rank steps constant offsets.
#define LORARL_UNROLL _Pragma("GCC unroll 32")

typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint32_t vuint32 __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t vuint16 __attribute__((vector_size(kLanes * sizeof(uint16_t))));

inline vfloat load_floats(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Writes the bytes of `v` to p, non-temporally when kStream (p then 64-byte aligned for 64-byte vectors, 32 for 32).
template <bool kStream, typename V>
inline void put(void* p, const V& v) {
#if defined(__AVX512F__)
  if constexpr (kStream && sizeof(V) == 64) {
    __m512i x;
    std::memcpy(&x, &v, sizeof x);
    return _mm512_stream_si512(static_cast<__m512i*>(p), x);
  }
#endif
#if defined(__AVX2__)
  if constexpr (kStream && sizeof(V) == 32) {
    __m256i x;
    std::memcpy(&x, &v, sizeof x);
    return _mm256_stream_si256(static_cast<__m256i*>(p), x);
  }
#endif
  static_assert(!kStream || sizeof(V) == 64 || sizeof(V) == 32, "streaming needs 32- or 64-byte vectors");
  std::memcpy(p, &v, sizeof v);
}

// Vector load (widen to fp32) and store (one rounding) of each storage dtype.
template <typename T>
struct Vec;

template <>
struct Vec<float> {
  static vfloat load(const float* p) { return load_floats(p); }
  template <bool kStream>
  static void store(float* p, vfloat v) {
    put<kStream>(p, v);
  }
};

template <>
struct Vec<c10::BFloat16> {
  static vfloat load(const c10::BFloat16* p) {
    vfloat f;
#if defined(__AVX512F__)  // one widening load and a shift; GCC 12 splits the generic code into 8-lane halves
    const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16);
#elif defined(__AVX2__)  // GCC 12 widens the generic code in 128-bit halves (5 instructions for these 2)
    const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i bits = _mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16);
#else
    vuint16 h;
    std::memcpy(&h, p, sizeof h);
    const vuint32 bits = __builtin_convertvector(h, vuint32) << 16;
#endif
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
  // Exact for every input, denormals included: round to nearest even on the bits, NaN kept quiet.
  template <bool kStream>
  static void store(c10::BFloat16* p, vfloat f) {
    vuint32 u;
    std::memcpy(&u, &f, sizeof u);
    vuint32 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    vuint32 quiet_nan = (u >> 16) | 0x40u;
    vuint32 bits = ((u & 0x7fffffffu) > 0x7f800000u) ? quiet_nan : rounded;
    put<kStream>(p, __builtin_convertvector(bits, vuint16));
  }
};

#if defined(__FLT16_MANT_DIG__)
typedef _Float16 vhalf __attribute__((vector_size(kLanes * sizeof(_Float16))));
template <>
struct Vec<c10::Half> {
  static vfloat load(const c10::Half* p) {  // exact, denormals included; GCC 12 converts lane by lane unless told
    vfloat f;
#if defined(__AVX512F__)
    const __m512 wide = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    std::memcpy(&f, &wide, sizeof f);
#elif defined(__F16C__)
    for (int64_t half = 0; half < kLanes / 8; ++half) {
      const __m256 wide = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * half)));
      std::memcpy(reinterpret_cast<float*>(&f) + 8 * half, &wide, sizeof wide);
    }
#else
    vhalf h;
    std::memcpy(&h, p, sizeof h);
    f = __builtin_convertvector(h, vfloat);
#endif
    return f;
  }
  template <bool kStream>
  static void store(c10::Half* p, vfloat f) {  // rounded to nearest even, 16 (AVX-512) or 8 (F16C) per instruction:
#if defined(__AVX512F__)                       // GCC 12 converts the generic code lane by lane, 2.8x slower at rank 8
    __m512 x;
    std::memcpy(&x, &f, sizeof x);
    put<kStream>(p, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__)
    for (int64_t half = 0; half < kLanes / 8; ++half) {
      __m256 x;
      std::memcpy(&x, reinterpret_cast<const float*>(&f) + 8 * half, sizeof x);
      put<kStream>(p + 8 * half, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    }
#else
    put<kStream>(p, __builtin_convertvector(f, vhalf));
#endif
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
  template <bool kStream>
  static void store(c10::Half* p, vfloat f) {
    for (int64_t l = 0; l < kLanes; ++l) p[l] = c10::Half(f[l]);
  }
};
#endif

#if defined(__AVX512F__)
inline __m512 as_m512(const vfloat& v) {
  __m512 x;
  std::memcpy(&x, &v, sizeof x);
  return x;
}
#endif

// Returns v unchanged, hidden from the optimiser: address arithmetic on the result is done where it is used. Without
// it GCC 12 computed the prefetch and store addresses of a tile (and those of the rare denormal path) at the tile's
// start and spilled ~20 of them to the stack across the rank loop: stores that queue behind the non-temporal ones.
template <typename T>
inline T opaque(T v) {
  asm volatile("" : "+r"(v));
  return v;
}

// Rounds an R x kCols tile to TO and stores it (kPaired: in paired columns, see kPairedColumns).
template <int64_t R, bool kStream, bool kPaired, typename TO>
inline void store_tile(TO* out, int64_t ld, const vfloat (&acc)[R][kVecs]) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<TO, c10::BFloat16> && kLanes == 16) {
    const __m512i magnitude = _mm512_set1_epi16(0x7fff);
    __mmask32 zeros = 0;
    LORARL_UNROLL
    for (int64_t i = 0; i < R; ++i)
      LORARL_UNROLL
      for (int64_t v = 0; v < kVecs; v += 2) {
        const __m512i bits = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(as_m512(acc[i][v + 1]), as_m512(acc[i][v])));
        zeros |= _mm512_testn_epi16_mask(bits, magnitude);
        put<kStream>(out + i * ld + v * kLanes, bits);
      }
    if (__builtin_expect(zeros == 0, 1)) return;
    // Rare: a zero result, maybe a flushed denormal; the pairs that hold denormals are rounded again, exactly.
    out = opaque(out);
    ld = opaque(ld);
    LORARL_UNROLL
    for (int64_t i = 0; i < R; ++i)
      LORARL_UNROLL
      for (int64_t v = 0; v < kVecs; v += 2) {
        const __m512 lo = as_m512(acc[i][v]), hi = as_m512(acc[i][v + 1]);
        if ((_mm512_fpclass_ps_mask(lo, 0x20) | _mm512_fpclass_ps_mask(hi, 0x20)) == 0) continue;
        Vec<TO>::template store<kStream>(out + i * ld + v * kLanes, acc[i][v]);
        Vec<TO>::template store<kStream>(out + i * ld + (v + 1) * kLanes, acc[i][v + 1]);
      }
    return;
  }
#endif
#if defined(__AVX2__) && !defined(__AVX512F__)
  if constexpr (std::is_same_v<TO, c10::BFloat16>) {
    // Rounded to nearest even on the bits, two vectors per store. NaN would need a blend per vector; instead a tile
    // whose sum is NaN (rare: it holds a NaN, or infinities of both signs) is stored again by Vec's exact path. The
    // sum runs on the FP adders, which the multiply-adds leave idle.
    vfloat sums[2] = {acc[0][0], acc[0][1]};
    LORARL_UNROLL
    for (int64_t i = 0; i < R; ++i)
      LORARL_UNROLL
      for (int64_t v = 0; v < kVecs; v += 2) {
        if (i > 0) {
          sums[0] += acc[i][v];
          sums[1] += acc[i][v + 1];
        }
        __m256i u[2];
        std::memcpy(&u, &acc[i][v], sizeof u);
        LORARL_UNROLL
        for (auto& x : u) {  // the rounded bf16 in the high half of each lane
          const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
          x = _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), odd);
        }
        __m256i pair;
        if constexpr (kPaired) {  // even columns' bf16 into the low halves of the lanes, odd ones' kept in the high
          pair = _mm256_blend_epi16(_mm256_srli_epi32(u[0], 16), u[1], 0xaa);
        } else {  // packus interleaves the 128-bit lanes of its operands; the permute restores the order
          pair = _mm256_permute4x64_epi64(
              _mm256_packus_epi32(_mm256_srli_epi32(u[0], 16), _mm256_srli_epi32(u[1], 16)), 0xd8);
        }
        put<kStream>(out + i * ld + v * kLanes, pair);
      }
    __m256 sum;
    const vfloat total = sums[0] + sums[1];
    std::memcpy(&sum, &total, sizeof sum);
    if (__builtin_expect(_mm256_movemask_ps(_mm256_cmp_ps(sum, sum, _CMP_UNORD_Q)) == 0, 1)) return;
    out = opaque(out);
    ld = opaque(ld);
    LORARL_UNROLL
    for (int64_t i = 0; i < R; ++i)
      LORARL_UNROLL
      for (int64_t v = 0; v < kVecs; ++v) {
        vfloat exact = acc[i][v];
        asm volatile("" : "+x"(exact));  // not shared with the fast path above, whose registers it would spill
        if constexpr (kPaired) {
          c10::BFloat16 column[kLanes];
          Vec<TO>::template store<false>(column, exact);
          for (int64_t l = 0; l < kLanes; ++l) out[i * ld + 2 * l + v] = column[l];
        } else {
          Vec<TO>::template store<kStream>(out + i * ld + v * kLanes, exact);
        }
      }
    return;
  }
#endif
  LORARL_UNROLL
  for (int64_t i = 0; i < R; ++i)
    LORARL_UNROLL
    for (int64_t v = 0; v < kVecs; ++v) Vec<TO>::template store<kStream>(out + i * ld + v * kLanes, acc[i][v]);
}

// Elements of type T per 64-byte cache line.
template <typename T>
constexpr int64_t kLineElems = 64 / sizeof(T);

// Cache lines per row of a W tile: a row shorter than a line (AVX2's 16 bf16 columns) still takes one.
template <typename TW>
constexpr int64_t kRowLines = std::max<int64_t>(1, kCols / kLineElems<TW>);

// Prefetches line `line` of the R x kCols W tile that starts at `tile` (prefetches never fault: rows of a tile that
// run past the end of W are harmless).
template <typename TW>
inline void prefetch_tile_line(const TW* tile, int64_t ld, int64_t line) {
  __builtin_prefetch(tile + (line / kRowLines<TW>) * ld + (line % kRowLines<TW>) * kLineElems<TW>, 0, 3);
}

// acc + a * b, where kPairs: acc + a[0] * b[0] + a[1] * b[1] per lane, `a` one pair of bf16 (the same in every
// lane) and `b` a pair per lane (AVX512-BF16's vdpbf16ps: two exact products per lane and step, fp32 sums).
template <bool kPairs>
inline vfloat multiply_add(vfloat acc, float a, vfloat b) {
#if defined(__AVX512BF16__)
  if constexpr (kPairs) {
    uint32_t pair;
    std::memcpy(&pair, &a, sizeof pair);
    __m512i bits;
    std::memcpy(&bits, &b, sizeof bits);
    const __m512 sum = _mm512_dpbf16_ps(as_m512(acc), reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair)),
                                        reinterpret_cast<__m512bh>(bits));
    std::memcpy(&acc, &sum, sizeof acc);
    return acc;
  }
#endif
  static_assert(!kPairs || kPairsBuilt, "bf16 pairs need AVX512-BF16");
  return acc + a * b;
}

// Vector v of a register tile's row of W, widened to fp32: with paired columns (see kPairedColumns) the even (v = 0)
// or odd (v = 1) columns of the row's kRegCols.
template <typename TW, typename TO>
inline vfloat load_w(const TW* row, int64_t v) {
#if defined(__AVX2__)
  if constexpr (kPairedColumns<TW, TO>) {
    const __m256i lanes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
    const __m256i bits = v == 0 ? _mm256_slli_epi32(lanes, 16) : _mm256_and_si256(lanes, _mm256_set1_epi32(-65536));
    vfloat f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
#endif
  return Vec<TW>::load(row + v * kLanes);
}

// A micro-tile of several register tiles (AVX2) calls them: inlined, GCC 12 shared the loads of `left` between them
// and kept them and the rounding constants on the stack, which was slower.
#if defined(__AVX512F__)
#define LORARL_REGISTER_TILE __attribute__((always_inline)) inline
#else
#define LORARL_REGISTER_TILE __attribute__((noinline))
#endif

// Register tile S (columns [S * kRegCols, (S + 1) * kRegCols)) of an R x kCols micro-tile: out = w + left @
// panel[r, kCols] (`left` packed [r][kRows], the panel holds scale * right) in vector registers, rounded once, while
// its share of the lines of the W tile at `next` (the next one on these rows) is prefetched, and its columns of
// `next_panel` too unless that is null (only a step's last tile prefetches a panel). kPairs: `left` and `panel` hold
// pairs of bf16 ranks (r is then half the rank), the panel unscaled: out = w + scale * (left @ panel). out's rows are
// out_ld apart.
template <int64_t S, int64_t R, bool kStream, bool kPairs, typename TW, typename TO>
LORARL_REGISTER_TILE void merge_register_tile(const TW* w, TO* out, int64_t ld, int64_t out_ld, const float* left,
                                              int64_t r, const float* panel, const TW* next, const float* next_panel,
                                              float scale) {
  constexpr bool kStartFromW = sizeof(TO) == 2 && !kPairs;
  constexpr int64_t kTileLines = R * kRowLines<TW>;
  constexpr int64_t kFirstLine = S * kTileLines / kSubTiles;
  constexpr int64_t kLines = (S + 1) * kTileLines / kSubTiles - kFirstLine;
  w += S * kRegCols;
  out += S * kRegCols;
  panel += S * kRegCols;
  if (next_panel != nullptr) next_panel += S * kRegCols;
  vfloat acc[R][kVecs];
  {
    vfloat b[kVecs];
    LORARL_UNROLL
    for (int64_t v = 0; v < kVecs; ++v) b[v] = load_floats(panel + v * kLanes);
    LORARL_UNROLL
    for (int64_t i = 0; i < R; ++i)
      LORARL_UNROLL
      for (int64_t v = 0; v < kVecs; ++v) {
        if constexpr (kPairs) {
          acc[i][v] = multiply_add<true>(vfloat{}, left[i], b[v]);
        } else {
          acc[i][v] = left[i] * b[v];
          if constexpr (kStartFromW) acc[i][v] += load_w<TW, TO>(w + i * ld, v);
        }
      }
  }
  const auto rank_step = [&](int64_t k) __attribute__((always_inline)) {
    vfloat b[kVecs];
    LORARL_UNROLL
    for (int64_t v = 0; v < kVecs; ++v) b[v] = load_floats(panel + k * kCols + v * kLanes);
    if (next_panel != nullptr) {
      LORARL_UNROLL
      for (int64_t j = 0; j < kRegCols; j += kLineElems<float>) __builtin_prefetch(next_panel + k * kCols + j, 0, 3);
    }
    LORARL_UNROLL
    for (int64_t i = 0; i < R; ++i) {
      const float a = left[k * kRows + i];
      LORARL_UNROLL
      for (int64_t v = 0; v < kVecs; ++v) acc[i][v] = multiply_add<kPairs>(acc[i][v], a, b[v]);
    }
  };
  int64_t k = 1;
  if (r > kLines) {  // the first steps each prefetch one line, with constant offsets
    const int64_t next_ld = opaque(ld);
    LORARL_UNROLL
    for (int64_t line = 0; line < kLines; ++line) {
      prefetch_tile_line(next, next_ld, kFirstLine + line);
      rank_step(k + line);
    }
    k += kLines;
  }
  for (; k < r; ++k) rank_step(k);
  if (r <= kLines) {
    const int64_t next_ld = opaque(ld);
    for (int64_t line = 0; line < kLines; ++line) prefetch_tile_line(next, next_ld, kFirstLine + line);
  }
  if constexpr (kPairs) {
    LORARL_UNROLL
    for (int64_t i = 0; i < R; ++i)
      LORARL_UNROLL
      for (int64_t v = 0; v < kVecs; ++v) acc[i][v] = load_w<TW, TO>(w + i * ld, v) + scale * acc[i][v];
  } else if constexpr (!kStartFromW) {
    LORARL_UNROLL
    for (int64_t i = 0; i < R; ++i)
      LORARL_UNROLL
      for (int64_t v = 0; v < kVecs; ++v) acc[i][v] += load_w<TW, TO>(w + i * ld, v);
  }
  store_tile<R, kStream, kPairedColumns<TW, TO>>(out, opaque(out_ld), acc);
}

// Register tiles S.. of a micro-tile, in turn.
template <int64_t S, int64_t R, bool kStream, bool kPairs, typename TW, typename TO>
__attribute__((always_inline)) inline void merge_register_tiles(const TW* w, TO* out, int64_t ld, int64_t out_ld,
                                                                const float* left, int64_t r, const float* panel,
                                                                const TW* next, const float* next_panel, float scale) {
  merge_register_tile<S, R, kStream, kPairs>(w, out, ld, out_ld, left, r, panel, next, next_panel, scale);
  if constexpr (S + 1 < kSubTiles)
    merge_register_tiles<S + 1, R, kStream, kPairs>(w, out, ld, out_ld, left, r, panel, next, next_panel, scale);
}

// One R x kCols micro-tile (see merge_register_tile), a register tile at a time. A streamed output whose register
// tile rows are shorter than a cache line (AVX2's 16 bf16 or fp16 columns: half a line) is staged in L1 and streamed
// out in whole lines: non-temporal stores of half lines, their other halves written a register tile later, are far
// slower than regular stores. Not inlined: GCC 12 inlined it into the skewed block loop and spilled the accumulators.
template <int64_t R, bool kStream, bool kPairs, typename TW, typename TO>
__attribute__((noinline)) void merge_tile(const TW* w, TO* out, int64_t ld, const float* left, int64_t r,
                                          const float* panel, const TW* next, const float* next_panel, float scale) {
  constexpr bool kStaged = kAvx2Tiles && kStream && kRegCols * sizeof(TO) < 64;
  if constexpr (kStaged) {
    alignas(64) TO staged[R * kCols];
    merge_register_tiles<0, R, false, kPairs>(w, staged, ld, kCols, left, r, panel, next, next_panel, scale);
#if defined(__AVX2__)
    LORARL_UNROLL
    for (int64_t i = 0; i < R; ++i)
      LORARL_UNROLL
      for (int64_t j = 0; j < kCols; j += 32 / sizeof(TO)) {
        __m256i line_half;
        std::memcpy(&line_half, staged + i * kCols + j, sizeof line_half);
        put<true>(out + i * ld + j, line_half);
      }
#endif
  } else {
    merge_register_tiles<0, R, kStream, kPairs>(w, out, ld, ld, left, r, panel, next, next_panel, scale);
  }
}

// Rows [row0, row1) x columns [col0, col1), one element at a time: columns that do not fill a panel.
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

// Calls fn with std::integral_constant<int64_t, rows> for rows in 1..kRows (the row count of a micro-tile).
template <typename Fn>
inline void with_tile_rows(int64_t rows, Fn&& fn) {
  static_assert(kRows == 6, "one case per possible row count");
  switch (rows) {
    case 6: return fn(std::integral_constant<int64_t, 6>{});
    case 5: return fn(std::integral_constant<int64_t, 5>{});
    case 4: return fn(std::integral_constant<int64_t, 4>{});
    case 3: return fn(std::integral_constant<int64_t, 3>{});
    case 2: return fn(std::integral_constant<int64_t, 2>{});
    default: return fn(std::integral_constant<int64_t, 1>{});
  }
}

// Panels per column chunk: the chunk's packed factor fills half of the L2 cache, at most 512 KiB.
int64_t panels_per_chunk(int64_t panel_bytes) {
  static const int64_t chunk_bytes = [] {
    int64_t l2_bytes = int64_t{1} << 20;
#if defined(_SC_LEVEL2_CACHE_SIZE)
    const long reported = sysconf(_SC_LEVEL2_CACHE_SIZE);
    if (reported > 0) l2_bytes = reported;
#endif
    return std::min<int64_t>(l2_bytes / 2, int64_t{512} << 10);
  }();
  return std::max<int64_t>(1, chunk_bytes / panel_bytes);
}

// The factors as the micro-tiles read them: fp32 (`left`, `right`: the edge columns read these too), and with
// kPairs the bf16 originals, whose pairs of ranks the tiles multiply directly.
struct Factors {
  const float* left;          // [m, r]
  const float* right;         // [r, n]
  const uint16_t* left_bf16;  // [m, r] (kPairs)
  const uint16_t* right_bf16;  // [r, n] (kPairs)
};

// The column of a panel that its position j holds: j itself, or with paired columns (see kPairedColumns) the even
// columns of a register tile in its first vector and the odd ones in its second.
template <typename TW, typename TO>
constexpr int64_t panel_column(int64_t j) {
  if constexpr (!kPairedColumns<TW, TO>) return j;
  const int64_t lane = j % kLanes, vec = j % kRegCols / kLanes;
  return j - j % kRegCols + 2 * lane + vec;
}

template <bool kStream, bool kPairs, typename TW, typename TO>
void merge_cpu(const TW* w, TO* out, int64_t m, int64_t n, const Factors& factors, int64_t rank, float scale) {
  const float* const left = factors.left;
  const float* const right = factors.right;
  const int64_t panels = n / kCols;
  const int64_t full_cols = panels * kCols;
  // The rank steps of a tile: one per rank, or with kPairs one per pair of ranks, each kCols 32-bit values of the
  // panel (an fp32, or two bf16) and one of each row of `left` (the bf16 rows then read as pairs: rank 2k in the low
  // half, as vdpbf16ps pairs them).
  const int64_t r = kPairs ? rank / 2 : rank;
  // left [m, r] -> [m / kRows][r][kRows] (the last tile's missing rows zero): a tile's rank step reads its values
  // from one place, and the tile needs one pointer to them instead of one per row (fewer registers spilled, which
  // matters most with AVX2's 16 registers). Copied as bits: with kPairs they are pairs of bf16.
  const int64_t row_tiles = (m + kRows - 1) / kRows;
  const at::Tensor left_storage = at::empty({row_tiles * r * kRows}, at::kFloat);
  uint32_t* const left_packed = static_cast<uint32_t*>(left_storage.mutable_data_ptr());
  const uint32_t* const left_bits = kPairs ? reinterpret_cast<const uint32_t*>(factors.left_bf16)
                                           : reinterpret_cast<const uint32_t*>(left);
  at::parallel_for(0, row_tiles, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t k = 0; k < r; ++k)
        for (int64_t i = 0; i < kRows; ++i) {
          const int64_t row = t * kRows + i;
          left_packed[(t * r + k) * kRows + i] = row < m ? left_bits[row * r + k] : 0u;
        }
  });
  const float* const tile_left = static_cast<const float*>(left_storage.const_data_ptr());
  // right [rank, n] -> panels [n / kCols][r][kCols]: scaled (fp32), or pairs of rows interleaved (kPairs: unscaled,
  // the tiles scale their sums); each micro-tile then reads one contiguous r x kCols block. Left uninitialised until
  // packed (zero-filling it first is measurable), and 64-byte aligned by torch's allocator, so no panel vector
  // straddles two cache lines (`new float[]` is only 16-byte aligned).
  const at::Tensor packed_storage = at::empty({panels * r * kCols}, at::kFloat);
  float* const packed = packed_storage.mutable_data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t k = 0; k < r; ++k)
        for (int64_t j = 0; j < kCols; ++j) {
          float* const to = &packed[(p * r + k) * kCols + j];
          if constexpr (kPairs) {
            const uint16_t* const column = factors.right_bf16 + p * kCols + j;
            const uint32_t pair = column[2 * k * n] | (uint32_t{column[(2 * k + 1) * n]} << 16);
            std::memcpy(to, &pair, sizeof pair);
          } else {
            *to = scale * right[k * n + p * kCols + panel_column<TW, TO>(j)];
          }
        }
  });
  const int64_t blocks = (m + kBlockRows - 1) / kBlockRows;
  const int64_t panel_bytes = r * kCols * static_cast<int64_t>(sizeof(float));
  const int64_t chunk = panels_per_chunk(panel_bytes);
  const bool prefetch_panels = panel_bytes >= kMinPrefetchPanelBytes && panel_bytes <= kPrefetchPanelBytes;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t c0 = 0; c0 < panels; c0 += chunk) {
      const int64_t c1 = std::min(panels, c0 + chunk);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t row0 = b * kBlockRows, row1 = std::min(m, row0 + kBlockRows);
        const int64_t tiles = (row1 - row0 + kRows - 1) / kRows;
        // The panel a tile on panel q takes next on its rows: the next one, or the next block's (or next chunk's)
        // first (clamped to the matrix at the very end).
        const auto panel_after = [&](int64_t q) {
          return std::min(panels - 1, q + 1 < c1 ? q + 1 : b + 1 < b1 ? c0 : c1);
        };
        // Tile t of the block works kSkewPanels * t panels behind the first (see kSkewPanels).
        for (int64_t step = c0; step < c1 + kSkewPanels * (tiles - 1); ++step) {
          const int64_t first_t = std::max<int64_t>(0, (step - c1 + kSkewPanels) / kSkewPanels);
          const int64_t last_t = std::min(tiles - 1, (step - c0) / kSkewPanels);
          // The step's last tile prefetches the panel the first tile takes next; the others find theirs in L1.
          const int64_t first_next_p = panel_after(step);
          for (int64_t t = first_t; t <= last_t; ++t) {
            const int64_t p = step - kSkewPanels * t, row = row0 + t * kRows;
            // The rows of the tile after this one: these, the next block's, or the first block's at the next chunk.
            const int64_t next_row = p + 1 < c1 ? row : b + 1 < b1 ? row + kBlockRows : b0 * kBlockRows + t * kRows;
            const int64_t next_p = panel_after(p);
            const float* next_panel = prefetch_panels && t == last_t ? &packed[first_next_p * r * kCols] : nullptr;
            with_tile_rows(std::min(kRows, row1 - row), [&](auto rows) {
              const int64_t at = row * n + p * kCols;
              const int64_t next = std::min(m - 1, next_row) * n + next_p * kCols;
              const float* const rows_left = tile_left + (row / kRows) * r * kRows;
              merge_tile<decltype(rows)::value, kStream, kPairs>(w + at, out + at, n, rows_left, r,
                                                                 &packed[p * r * kCols], w + next, next_panel, scale);
            });
          }
        }
      }
    }
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t row0 = b * kBlockRows, row1 = std::min(m, row0 + kBlockRows);
      merge_edge(w, out, n, left, right, rank, scale, row0, row1, full_cols, n);
    }
#if defined(__AVX2__)
    if constexpr (kStream) _mm_sfence();  // non-temporal stores drained before the join publishes out
#endif
  });
}

// Non-temporal stores pay off for outputs larger than the caches, and need every vector store aligned to its size.
// Only x86 builds with AVX2 use them, so only those compile the streaming variants (halves the build for others).
// Not in place (out is weight): a tile's lines were just read into the caches, where a regular store hits, while a
// non-temporal store to a cached line is slow (it evicts the line first).
#if defined(__AVX2__)
constexpr bool kStreamingBuilt = true;
#else
constexpr bool kStreamingBuilt = false;
#endif

// `out` is a 3-D group of experts here (a 2-D merge is a group of one). Streaming is decided for the whole group: each
// expert's output then starts 64-byte aligned too, since it is a whole number of 64-byte rows.
bool stream_output(const at::Tensor& weight, const at::Tensor& out) {
  const int64_t row_bytes = out.size(2) * out.element_size();
  return kStreamingBuilt && out.nbytes() >= static_cast<size_t>(kStreamBytes) && row_bytes % 64 == 0 &&
         reinterpret_cast<uintptr_t>(out.const_data_ptr()) % 64 == 0 &&
         out.const_data_ptr() != weight.const_data_ptr();
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

// A factor of a group of experts, contiguous. peft keeps an expert adapter's B flat, [out, r·E] with expert e's rank k
// in column k·E + e, so the [E, out, r] view the op gets has the experts innermost (stride 1). Copied expert by expert
// from a block of kBlock source rows at a time, which stays in L1 (8 x r·E values: 32 KB at r = E = 32) while every
// expert's rows of it are written out whole: a plain contiguous() reads each source line once per expert from farther
// away, and writing the experts' rows side by side puts E streams 4 KiB multiples apart into the same cache sets
// (either way 3.7-5.5 ms of an 18.7 ms merge at rank 32 and 32 experts).
template <typename T>
at::Tensor experts_contiguous(const at::Tensor& factor) {
  if (factor.is_contiguous() || factor.stride(0) != 1) return factor.contiguous();
  constexpr int64_t kBlock = 8;
  const int64_t experts = factor.size(0), rows = factor.size(1), cols = factor.size(2);
  const int64_t row_stride = factor.stride(1), col_stride = factor.stride(2);
  at::Tensor out = at::empty({experts, rows, cols}, factor.options());
  const T* const src = static_cast<const T*>(factor.const_data_ptr());
  T* const dst = static_cast<T*>(out.mutable_data_ptr());
  at::parallel_for(0, (rows + kBlock - 1) / kBlock, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t i0 = b * kBlock, i1 = std::min(rows, i0 + kBlock);
      for (int64_t e = 0; e < experts; ++e)
        for (int64_t i = i0; i < i1; ++i) {
          T* const to = dst + (e * rows + i) * cols;
          const T* const from = src + e + i * row_stride;
          for (int64_t j = 0; j < cols; ++j) to[j] = from[j * col_stride];
        }
    }
  });
  return out;
}

// Experts are merged one after the other, each by every thread: an expert's matrix (Qwen3-30B-A3B's are 1.5-3M
// elements) keeps all threads busy with blocks of rows, and the factors' packing is the dense merge's.
void merge_lora_cpu(const at::Tensor& weight_in, const at::Tensor& left_in, const at::Tensor& right_in, double scale,
                    const at::Tensor& out_in) {
  lorarl::check_merge_args(weight_in, left_in, right_in, out_in);
  const at::Tensor weight = lorarl::grouped(weight_in), left = lorarl::grouped(left_in);
  const at::Tensor right = lorarl::grouped(right_in), out = lorarl::grouped(out_in);
  if (left.size(2) == 0) {  // rank 0: the weight, rounded once to out's dtype
    out.copy_(weight);
    return;
  }
  const int64_t experts = weight.size(0), m = weight.size(1), n = weight.size(2), rank = left.size(2);
  const at::Tensor left_f = experts_contiguous<float>(left.to(at::kFloat));
  const at::Tensor right_f = experts_contiguous<float>(right.to(at::kFloat));
  // bf16 factors of an even rank: multiplied as bf16 pairs (exact products, fp32 sums; twice the FMA rate). Their
  // fp32 copies still serve the edge columns.
  const bool pairs = kPairsBuilt && left.scalar_type() == at::kBFloat16 && right.scalar_type() == at::kBFloat16 &&
                     rank % 2 == 0;
  const at::Tensor left_bf16 = pairs ? experts_contiguous<uint16_t>(left) : at::Tensor();
  const at::Tensor right_bf16 = pairs ? experts_contiguous<uint16_t>(right) : at::Tensor();
  const bool stream = stream_output(weight, out);
  with_storage_type(weight.scalar_type(), "weight", [&](auto* tw) {
    with_storage_type(out.scalar_type(), "out", [&](auto* to) {
      using TW = std::remove_pointer_t<decltype(tw)>;
      using TO = std::remove_pointer_t<decltype(to)>;
      auto run = merge_cpu<false, false, TW, TO>;
      if constexpr (kStreamingBuilt) {
        if (stream) run = merge_cpu<true, false, TW, TO>;
      }
      if constexpr (kPairsBuilt) {
        if (pairs) run = stream ? merge_cpu<true, true, TW, TO> : merge_cpu<false, true, TW, TO>;
      }
      for (int64_t e = 0; e < experts; ++e) {
        const Factors factors{
            left_f.const_data_ptr<float>() + e * m * rank, right_f.const_data_ptr<float>() + e * rank * n,
            pairs ? static_cast<const uint16_t*>(left_bf16.const_data_ptr()) + e * m * rank : nullptr,
            pairs ? static_cast<const uint16_t*>(right_bf16.const_data_ptr()) + e * rank * n : nullptr};
        run(static_cast<const TW*>(weight.const_data_ptr()) + e * m * n,
            static_cast<TO*>(out.mutable_data_ptr()) + e * m * n, m, n, factors, rank, static_cast<float>(scale));
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(lorarl, CPU, m) { m.impl("merge_lora", &merge_lora_cpu); }
