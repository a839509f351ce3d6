// CoatAdamW fused step (CUDA): AdamW with FP8 moments under per-group dynamic range expansion.
//
// One launch covers every tensor of a list (pointer table + chunk table, see coat_adamw.h). Two kernels, built in
// four variants (coat_adamw.h, kVariant*) that one benchmark run times side by side:
// - v3 (coat_adamw_kernel, the default): a block of 256 threads takes one chunk at a time (grid-stride); each thread
//   holds VEC = 8 consecutive elements (2 x 16-byte fp32 loads) for UNROLL slices, so a group of G elements lives in
//   L = G / 8 neighbouring lanes and its amax / amin are shuffle reductions inside the warp.
// - v4 (coat_adamw_kernel_v4): 16 elements a thread, table lookups off the critical path (see there).
// Per element the step reads p, g, m_q, v_q and writes p, m_q, v_q once; scales and exponents are read and written
// once per group. Formulas and their float32 order follow megacoat/ops/coat_adamw_ref.py; exp2 / log2 use the
// hardware approximations (ex2.approx, lg2.approx: ~2 ulp), the dequantization inverts the same stored bf16 k and
// fp32 scale the quantization wrote.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "coat_adamw.h"

namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 2;

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float fast_sqrt(float x) {
  float y;
  asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// a / b as div.approx.ftz (MUFU.RCP + FMUL): __fdividef's non-ftz form adds a subnormal fix-up (3 instructions).
__device__ __forceinline__ float fast_div(float a, float b) {
  float y;
  asm("div.approx.ftz.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
}

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <typename T> __device__ __forceinline__ T zero_of() { return T(0); }

// An fp32 master weight kept as its bf16 parameter plus a 16-bit remainder (megacoat/ops/param_remainder.py, the
// contract): the bf16 is the master rounded to nearest, ties away from zero (high half + 1 when the low half, read
// as int16, is negative), the remainder is the low half. Both directions are exact.
__device__ __forceinline__ float join_master(__nv_bfloat16 p, int16_t rem) {
  const uint32_t hi = static_cast<uint16_t>(__bfloat16_as_ushort(p) - (rem < 0 ? 1 : 0));
  return __uint_as_float((hi << 16) | static_cast<uint16_t>(rem));
}
__device__ __forceinline__ void split_master(float x, __nv_bfloat16& p, int16_t& rem) {
  const uint32_t bits = __float_as_uint(x);
  uint16_t hi = static_cast<uint16_t>(bits >> 16);
  rem = static_cast<int16_t>(bits & 0xffffu);
  if (rem < 0 && (hi & 0x7fffu) != 0x7fffu) ++hi;  // a NaN never carries into the sign bit
  p = __ushort_as_bfloat16(hi);
}
template <> __device__ __forceinline__ __nv_bfloat16 zero_of<__nv_bfloat16>() { return __ushort_as_bfloat16(0); }

#ifdef COAT_ADAMW_VECTOR_PATH_ONLY  // static SASS counts only (bench_optimizer.py --sass): the hot path, no tails
constexpr bool kTailPath = false;
#else
constexpr bool kTailPath = true;
#endif
#ifdef COAT_ADAMW_EXPAND_PATH_ONLY  // static SASS counts only: without the k == 1 shortcuts (which the compiler
constexpr bool kPlainShortcut = false;  // builds as a second copy of the code), static = dynamic count of a chunk
#else
constexpr bool kPlainShortcut = true;
#endif

// An unsigned type of exactly N bytes, for one vector load / store.
template <int N> struct Word;
template <> struct Word<1> { using type = uint8_t; };
template <> struct Word<2> { using type = uint16_t; };
template <> struct Word<4> { using type = uint32_t; };
template <> struct Word<8> { using type = uint2; };
template <> struct Word<16> { using type = uint4; };

// VEC elements of T starting at i: one (or two, for 32 bytes) vector load when whole and aligned, else masked.
template <typename T, int VEC>
__device__ __forceinline__ void load_vec(const T* ptr, int64_t i, int64_t n, bool vector_ok, T (&out)[VEC]) {
  constexpr int kBytes = VEC * sizeof(T);
  if (!kTailPath || (vector_ok && i + VEC <= n)) {
    constexpr int kWord = kBytes > 16 ? 16 : kBytes;
    using W = typename Word<kWord>::type;
    const W* src = reinterpret_cast<const W*>(ptr + i);
    W* dst = reinterpret_cast<W*>(out);
#pragma unroll
    for (int w = 0; w < kBytes / kWord; ++w) dst[w] = src[w];
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] = (i + j < n) ? ptr[i + j] : zero_of<T>();
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void store_vec(T* ptr, int64_t i, int64_t n, bool vector_ok, const T (&in)[VEC]) {
  constexpr int kBytes = VEC * sizeof(T);
  if (!kTailPath || (vector_ok && i + VEC <= n)) {
    constexpr int kWord = kBytes > 16 ? 16 : kBytes;
    using W = typename Word<kWord>::type;
    W* dst = reinterpret_cast<W*>(ptr + i);
    const W* src = reinterpret_cast<const W*>(in);
#pragma unroll
    for (int w = 0; w < kBytes / kWord; ++w) dst[w] = src[w];
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j)
      if (i + j < n) ptr[i + j] = in[j];
  }
}

// v4's vector accesses: 16-byte words through explicit global-space streaming instructions (ld/st.global.cs:
// evict-first, every byte is touched once), where plain dereferences of addresses read from a table compile to
// generic LD/ST. Tails (and unaligned views) take the masked element path.
template <typename T, int VEC>
__device__ __forceinline__ void load_stream(const T* ptr, int64_t i, int64_t n, bool vector_ok, T (&out)[VEC]) {
  static_assert((VEC * sizeof(T)) % 16 == 0, "whole 16-byte words");
  if (!kTailPath || (vector_ok && i + VEC <= n)) {
    const uint4* src = reinterpret_cast<const uint4*>(ptr + i);
    uint4* dst = reinterpret_cast<uint4*>(out);
#pragma unroll
    for (int w = 0; w < (int)(VEC * sizeof(T) / 16); ++w) dst[w] = __ldcs(src + w);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] = (i + j < n) ? ptr[i + j] : zero_of<T>();
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void store_stream(T* ptr, int64_t i, int64_t n, bool vector_ok, const T (&in)[VEC]) {
  static_assert((VEC * sizeof(T)) % 16 == 0, "whole 16-byte words");
  if (!kTailPath || (vector_ok && i + VEC <= n)) {
    uint4* dst = reinterpret_cast<uint4*>(ptr + i);
    const uint4* src = reinterpret_cast<const uint4*>(in);
#pragma unroll
    for (int w = 0; w < (int)(VEC * sizeof(T) / 16); ++w) __stcs(dst + w, src[w]);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j)
      if (i + j < n) ptr[i + j] = in[j];
  }
}

// Reduction over the L lanes of one group (L divides 32, groups start at multiples of L).
template <int L> __device__ __forceinline__ float group_max(float x) {
#pragma unroll
  for (int o = L / 2; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
template <int L> __device__ __forceinline__ float group_min(float x) {
#pragma unroll
  for (int o = L / 2; o > 0; o >>= 1) x = fminf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

struct Moment {
  uint8_t* q;
  float* scale;
  __nv_bfloat16* k;
  float fmax, inv_fmax, log2_range;
  bool e5m2;
};

__device__ __forceinline__ __nv_fp8_interpretation_t fp8_kind(const Moment& mo) {
#ifdef COAT_ADAMW_EXPAND_PATH_ONLY  // static counts only: one format, so the compiler keeps one copy of the code
  return __NV_E4M3;
#else
  return mo.e5m2 ? __NV_E5M2 : __NV_E4M3;
#endif
}

// Dequantize VEC codes of one group: x = sign(q) * (|q| * fp32(1/F.max))^(1/k) * (scale * F.max).
template <int VEC>
__device__ __forceinline__ void dequantize(const uint8_t (&q)[VEC], float scale, float k, const Moment& mo,
                                           float (&x)[VEC]) {
  const float mult = scale * mo.fmax;
  const float inv_k = 1.0f / k;
#pragma unroll
  for (int j = 0; j < VEC; j += 2) {
    // Two codes per conversion instruction (cvt.rn.f16x2.e4m3x2 / e5m2x2 on sm_89+).
    const __nv_fp8x2_storage_t pair = static_cast<__nv_fp8x2_storage_t>(q[j] | (q[j + 1] << 8));
    const float2 qf = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, fp8_kind(mo))));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float qv = h == 0 ? qf.x : qf.y;
      const float rq = fabsf(qv) * mo.inv_fmax;
      const float e = (kPlainShortcut && k == 1.0f) ? rq : fast_exp2(fast_log2(rq) * inv_k);
      const float v = e * mult;
      x[j + h] = qv < 0.0f ? -v : v;
    }
  }
}

// v4's dequantization, split so that a thread converts its codes a few at a time (fewer registers live): the
// group's constants once, then pairs of codes. The same value as dequantize() above, with fewer instructions per
// element: the multiply by scale * F.max * beta moves into the exponent (one FFMA: y = log2(rq) / k +
// log2(scale * F.max * beta), rounded once, where dequantize() rounds log2(rq) / k and then the product) and the sign
// is copied, not selected. Relative error against dequantize(): ~|y| * 2^-24 (y = log2 of the moment, |y| < 64 for
// moments > 1e-19). Moments below 2^-126 flush to zero (ex2.approx.ftz), where dequantize() keeps subnormals: for
// Adam that is far below eps (sqrt(v) < 1e-19), and m that small moves no parameter.
struct GroupDequant {
  float mult, inv_k, log2_mult;
  bool plain;  // k == 1: no exp2/log2
};

// beta: Adam's decay of this moment, folded into the multiplier (the update's beta * m costs nothing more).
__device__ __forceinline__ GroupDequant group_dequant(float scale, float k, float beta, const Moment& mo) {
  const float mult = scale * mo.fmax * beta;
  return GroupDequant{mult, 1.0f / k, fast_log2(mult), kPlainShortcut && k == 1.0f};
}

// Two codes, packed as they lie in memory (low byte first), to beta * their moments.
__device__ __forceinline__ float2 dequantize_pair(uint32_t pair, const GroupDequant& d, const Moment& mo) {
  const float2 qf = __half22float2(__half2(
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xffffu), fp8_kind(mo))));
  float out[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float qv = h == 0 ? qf.x : qf.y;
    const float rq = fabsf(qv) * mo.inv_fmax;
    // log2(0) = -inf -> 0; a NaN scale (non-finite group) stays NaN, as in the reference
    const float v = d.plain ? rq * d.mult : fast_exp2(fmaf(fast_log2(rq), d.inv_k, d.log2_mult));
    out[h] = copysignf(v, qv);
  }
  return make_float2(out[0], out[1]);
}

