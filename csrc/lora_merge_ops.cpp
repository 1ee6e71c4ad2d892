// Registration of the fused LoRA merge op: one schema, CPU and CUDA kernels registered in their own files.
//
//   out[i, j] = weight[i, j] + scale * sum_k left[i, k] * right[k, j]
//
// `left` is [M, r], `right` is [r, N], `weight` and `out` are [M, N] row-major; fp32 accumulation and one rounding
// to out's dtype. With a leading expert dimension (`weight` [E, M, N], `left` [E, M, r], `right` [E, r, N]) every
// expert is merged in the one call (a mixture of experts' fused expert weights). `out` may be `weight` itself (in place). For peft's nn.Linear: left = lora_B, right = lora_A;
// for fan_in_fan_out (GPT-2 Conv1D) and embeddings: left = lora_A^T, right = lora_B^T.
#include <torch/library.h>

TORCH_LIBRARY(lorarl, m) {
  m.def("merge_lora(Tensor weight, Tensor left, Tensor right, float scale, Tensor(a!) out) -> ()");
}
