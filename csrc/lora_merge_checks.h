// Checks shared by the CPU and CUDA kernels of lorarl::merge_lora (the Python wrapper validates first; these keep
// the op safe when called directly through torch.ops). 3-D tensors are a group of experts, merged in one call.
#pragma once
#include <ATen/ATen.h>

namespace lorarl {

inline void check_merge_args(const at::Tensor& weight, const at::Tensor& left, const at::Tensor& right,
                             const at::Tensor& out) {
  const int64_t d = weight.dim();
  TORCH_CHECK((d == 2 || d == 3) && left.dim() == d && right.dim() == d,
              "merge_lora: weight, left, right must all be 2-D, or all 3-D (a group of experts)");
  const int64_t g = d - 2;  // the leading expert dimension, if any
  TORCH_CHECK(g == 0 || (left.size(0) == weight.size(0) && right.size(0) == weight.size(0)),
              "merge_lora: weight, left and right must hold the same number of experts");
  TORCH_CHECK(left.size(g) == weight.size(g) && right.size(g + 1) == weight.size(g + 1) &&
                  left.size(g + 1) == right.size(g),
              "merge_lora: shapes must be weight [(E,) M, N], left [(E,) M, r], right [(E,) r, N]; got ",
              weight.sizes(), ", ", left.sizes(), ", ", right.sizes());
  TORCH_CHECK(out.sizes() == weight.sizes(), "merge_lora: out must have weight's shape ", weight.sizes());
  TORCH_CHECK(weight.is_contiguous() && out.is_contiguous(), "merge_lora: weight and out must be contiguous");
  TORCH_CHECK(at::isFloatingType(left.scalar_type()) && at::isFloatingType(right.scalar_type()),
              "merge_lora: left and right must be floating point");
  const auto device = weight.device();
  TORCH_CHECK(left.device() == device && right.device() == device && out.device() == device,
              "merge_lora: all tensors must be on one device");
}

// The tensors as a group of experts: 2-D ones as a group of one.
inline at::Tensor grouped(const at::Tensor& t) { return t.dim() == 2 ? t.unsqueeze(0) : t; }

}  // namespace lorarl