// 16 codes <-> four 32-bit words (16-byte accesses; byte by byte on tails and unaligned views).
__device__ __forceinline__ void load_codes(const uint8_t* ptr, int64_t i, int64_t n, bool vector_ok,
                                           uint32_t (&w)[4]) {
  if (!kTailPath || (vector_ok && i + 16 <= n)) {
    const uint4 x = __ldcs(reinterpret_cast<const uint4*>(ptr + i));
    w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w;
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      w[j] = 0;
#pragma unroll
      for (int b = 0; b < 4; ++b)
        if (i + 4 * j + b < n) w[j] |= static_cast<uint32_t>(ptr[i + 4 * j + b]) << (8 * b);
    }
  }
}

__device__ __forceinline__ void store_codes(uint8_t* ptr, int64_t i, int64_t n, bool vector_ok,
                                            const uint32_t (&w)[4]) {
  if (!kTailPath || (vector_ok && i + 16 <= n)) {
    __stcs(reinterpret_cast<uint4*>(ptr + i), make_uint4(w[0], w[1], w[2], w[3]));
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int b = 0; b < 4; ++b)
        if (i + 4 * j + b < n) ptr[i + 4 * j + b] = static_cast<uint8_t>(w[j] >> (8 * b));
  }
}

// A group's quantization constants from each lane's partial amax / non-zero amin (both variants below).
struct GroupStats {
  float amax;               // over the group (inf when it holds a NaN or an Inf)
  bool finite;
  __nv_bfloat16 k_bf16;     // the expansion exponent as stored
  float kf;                 // ... and as used, so that dequantization inverts exactly what was applied
  float inv_amax;           // 0 for an all-zero or non-finite group
};

