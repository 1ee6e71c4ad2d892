// Checks shared by the CPU and CUDA kernels of lorarl::merge_lora (the Python wrapper validates first; these keep
// the op safe when called directly through torch.ops).
#pragma once
#include <ATen/ATen.h>

namespace lorarl {

inline void check_merge_args(const at::Tensor& weight, const at::Tensor& left, const at::Tensor& right,
                             const at::Tensor& out) {
  TORCH_CHECK(weight.dim() == 2 && left.dim() == 2 && right.dim() == 2, "merge_lora: weight, left, right must be 2-D");
  TORCH_CHECK(left.size(0) == weight.size(0) && right.size(1) == weight.size(1) && left.size(1) == right.size(0),
              "merge_lora: shapes must be weight [M, N], left [M, r], right [r, N]; got ", weight.sizes(), ", ",
              left.sizes(), ", ", right.sizes());
  TORCH_CHECK(out.sizes() == weight.sizes(), "merge_lora: out must have weight's shape ", weight.sizes());
  TORCH_CHECK(weight.is_contiguous() && out.is_contiguous(), "merge_lora: weight and out must be contiguous");
  TORCH_CHECK(at::isFloatingType(left.scalar_type()) && at::isFloatingType(right.scalar_type()),
              "merge_lora: left and right must be floating point");
  const auto device = weight.device();
  TORCH_CHECK(left.device() == device && right.device() == device && out.device() == device,
              "merge_lora: all tensors must be on one device");
}

}  // namespace lorarl
