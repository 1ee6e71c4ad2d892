// CUDA kernel of lorarl::merge_lora (registered for the CUDA dispatch key; the schema is in lora_merge_ops.cpp).
//
// One 64 x 64 output tile per block of 16 x 16 threads, 4 x 4 outputs per thread. The rank dimension is walked in
// chunks of 16 through shared memory (left tile 64 x 16, right tile 16 x 64, fp32); each thread accumulates in fp32
// registers, then reads its W elements, adds scale * acc and rounds once to out's dtype. A thread's columns are
// 16 apart so that neighbouring threads touch neighbouring addresses (coalesced W reads and out writes).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <type_traits>

#include "lora_merge_checks.h"

namespace {

constexpr int kTile = 64;     // output tile edge
constexpr int kThreads = 16;  // threads per tile edge
constexpr int kPer = kTile / kThreads;
constexpr int kChunk = 16;    // rank chunk held in shared memory

template <typename TW, typename TO>
__global__ void merge_lora_kernel(const TW* __restrict__ w, TO* out, const float* __restrict__ left,
                                  const float* __restrict__ right, int64_t m, int64_t n, int64_t r, float scale) {
  __shared__ float left_tile[kTile][kChunk + 1];
  __shared__ float right_tile[kChunk][kTile];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTile, col0 = static_cast<int64_t>(blockIdx.x) * kTile;
  float acc[kPer][kPer] = {};
  for (int64_t k0 = 0; k0 < r; k0 += kChunk) {
    for (int e = ty * kThreads + tx; e < kTile * kChunk; e += kThreads * kThreads) {
      const int i = e / kChunk, k = e % kChunk;
      const int64_t row = row0 + i, kk = k0 + k;
      left_tile[i][k] = (row < m && kk < r) ? left[row * r + kk] : 0.f;
      const int kr = e / kTile, j = e % kTile;
      const int64_t col = col0 + j, kkr = k0 + kr;
      right_tile[kr][j] = (col < n && kkr < r) ? right[kkr * n + col] : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kChunk; ++k) {
      float b[kPer];
#pragma unroll
      for (int c = 0; c < kPer; ++c) b[c] = right_tile[k][tx + c * kThreads];
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const float a = left_tile[ty * kPer + i][k];
#pragma unroll
        for (int c = 0; c < kPer; ++c) acc[i][c] = fmaf(a, b[c], acc[i][c]);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t row = row0 + ty * kPer + i;
    if (row >= m) continue;
#pragma unroll
    for (int c = 0; c < kPer; ++c) {
      const int64_t col = col0 + tx + c * kThreads;
      if (col < n) out[row * n + col] = TO(fmaf(scale, acc[i][c], static_cast<float>(w[row * n + col])));
    }
  }
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

void merge_lora_cuda(const at::Tensor& weight, const at::Tensor& left, const at::Tensor& right, double scale,
                     const at::Tensor& out) {
  lorarl::check_merge_args(weight, left, right, out);
  const c10::cuda::CUDAGuard guard(weight.device());
  const at::Tensor left_f = left.to(at::kFloat).contiguous();
  const at::Tensor right_f = right.to(at::kFloat).contiguous();
  const int64_t m = weight.size(0), n = weight.size(1);
  if (m == 0 || n == 0) return;
  const dim3 block(kThreads, kThreads);
  const dim3 grid(static_cast<unsigned>((n + kTile - 1) / kTile), static_cast<unsigned>((m + kTile - 1) / kTile));
  TORCH_CHECK(grid.y <= 65535, "merge_lora: weight has too many rows for one launch (", m, ")");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  with_storage_type(weight.scalar_type(), "weight", [&](auto* tw) {
    with_storage_type(out.scalar_type(), "out", [&](auto* to) {
      using TW = std::remove_pointer_t<decltype(tw)>;
      using TO = std::remove_pointer_t<decltype(to)>;
      merge_lora_kernel<TW, TO><<<grid, block, 0, stream>>>(
          static_cast<const TW*>(weight.const_data_ptr()), static_cast<TO*>(out.mutable_data_ptr()),
          left_f.const_data_ptr<float>(), right_f.const_data_ptr<float>(), m, n, left.size(1),
          static_cast<float>(scale));
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(lorarl, CUDA, m) { m.impl("merge_lora", &merge_lora_cuda); }