template <int L>
__device__ __forceinline__ GroupStats group_stats(float amax, float amin, const Moment& mo, const CoatAdamWArgs& a) {
  GroupStats st;
  st.amax = group_max<L>(amax);
  if (st.amax < FLT_MIN) st.amax = 0.0f;  // below 2^-126: stored as a zero group (the reference's rule)
  amin = group_min<L>(amin);
  st.finite = st.amax < INFINITY;
  float k = 1.0f;
  if (a.expand && st.finite && st.amax > amin) {
    // Once per group: the accurate log2f, so k agrees with the reference's except on bf16 rounding ties.
    k = fminf(fmaxf(mo.log2_range / log2f(st.amax / amin), a.k_min), a.k_max);
  }
  st.k_bf16 = __float2bfloat16_rn(k);
  st.kf = __bfloat162float(st.k_bf16);
  st.inv_amax = (st.finite && st.amax > 0.0f) ? 1.0f / st.amax : 0.0f;
  return st;
}

// v4's quantization: quantize() above with fewer instructions per element. F.max moves into the exponent (one FFMA:
// log2(q) = k * log2(|x| / amax) + log2(F.max)), the clamp to F.max is left to the saturating conversion, the sign
// is copied, and a non-finite group (rare) is zeroed by a branch instead of a select per element.
template <int VEC, int L>
__device__ __forceinline__ bool quantize_v4(const float (&x)[VEC], const Moment& mo, float log2_fmax,
                                            const CoatAdamWArgs& a, int64_t group, bool group_leader,
                                            bool group_valid, uint32_t (&q)[VEC / 4]) {
  float amax = 0.0f, amin = INFINITY;
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const float ax = isnan(x[j]) ? INFINITY : fabsf(x[j]);  // NaN counts as non-finite
    amax = fmaxf(amax, ax);
    if (ax > 0.0f) amin = fminf(amin, ax);
  }
  const GroupStats st = group_stats<L>(amax, amin, mo, a);
  const bool finite = st.finite;
  const __nv_bfloat16 k_bf16 = st.k_bf16;
  const float kf = st.kf, inv_amax = st.inv_amax;
  amax = st.amax;
  const bool plain = kPlainShortcut && kf == 1.0f;
  float out[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const float r = fabsf(x[j]) * inv_amax;
    const float mag = plain ? r * mo.fmax : fast_exp2(fmaf(kf, fast_log2(r), log2_fmax));  // r = 0 -> 0
    out[j] = copysignf(mag, x[j]);
  }
  if (!finite) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] = 0.0f;
  }
