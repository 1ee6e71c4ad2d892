// CUDA kernel of lorarl::merge_lora (registered for the CUDA dispatch key; the schema is in lora_merge_ops.cpp).
//
// The merge moves 4-6 bytes per output element and does 2·r FLOPs on it, so at r = 128 plain fp32 FMAs (~50 TFLOP/s
// on an H100) would take 3-4x longer than the copy. The product B@A therefore runs on the tensor cores in bf16, with
// fp32 factors split into bf16 parts (x = x0 + x1 [+ x2]) and the cross products summed in fp32:
//   1 part  (both factors bf16): products exact, as in fp32;
//   3 parts ("bf16x6"): the six products x_p·y_q with p + q < 3, each within ~2^-24 of its value (fp32's rounding);
//   2 parts ("bf16x3", bf16 out at rank >= 128 only): x0·y0 + x0·y1 + x1·y0, each within ~2^-16.4 of its value: no
//            worse than the bound of fp32 accumulation over that many products, and halves the tensor-core work
//            where it matters (at low rank the merge is bound by memory, not by the products).
//
// One block computes a 64 x 128 tile of out with 8 warps (2 x 4, each 2 x 2 wmma fragments of 16 x 16). It first
// copies its W tile into shared memory with cp.async (16-byte pieces, no registers held, in flight while the tensor
// cores work), walks the rank in chunks of 16 (factors read as fp32 a chunk ahead, split into bf16 parts in shared
// memory), parks the fp32 accumulators in shared memory (reusing the factor tiles' space), and finally adds them to W
// with one fma and one rounding to out's dtype per element, written back as 16-byte vectors.
//
// A group of experts (3-D tensors) is one launch: the grid's third dimension is the expert.
//
// On an H100: 0.26-0.63 of copy bandwidth, bound by staging the factors per tile (see the package README).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_bf16.h>
#include <cuda_pipeline.h>
#include <mma.h>
#include <torch/library.h>

#include <cstdint>
#include <type_traits>

#include "lora_merge_checks.h"

namespace {

namespace wmma = nvcuda::wmma;

constexpr int kRows = 64, kCols = 128;  // output tile of one block
constexpr int kThreads = 256;           // 8 warps: 2 along the rows x 4 along the columns, 32 x 32 outputs each
constexpr int kK = 16;                  // wmma shape m16n16k16; also the rank chunk
constexpr int kMaxParts = 3;
constexpr int kTwoPartsFromRank = 128;  // where fp32 accumulation's own error bound, (r + 2)·2^-24, reaches bf16x3's
constexpr int kChunk = 8;  // W/out elements per vector access (16 bytes of bf16, 32 of fp32)
constexpr int kChunksPerThread = kRows * kCols / kChunk / kThreads;
constexpr int kPad = 8;     // bf16 row padding in shared memory: 16 bytes, keeps fragment rows off one bank
constexpr int kAccPad = 4;  // fp32 row padding of the accumulator tile

struct FactorTiles {
  __nv_bfloat16 left[kMaxParts][kRows][kK + kPad];
  __nv_bfloat16 right[kMaxParts][kK][kCols + kPad];
};
struct AccumulatorTile {
  float values[kRows][kCols + kAccPad];
};
constexpr size_t kSharedBytes = sizeof(FactorTiles) > sizeof(AccumulatorTile) ? sizeof(FactorTiles)
                                                                               : sizeof(AccumulatorTile);

template <typename T>
struct alignas(16) Chunk {
  T v[kChunk];
};

// The next bf16 part of x (x = x0 + x1 + ...): rounds x, leaves the remainder in x (0 once a part is not finite, so
// an inf factor gives inf products, not inf - inf).
__device__ __forceinline__ __nv_bfloat16 take_part(float& x) {
  const __nv_bfloat16 part = __float2bfloat16_rn(x);
  const float value = __bfloat162float(part);
  x = isfinite(value) ? x - value : 0.f;
  return part;
}

// One rank chunk of this block's factor tiles, held in registers: loaded a chunk ahead (all loads issued at once),
// so their L2 latency is paid once per block rather than once per element and hides behind the MMAs.
constexpr int kLeftPerThread = kRows * kK / kThreads, kRightPerThread = kK * kCols / kThreads;
struct FactorChunk {
  float left[kLeftPerThread];
  float right[kRightPerThread];
};

__device__ __forceinline__ void load_chunk(FactorChunk& chunk, const float* __restrict__ left,
                                           const float* __restrict__ right, int64_t m, int64_t n, int64_t r,
                                           int64_t row0, int64_t col0, int64_t k0, int tid) {
#pragma unroll
  for (int q = 0; q < kLeftPerThread; ++q) {  // left [m, r]: the tile's rows, ranks k0 .. k0 + 15
    const int e = tid + q * kThreads;
    const int64_t row = row0 + e / kK, k = k0 + e % kK;
    chunk.left[q] = row < m && k < r ? left[row * r + k] : 0.f;
  }
#pragma unroll
  for (int q = 0; q < kRightPerThread; ++q) {  // right [r, n]: ranks k0 .. k0 + 15, the tile's columns
    const int e = tid + q * kThreads;
    const int64_t k = k0 + e / kCols, col = col0 + e % kCols;
    chunk.right[q] = k < r && col < n ? right[k * n + col] : 0.f;
  }
}

__device__ __forceinline__ void store_chunk(FactorChunk chunk, FactorTiles& factors, int parts, int tid) {
#pragma unroll
  for (int p = 0; p < kMaxParts; ++p) {
    if (p >= parts) break;
#pragma unroll
    for (int q = 0; q < kLeftPerThread; ++q) {
      const int e = tid + q * kThreads;
      factors.left[p][e / kK][e % kK] = take_part(chunk.left[q]);
    }
#pragma unroll
    for (int q = 0; q < kRightPerThread; ++q) {
      const int e = tid + q * kThreads;
      factors.right[p][e / kCols][e % kCols] = take_part(chunk.right[q]);
    }
  }
}

template <typename TW, typename TO>
__global__ void __launch_bounds__(kThreads, 2) merge_lora_kernel(const TW* w, TO* out,  // may alias: in place
                                                              const float* __restrict__ left,
                                                              const float* __restrict__ right, int64_t m, int64_t n,
                                                              int64_t r, float scale, int parts, bool aligned) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // bf16 tensor cores: the host refuses such devices before launching
#else
  extern __shared__ __align__(128) unsigned char shared[];
  auto& factors = *reinterpret_cast<FactorTiles*>(shared);
  auto& accumulators = *reinterpret_cast<AccumulatorTile*>(shared);
  TW* w_tile = reinterpret_cast<TW*>(shared + kSharedBytes);
  const int64_t expert = blockIdx.z;  // this block's expert: its matrices follow the previous experts'
  w += expert * m * n;
  out += expert * m * n;
  left += expert * m * r;
  right += expert * r * n;
  const int tid = threadIdx.x, warp = tid / 32;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kRows, col0 = static_cast<int64_t>(blockIdx.x) * kCols;

