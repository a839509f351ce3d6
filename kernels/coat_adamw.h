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
  // int64 [tensors] or nullptr: the int16 remainder of each bf16 parameter (its fp32 master's low half), v3 only.
  const int64_t* rem_table;
  int32_t* nonfinite;  // optional counter of non-finite moment groups (nullptr: not counted)
  float lr_wd, step_size, beta1, one_minus_beta1, beta2, one_minus_beta2, inv_bc2_sqrt, eps;
  float m_max, v_max, inv_m_max, inv_v_max, log2_range_m, log2_range_v, k_min, k_max;
  float log2_m_max, log2_v_max;  // log2(F.max), exact to float32 (v4 quantizes in the log2 domain)
  bool m_e5m2, v_e5m2, expand, param_bf16, grad_bf16;
  int variant;  // which kernel: one of the kVariant* below (coat_adamw.cu)
  int group_size;  // 16, 32, 64, 128 or 256
};

// Kernel variants, all built into the extension so one benchmark run times them side by side (coat_adamw.cu).
constexpr int kVariantV3 = 0;             // 8 elements/thread, one slice at a time, 4 blocks/SM
constexpr int kVariantV3Interleaved = 1;  // 8 elements/thread, both slices loaded before computing, 2 blocks/SM
constexpr int kVariantV4 = 2;             // 16 elements/thread, table entries prefetched, 3 blocks/SM
constexpr int kVariantV4TwoBlocks = 3;    // the same with 2 blocks/SM (up to 128 registers, no spills)
constexpr int kNumVariants = 4;

// Elements per chunk (256 threads x 2 slices x 8 elements in v3, 256 x 16 in v4); the Python side builds the chunk
// table with it.
inline int coat_adamw_chunk_elems(int /*group_size*/) { return 4096; }

// Launches the kernel on `stream`; returns the launch error (cudaSuccess or why not).
cudaError_t coat_adamw_launch(const CoatAdamWArgs& args, int num_sms, cudaStream_t stream);