#pragma unroll
  for (int j = 0; j < VEC; j += 4) {
    // Round to nearest even, saturating at F.max: two values per conversion instruction, two pairs per word.
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(out[j], out[j + 1]), __NV_SATFINITE, fp8_kind(mo));
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(out[j + 2], out[j + 3]), __NV_SATFINITE, fp8_kind(mo));
    q[j / 4] = lo | (hi << 16);
  }
  if (group_leader && group_valid) {
    mo.scale[group] = finite ? amax / mo.fmax : NAN;
    mo.k[group] = k_bf16;
  }
  return finite;
}

// Quantize VEC values of one group (its other values sit in the neighbouring lanes); returns false for a
// non-finite group. The lane holding the group's first element writes its scale and k.
template <int VEC, int L>
__device__ __forceinline__ bool quantize(const float (&x)[VEC], const Moment& mo, const CoatAdamWArgs& a,
                                         int64_t group, bool group_leader, bool group_valid, uint8_t (&q)[VEC]) {
  float amax = 0.0f, amin = INFINITY;
  float ax[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    ax[j] = isnan(x[j]) ? INFINITY : fabsf(x[j]);  // NaN counts as non-finite
    amax = fmaxf(amax, ax[j]);
    if (ax[j] > 0.0f) amin = fminf(amin, ax[j]);
  }
  const GroupStats st = group_stats<L>(amax, amin, mo, a);
  const bool finite = st.finite;
  const __nv_bfloat16 k_bf16 = st.k_bf16;
  const float kf = st.kf, inv_amax = st.inv_amax;
  amax = st.amax;
  float out[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const float r = ax[j] * inv_amax;
    const float f = (kPlainShortcut && kf == 1.0f) ? r : fast_exp2(kf * fast_log2(r));
    const float mag = fminf(f * mo.fmax, mo.fmax);
    out[j] = finite ? (x[j] < 0.0f ? -mag : mag) : 0.0f;
  }
#pragma unroll
  for (int j = 0; j < VEC; j += 2) {
    // Round to nearest even, saturating (|out| <= F.max already): two values per conversion instruction.
    const __nv_fp8x2_storage_t pair = __nv_cvt_float2_to_fp8x2(make_float2(out[j], out[j + 1]), __NV_SATFINITE,
                                                               fp8_kind(mo));
    q[j] = static_cast<uint8_t>(pair & 0xff);
    q[j + 1] = static_cast<uint8_t>(pair >> 8);
  }
  if (group_leader && group_valid) {
    mo.scale[group] = finite ? amax / mo.fmax : NAN;
    mo.k[group] = k_bf16;
  }
  return finite;
}