  // The W tile first, copied asynchronously into shared memory (no registers held): in flight while the tensor cores
  // work. Each thread copies the chunks it will merge, so only its own wait is needed, no barrier.
#pragma unroll
  for (int q = 0; q < kChunksPerThread; ++q) {
    const int c = tid + q * kThreads;
    const int64_t row = row0 + c / (kCols / kChunk), col = col0 + (c % (kCols / kChunk)) * kChunk;
    const TW* src = w + row * n + col;
    TW* dst = w_tile + c * kChunk;
    if (aligned && row < m && col + kChunk <= n) {
#pragma unroll
      for (int b = 0; b < static_cast<int>(sizeof(Chunk<TW>)); b += 16)
        __pipeline_memcpy_async(reinterpret_cast<char*>(dst) + b, reinterpret_cast<const char*>(src) + b, 16);
    } else {
#pragma unroll
      for (int e = 0; e < kChunk; ++e) dst[e] = (row < m && col + e < n) ? src[e] : TW(0.f);
    }
  }
  __pipeline_commit();

  wmma::fragment<wmma::accumulator, kK, kK, kK, float> acc[2][2];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.f);
  const int warp_row = (warp / 4) * 32, warp_col = (warp % 4) * 32;

  FactorChunk chunk;
  load_chunk(chunk, left, right, m, n, r, row0, col0, 0, tid);
  for (int64_t k0 = 0; k0 < r; k0 += kK) {
    store_chunk(chunk, factors, parts, tid);
    __syncthreads();
    if (k0 + kK < r) load_chunk(chunk, left, right, m, n, r, row0, col0, k0 + kK, tid);  // in flight during the MMAs
    wmma::fragment<wmma::matrix_b, kK, kK, kK, __nv_bfloat16, wmma::row_major> b[kMaxParts][2];
#pragma unroll
    for (int p = 0; p < kMaxParts; ++p)
#pragma unroll
      for (int j = 0; j < 2; ++j)
        if (p < parts) wmma::load_matrix_sync(b[p][j], &factors.right[p][0][warp_col + kK * j], kCols + kPad);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      wmma::fragment<wmma::matrix_a, kK, kK, kK, __nv_bfloat16, wmma::row_major> a[kMaxParts];
#pragma unroll
      for (int p = 0; p < kMaxParts; ++p)
        if (p < parts) wmma::load_matrix_sync(a[p], &factors.left[p][warp_row + kK * i][0], kK + kPad);
      // Smallest products first: x1·y1 .. x0·y1, x1·y0, then x0·y0.
#pragma unroll
      for (int order = kMaxParts - 1; order >= 0; --order)
#pragma unroll
        for (int p = 0; p <= order; ++p)
#pragma unroll
          for (int j = 0; j < 2; ++j)
            if (order < parts) wmma::mma_sync(acc[i][j], a[p], b[order - p][j], acc[i][j]);
    }
    __syncthreads();
  }

