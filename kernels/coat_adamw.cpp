// Torch binding of the CoatAdamW CUDA kernel: checks the launch tables and scalars, then launches on the current
// stream. The per-tensor checks (dtypes, sizes, devices) happen once in Python (megacoat/ops/coat_adamw_tables.py),
// which builds the tables; this file checks what it reads itself.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cmath>

#include "coat_adamw.h"

namespace {

void coat_adamw_step(const torch::Tensor& ptr_table, const torch::Tensor& chunk_table,
                     const c10::optional<torch::Tensor>& nonfinite, const c10::optional<torch::Tensor>& rem_table,
                     const c10::optional<torch::Tensor>& skip, const c10::optional<torch::Tensor>& grad_scale,
                     double lr_wd, double step_size, double beta1,
                     double beta2, double bc2_sqrt, double eps, double m_max, double v_max, double log2_range_m,
                     double log2_range_v, double k_min, double k_max, bool m_e5m2, bool v_e5m2, bool expand,
                     bool param_bf16, bool grad_bf16, int64_t group_size) {
  TORCH_CHECK(ptr_table.is_cuda() && chunk_table.is_cuda(), "coat_adamw: tables must be CUDA tensors");
  TORCH_CHECK(ptr_table.scalar_type() == torch::kInt64 && ptr_table.dim() == 2 && ptr_table.size(1) == 9 &&
                  ptr_table.is_contiguous(),
              "coat_adamw: pointer table must be a contiguous int64 [tensors, 9]");
  TORCH_CHECK(chunk_table.scalar_type() == torch::kInt32 && chunk_table.dim() == 2 && chunk_table.size(1) == 2 &&
                  chunk_table.is_contiguous(),
              "coat_adamw: chunk table must be a contiguous int32 [chunks, 2]");
  TORCH_CHECK(group_size == 16 || group_size == 32 || group_size == 64 || group_size == 128 || group_size == 256,
              "coat_adamw: group_size must be 16, 32, 64, 128 or 256, got ", group_size);
  int32_t* counter = nullptr;
  if (nonfinite.has_value()) {
    TORCH_CHECK(nonfinite->is_cuda() && nonfinite->scalar_type() == torch::kInt32 && nonfinite->numel() == 1,
                "coat_adamw: nonfinite must be a CUDA int32 tensor of one element");
    counter = nonfinite->data_ptr<int32_t>();
  }
  const int64_t* remainders = nullptr;
  if (rem_table.has_value()) {
    TORCH_CHECK(rem_table->is_cuda() && rem_table->scalar_type() == torch::kInt64 && rem_table->dim() == 1 &&
                    rem_table->size(0) == ptr_table.size(0) && rem_table->is_contiguous(),
                "coat_adamw: remainder table must be a contiguous CUDA int64 [tensors]");
    TORCH_CHECK(param_bf16, "coat_adamw: remainders go with bfloat16 parameters");
    remainders = rem_table->data_ptr<int64_t>();
  }
  const float* skip_flag = nullptr;
  if (skip.has_value()) {
    TORCH_CHECK(skip->is_cuda() && skip->scalar_type() == torch::kFloat32 && skip->numel() == 1,
                "coat_adamw: skip must be a CUDA float32 tensor of one element");
    skip_flag = skip->data_ptr<float>();
  }
  const float* divisor = nullptr;
  if (grad_scale.has_value()) {
    TORCH_CHECK(grad_scale->is_cuda() && grad_scale->scalar_type() == torch::kFloat32 && grad_scale->numel() == 1,
                "coat_adamw: grad_scale must be a CUDA float32 tensor of one element");
    divisor = grad_scale->data_ptr<float>();
  }
  const c10::cuda::CUDAGuard guard(ptr_table.device());
  CoatAdamWArgs a{};
  a.ptr_table = ptr_table.data_ptr<int64_t>();
  a.chunk_table = chunk_table.data_ptr<int32_t>();
  a.n_chunks = chunk_table.size(0);
  a.nonfinite = counter;
  a.rem_table = remainders;
  a.skip = skip_flag;
  a.grad_scale = divisor;
  a.lr_wd = static_cast<float>(lr_wd);
  a.step_size = static_cast<float>(step_size);
  a.beta1 = static_cast<float>(beta1);
  a.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  a.beta2 = static_cast<float>(beta2);
  a.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  a.inv_bc2_sqrt = static_cast<float>(1.0 / bc2_sqrt);
  a.eps = static_cast<float>(eps);
  a.m_max = static_cast<float>(m_max);
  a.v_max = static_cast<float>(v_max);
  a.inv_m_max = static_cast<float>(1.0 / m_max);
  a.inv_v_max = static_cast<float>(1.0 / v_max);
  a.log2_range_m = static_cast<float>(log2_range_m);
  a.log2_range_v = static_cast<float>(log2_range_v);
  a.k_min = static_cast<float>(k_min);
  a.k_max = static_cast<float>(k_max);
  a.m_e5m2 = m_e5m2;
  a.v_e5m2 = v_e5m2;
  a.expand = expand;
  a.param_bf16 = param_bf16;
  a.grad_bf16 = grad_bf16;
  a.group_size = static_cast<int>(group_size);
  int num_sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, ptr_table.get_device()));
  const cudaError_t err = coat_adamw_launch(a, num_sms, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "coat_adamw: kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("coat_adamw_step", &coat_adamw_step, "CoatAdamW fused step over a list of tensors (see coat_adamw.h)");
  m.def("chunk_elems", [](int64_t g) { return coat_adamw_chunk_elems(static_cast<int>(g)); },
        "elements per chunk of the chunk table for a group size");
}