// REM: the parameters are bf16 with a remainder each (a.rem_table), read and written as one exact fp32 master; the
// update is the same float32 expression as for fp32 parameters (one explicit FMA, no contraction left to the
// compiler), so the master is bit for bit the one an fp32 parameter would hold.
// STEP slices are loaded together before any is computed: STEP = 2 keeps twice the bytes in flight per thread
// (more registers, 2 blocks per SM), STEP = 1 halves the registers (4 blocks per SM). Both are built; the faster
// on the H100/H200 is the default (benchmarks/bench_optimizer.py measures both).
template <int G, typename PT, typename GT, int STEP, bool REM>
__global__ void __launch_bounds__(kThreads, STEP == 2 ? 2 : 4) coat_adamw_kernel(const CoatAdamWArgs a) {
  constexpr int VEC = 8;  // 32 bytes of fp32 per thread per slice: per-group work is shared by 8 elements
  constexpr int L = G / VEC;
  constexpr int kChunk = kThreads * VEC * kUnroll;
  static_assert(L <= 32 && 32 % L == 0, "a group must sit inside one warp");
  static_assert(kUnroll % STEP == 0, "STEP divides the slices of a chunk");
  static_assert(!REM || sizeof(PT) == 2, "remainders go with bf16 parameters");

  for (int64_t c = blockIdx.x; c < a.n_chunks; c += gridDim.x) {
    const int64_t t = a.chunk_table[2 * c];
    const int64_t chunk = a.chunk_table[2 * c + 1];
    const int64_t* row = a.ptr_table + 9 * t;
    PT* p_ptr = reinterpret_cast<PT*>(row[0]);
    const GT* g_ptr = reinterpret_cast<const GT*>(row[1]);
    const Moment mm{reinterpret_cast<uint8_t*>(row[2]), reinterpret_cast<float*>(row[3]),
                    reinterpret_cast<__nv_bfloat16*>(row[4]), a.m_max, a.inv_m_max, a.log2_range_m, a.m_e5m2};
    const Moment vm{reinterpret_cast<uint8_t*>(row[5]), reinterpret_cast<float*>(row[6]),
                    reinterpret_cast<__nv_bfloat16*>(row[7]), a.v_max, a.inv_v_max, a.log2_range_v, a.v_e5m2};
    const int64_t n = row[8];
    // Vector accesses need every base aligned to its vector width (views into a flat buffer may not be).
    int16_t* r_ptr = REM ? reinterpret_cast<int16_t*>(a.rem_table[t]) : nullptr;
    const bool vector_ok = ((row[0] | row[1] | reinterpret_cast<int64_t>(r_ptr)) % 16 == 0) &&
                           ((row[2] | row[5]) % (VEC) == 0);

#pragma unroll
    for (int u0 = 0; u0 < kUnroll; u0 += STEP) {
      PT p[STEP][VEC];
      int16_t r[STEP][REM ? VEC : 1];
      GT g[STEP][VEC];
      uint8_t mq[STEP][VEC], vq[STEP][VEC];
      float ms[STEP], mk[STEP], vs[STEP], vk[STEP];
      int64_t base[STEP];
#pragma unroll
      for (int u = 0; u < STEP; ++u) {
        base[u] = chunk * kChunk + (int64_t)((u0 + u) * kThreads + threadIdx.x) * VEC;
        load_vec<PT, VEC>(p_ptr, base[u], n, vector_ok, p[u]);
        if constexpr (REM) load_vec<int16_t, VEC>(r_ptr, base[u], n, vector_ok, r[u]);
        load_vec<GT, VEC>(g_ptr, base[u], n, vector_ok, g[u]);
        load_vec<uint8_t, VEC>(mm.q, base[u], n, vector_ok, mq[u]);
        load_vec<uint8_t, VEC>(vm.q, base[u], n, vector_ok, vq[u]);
        const int64_t group = base[u] / G;
        const bool valid = base[u] < n;
        ms[u] = valid ? mm.scale[group] : 0.0f;
        vs[u] = valid ? vm.scale[group] : 0.0f;
        mk[u] = valid ? __bfloat162float(mm.k[group]) : 1.0f;
        vk[u] = valid ? __bfloat162float(vm.k[group]) : 1.0f;
      }
#pragma unroll
      for (int u = 0; u < STEP; ++u) {
        float m[VEC], v[VEC];
        dequantize<VEC>(mq[u], ms[u], mk[u], mm, m);
        dequantize<VEC>(vq[u], vs[u], vk[u], vm, v);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float gj = to_float<GT>(g[u][j]);
          m[j] = a.beta1 * m[j] + a.one_minus_beta1 * gj;
          v[j] = a.beta2 * v[j] + a.one_minus_beta2 * (gj * gj);
          // sqrt.approx, a multiply by 1/sqrt(1-beta2^t) and __fdividef: ~1-2 ulp each (the tests allow it),
          // where IEEE sqrt and two IEEE divisions cost ~40 instructions per element.
          const float denom = fast_sqrt(v[j]) * a.inv_bc2_sqrt + a.eps;
          float pj;
          if constexpr (REM) pj = join_master(p[u][j], r[u][j]);
          else pj = to_float<PT>(p[u][j]);
          const float updated = fmaf(-a.step_size, __fdividef(m[j], denom), pj * (1.0f - a.lr_wd));
          if constexpr (REM) split_master(updated, p[u][j], r[u][j]);
          else p[u][j] = from_float<PT>(updated);
        }
        store_vec<PT, VEC>(p_ptr, base[u], n, vector_ok, p[u]);
        if constexpr (REM) store_vec<int16_t, VEC>(r_ptr, base[u], n, vector_ok, r[u]);
        const int64_t group = base[u] / G;
        const bool leader = (threadIdx.x % L) == 0;
        const bool valid = base[u] < n;  // the group's first element exists (leader's view)
        const bool m_ok = quantize<VEC, L>(m, mm, a, group, leader, valid, mq[u]);
        const bool v_ok = quantize<VEC, L>(v, vm, a, group, leader, valid, vq[u]);
        store_vec<uint8_t, VEC>(mm.q, base[u], n, vector_ok, mq[u]);
        store_vec<uint8_t, VEC>(vm.q, base[u], n, vector_ok, vq[u]);
        if (a.nonfinite != nullptr && leader && valid && !(m_ok && v_ok))
          atomicAdd(a.nonfinite, (m_ok ? 0 : 1) + (v_ok ? 0 : 1));
      }
    }
  }
}