#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j)
      wmma::store_matrix_sync(&accumulators.values[warp_row + kK * i][warp_col + kK * j], acc[i][j],
                              kCols + kAccPad, wmma::mem_row_major);
  __pipeline_wait_prior(0);
  __syncthreads();

#pragma unroll
  for (int q = 0; q < kChunksPerThread; ++q) {
    const int c = tid + q * kThreads;
    const int i = c / (kCols / kChunk), j = (c % (kCols / kChunk)) * kChunk;
    const int64_t row = row0 + i, col = col0 + j;
    Chunk<TO> merged;
#pragma unroll
    for (int e = 0; e < kChunk; ++e)
      merged.v[e] = TO(fmaf(scale, accumulators.values[i][j + e], static_cast<float>(w_tile[c * kChunk + e])));
    TO* dst = out + row * n + col;
    if (aligned && row < m && col + kChunk <= n) {
      *reinterpret_cast<Chunk<TO>*>(dst) = merged;
    } else {
#pragma unroll
      for (int e = 0; e < kChunk; ++e)
        if (row < m && col + e < n) dst[e] = merged.v[e];
    }
  }
#endif
}

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

bool is_16_byte_aligned(const at::Tensor& t) { return reinterpret_cast<std::uintptr_t>(t.const_data_ptr()) % 16 == 0; }

void merge_lora_cuda(const at::Tensor& weight_in, const at::Tensor& left_in, const at::Tensor& right_in,
                     double scale, const at::Tensor& out_in) {
  lorarl::check_merge_args(weight_in, left_in, right_in, out_in);
  const at::Tensor weight = lorarl::grouped(weight_in), left = lorarl::grouped(left_in);
  const at::Tensor right = lorarl::grouped(right_in), out = lorarl::grouped(out_in);
  const c10::cuda::CUDAGuard guard(weight.device());
  const int64_t experts = weight.size(0), m = weight.size(1), n = weight.size(2), r = left.size(2);
  if (experts == 0 || m == 0 || n == 0) return;
  if (r == 0) {
    out.copy_(weight);
    return;
  }
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, weight.get_device()));
  TORCH_CHECK(major >= 8,
              "merge_lora: the CUDA kernel needs bf16 tensor cores (compute capability 8.0 or newer); "
              "use backend='triton' or 'torch' on this GPU");
  const bool bf16_factors = left.scalar_type() == at::kBFloat16 && right.scalar_type() == at::kBFloat16;
  const int parts = bf16_factors ? 1 : out.scalar_type() == at::kBFloat16 && r >= kTwoPartsFromRank ? 2 : 3;
  const at::Tensor left_f = left.to(at::kFloat).contiguous();
  const at::Tensor right_f = right.to(at::kFloat).contiguous();
  const bool aligned = n % kChunk == 0 && is_16_byte_aligned(weight) && is_16_byte_aligned(out);
  const dim3 grid(static_cast<unsigned>((n + kCols - 1) / kCols), static_cast<unsigned>((m + kRows - 1) / kRows),
                  static_cast<unsigned>(experts));
  TORCH_CHECK(grid.y <= 65535, "merge_lora: weight has too many rows for one launch (", m, ")");
  TORCH_CHECK(grid.z <= 65535, "merge_lora: too many experts for one launch (", experts, ")");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  with_storage_type(weight.scalar_type(), "weight", [&](auto* tw) {
    with_storage_type(out.scalar_type(), "out", [&](auto* to) {
      using TW = std::remove_pointer_t<decltype(tw)>;
      using TO = std::remove_pointer_t<decltype(to)>;
      const int shared_bytes = static_cast<int>(kSharedBytes + kRows * kCols * sizeof(TW));
      C10_CUDA_CHECK(cudaFuncSetAttribute(merge_lora_kernel<TW, TO>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          shared_bytes));
      merge_lora_kernel<TW, TO><<<grid, kThreads, shared_bytes, stream>>>(
          static_cast<const TW*>(weight.const_data_ptr()), static_cast<TO*>(out.mutable_data_ptr()),
          left_f.const_data_ptr<float>(), right_f.const_data_ptr<float>(), m, n, r, static_cast<float>(scale), parts,
          aligned);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(lorarl, CUDA, m) { m.impl("merge_lora", &merge_lora_cuda); }
