// CoatAdamW fused step: the launch interface shared by the CUDA kernel (coat_adamw.cu) and its torch binding
// (coat_adamw.cpp). Plain C++ types only, so the kernel file builds without torch headers.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

struct CoatAdamWArgs {
  // int64 [tensors, 9]: param, grad, m_q, m_scale, m_k, v_q, v_scale, v_k addresses, then the element count.
  const int64_t* ptr_table;
  // int32 [chunks, 2]: tensor index, chunk index within that tensor.
  const int32_t* chunk_table;
  int64_t n_chunks;
  // int64 [tensors] or nullptr: the int16 remainder of each bf16 parameter (its fp32 master's low half).
  const int64_t* rem_table;
  int32_t* nonfinite;  // optional counter of non-finite moment groups (nullptr: not counted)
  // optional flag on the device (nullptr: none): non-zero skips the whole step, as fused AdamW's found_inf does,
  // so a step with a non-finite gradient norm is refused without the host ever reading the norm.
  const float* skip;
  // optional divisor of every gradient on the device (nullptr: none), torch's `grad_scale` as fused AdamW takes it:
  // the gradient-clipping factor, applied here instead of a separate pass over the gradients. Each gradient is
  // multiplied by 1 / grad_scale (IEEE) and rounded to its own dtype, as an in-place `grad.mul_(1 / scale)` leaves it.
  const float* grad_scale;
  float lr_wd, step_size, beta1, one_minus_beta1, beta2, one_minus_beta2, inv_bc2_sqrt, eps;
  float m_max, v_max, inv_m_max, inv_v_max, log2_range_m, log2_range_v, k_min, k_max;
  bool m_e5m2, v_e5m2, expand, param_bf16, grad_bf16;
  int group_size;  // 16, 32, 64, 128 or 256
};

// Elements per chunk (256 threads x 2 slices x 8 elements); the Python side builds the chunk table with it.
inline int coat_adamw_chunk_elems(int /*group_size*/) { return 4096; }

// Launches the kernel on `stream`; returns the launch error (cudaSuccess or why not).
cudaError_t coat_adamw_launch(const CoatAdamWArgs& args, int num_sms, cudaStream_t stream);