// v4 (kVariantV4, kVariantV4TwoBlocks): one slice of VEC = 16 elements per thread, so a chunk is still 256 x 16 =
// 4096 elements (the same tables) and a group of 128 spans 8 lanes. Against v3:
// - twice the bytes in flight per thread: p, g as 4 x 16 B, m, v codes as one 16 B word each, all issued before any
//   is used, through ld/st.global.cs (v3's dereferences of table addresses compile to generic LD/ST);
// - the launch tables off the data's critical path: a block walks a contiguous run of chunks, loads the next
//   chunk's table entry one chunk ahead and reloads the pointer row only when the run enters another tensor (v3:
//   chunk table -> pointer row -> data, two dependent loads before every chunk's first data load);
// - fewer instructions per element (static SASS, one path through a chunk: ~76 against v3's ~118): each group's
//   scalar work (accurate log2f, IEEE divisions, shuffles) shared by 16 elements instead of 8; scale * F.max and
//   Adam's beta moved into the exponent of the dequantization, F.max into that of the quantization (one FFMA each);
//   signs copied, not selected; the clamp to F.max left to the saturating conversion; codes kept as the words they
//   are loaded and stored as; div.approx.ftz for m / denom.
// Same formulas as v3 and the reference up to float32 rounding (bounded in tests/ops/test_coat_adamw.py).
// BLOCKS (blocks per SM the registers must allow): 3 caps a thread at 80 registers (a few bytes of spills to L1,
// 3 x 256 x 160 B = 120 KB of loads in flight per SM); 2 lets it have 128 (no spills, 80 KB in flight). Both are
// built; the benchmark decides.
constexpr int kV4Vec = 16;

struct Row {
  const void* p;
  const void* g;
  uint8_t* mq;
  float* ms;
  __nv_bfloat16* mk;
  uint8_t* vq;
  float* vs;
  __nv_bfloat16* vk;
  int64_t n;
  bool vector_ok;
};

__device__ __forceinline__ Row load_row(const int64_t* table, int t) {
  const int64_t* r = table + 9 * (int64_t)t;
  Row row{reinterpret_cast<const void*>(r[0]), reinterpret_cast<const void*>(r[1]), reinterpret_cast<uint8_t*>(r[2]),
          reinterpret_cast<float*>(r[3]), reinterpret_cast<__nv_bfloat16*>(r[4]), reinterpret_cast<uint8_t*>(r[5]),
          reinterpret_cast<float*>(r[6]), reinterpret_cast<__nv_bfloat16*>(r[7]), r[8], false};
  row.vector_ok = ((r[0] | r[1] | r[2] | r[5]) % 16) == 0;  // every vector access of v4 is 16 bytes
  return row;
}

template <int G, typename PT, typename GT, int BLOCKS>
__global__ void __launch_bounds__(kThreads, BLOCKS) coat_adamw_kernel_v4(const CoatAdamWArgs a) {
  constexpr int VEC = kV4Vec;
  constexpr int L = G / VEC;
  constexpr int kChunk = kThreads * VEC;
  static_assert(kChunk == kThreads * 8 * kUnroll, "v4 keeps v3's chunk size, so both share the launch tables");
  static_assert(L >= 1 && L <= 32 && 32 % L == 0, "a group must sit inside one warp");

  // Chunk indices fit in 32 bits (the chunk table is int32): fewer registers than int64 counters.
  const int n_chunks = static_cast<int>(a.n_chunks);
  const int per_block = (n_chunks + gridDim.x - 1) / gridDim.x;
  int c = blockIdx.x * per_block;
  const int end = c + per_block < n_chunks ? c + per_block : n_chunks;
  if (c >= end) return;
  const int2* entries = reinterpret_cast<const int2*>(a.chunk_table);  // [chunks] of (tensor, chunk in tensor)
  int2 e = entries[c];
  Row row = load_row(a.ptr_table, e.x);
  for (; c < end; ++c) {
    // Issued now, used after this chunk: its latency hides behind the chunk's own loads.
    const int2 next = c + 1 < end ? entries[c + 1] : e;
    const int64_t base = (int64_t)e.y * kChunk + (int64_t)threadIdx.x * VEC;
    const int64_t n = row.n;
    const bool vok = row.vector_ok;
    const Moment mm{row.mq, row.ms, row.mk, a.m_max, a.inv_m_max, a.log2_range_m, a.m_e5m2};
    const Moment vm{row.vq, row.vs, row.vk, a.v_max, a.inv_v_max, a.log2_range_v, a.v_e5m2};
    PT* p_ptr = reinterpret_cast<PT*>(const_cast<void*>(row.p));
    const GT* g_ptr = reinterpret_cast<const GT*>(row.g);

    PT p[VEC];
    GT g[VEC];
    uint32_t mq[VEC / 4], vq[VEC / 4];  // codes as loaded: four to a word, the first in the low byte
    load_stream<PT, VEC>(p_ptr, base, n, vok, p);
    load_stream<GT, VEC>(g_ptr, base, n, vok, g);
    load_codes(mm.q, base, n, vok, mq);
    load_codes(vm.q, base, n, vok, vq);
    const int64_t group = base / G;  // all VEC elements of a thread lie in one group (VEC divides G)
    const bool valid = base < n;
    // Read before the group's leader rewrites them (after the shuffles below), never after: the read-only path is safe.
    const float ms = valid ? __ldg(mm.scale + group) : 0.0f;
    const float vs = valid ? __ldg(vm.scale + group) : 0.0f;
    const float mk = valid ? __bfloat162float(__ldg(mm.k + group)) : 1.0f;
    const float vk = valid ? __bfloat162float(__ldg(vm.k + group)) : 1.0f;

    // Dequantize, update and store the parameter a quarter (16 bytes of p) at a time: p and g die as m and v are
    // born, so fewer registers are live at once. The dequantized moments come out already times beta1 / beta2.
    const GroupDequant dm = group_dequant(ms, mk, a.beta1, mm), dv = group_dequant(vs, vk, a.beta2, vm);
    float m[VEC], v[VEC];
    constexpr int Q = 16 / sizeof(PT);  // elements per 16-byte store of p
#pragma unroll
    for (int j0 = 0; j0 < VEC; j0 += Q) {
      PT pq[Q];
#pragma unroll
      for (int j = j0; j < j0 + Q; j += 2) {
        const int shift = 8 * (j % 4);  // 0 or 16: the pair's half of its word
        const float2 m2 = dequantize_pair(mq[j / 4] >> shift, dm, mm), v2 = dequantize_pair(vq[j / 4] >> shift, dv, vm);
        m[j] = m2.x, m[j + 1] = m2.y, v[j] = v2.x, v[j + 1] = v2.y;
      }
#pragma unroll
      for (int j = j0; j < j0 + Q; ++j) {
        const float gj = to_float<GT>(g[j]);
        m[j] = fmaf(a.one_minus_beta1, gj, m[j]);
        v[j] = fmaf(a.one_minus_beta2, gj * gj, v[j]);
        const float denom = fast_sqrt(v[j]) * a.inv_bc2_sqrt + a.eps;  // >= eps: never subnormal
        const float pj = to_float<PT>(p[j]);
        pq[j - j0] = from_float<PT>(pj * (1.0f - a.lr_wd) - a.step_size * fast_div(m[j], denom));
      }
      store_stream<PT, Q>(p_ptr, base + j0, n, vok, pq);
    }
    const bool leader = (threadIdx.x % L) == 0;
    const bool m_ok = quantize_v4<VEC, L>(m, mm, a.log2_m_max, a, group, leader, valid, mq);
    const bool v_ok = quantize_v4<VEC, L>(v, vm, a.log2_v_max, a, group, leader, valid, vq);
    store_codes(mm.q, base, n, vok, mq);
    store_codes(vm.q, base, n, vok, vq);
    if (a.nonfinite != nullptr && leader && valid && !(m_ok && v_ok))
      atomicAdd(a.nonfinite, (m_ok ? 0 : 1) + (v_ok ? 0 : 1));

    if (next.x != e.x) row = load_row(a.ptr_table, next.x);  // rare: once per tensor boundary in the run
    e = next;
  }
}

template <int G, typename PT, typename GT, bool REM = false>
cudaError_t launch_typed(const CoatAdamWArgs& a, int num_sms, cudaStream_t stream) {
  if (a.n_chunks == 0) return cudaSuccess;
  if (REM && a.variant != kVariantV3 && a.variant != kVariantV3Interleaved) return cudaErrorNotSupported;
  // Blocks beyond the resident ones only queue; the rest of the chunks grid-stride (v3) or make longer runs (v4).
  const int per_sm = a.variant == kVariantV3 ? 4 : a.variant == kVariantV4 ? 3 : 2;
  const int64_t max_blocks = (int64_t)num_sms * per_sm;
  const int blocks = (int)(a.n_chunks < max_blocks ? a.n_chunks : max_blocks);
  switch (a.variant) {
    case kVariantV3:
      coat_adamw_kernel<G, PT, GT, 1, REM><<<blocks, kThreads, 0, stream>>>(a);
      break;
    case kVariantV3Interleaved:
      coat_adamw_kernel<G, PT, GT, 2, REM><<<blocks, kThreads, 0, stream>>>(a);
      break;
    case kVariantV4:
      if constexpr (!REM) coat_adamw_kernel_v4<G, PT, GT, 3><<<blocks, kThreads, 0, stream>>>(a);
      break;
    case kVariantV4TwoBlocks:
      if constexpr (!REM) coat_adamw_kernel_v4<G, PT, GT, 2><<<blocks, kThreads, 0, stream>>>(a);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

template <int G>
cudaError_t launch_group(const CoatAdamWArgs& a, int num_sms, cudaStream_t stream) {
  if (a.rem_table != nullptr) {  // bf16 parameters with fp32-master remainders
    if (!a.param_bf16) return cudaErrorInvalidValue;
    if (a.grad_bf16) return launch_typed<G, __nv_bfloat16, __nv_bfloat16, true>(a, num_sms, stream);
    return launch_typed<G, __nv_bfloat16, float, true>(a, num_sms, stream);
  }
#ifdef COAT_ADAMW_COMPILE_CHECK  // CI's compile-only test: one fp32 and one bf16 instantiation cover every path
  if (a.param_bf16) return launch_typed<G, __nv_bfloat16, __nv_bfloat16>(a, num_sms, stream);
  return launch_typed<G, float, float>(a, num_sms, stream);
#else
  if (a.param_bf16) {
    if (a.grad_bf16) return launch_typed<G, __nv_bfloat16, __nv_bfloat16>(a, num_sms, stream);
    return launch_typed<G, __nv_bfloat16, float>(a, num_sms, stream);
  }
  if (a.grad_bf16) return launch_typed<G, float, __nv_bfloat16>(a, num_sms, stream);
  return launch_typed<G, float, float>(a, num_sms, stream);
#endif
}

}  // namespace

cudaError_t coat_adamw_launch(const CoatAdamWArgs& a, int num_sms, cudaStream_t stream) {
  switch (a.group_size) {
#ifndef COAT_ADAMW_COMPILE_CHECK
    case 16: return launch_group<16>(a, num_sms, stream);
    case 32: return launch_group<32>(a, num_sms, stream);
    case 64: return launch_group<64>(a, num_sms, stream);
    case 256: return launch_group<256>(a, num_sms, stream);
#endif
    case 128: return launch_group<128>(a, num_sms, stream);
    default: return cudaErrorInvalidValue;
  }
}
