// Ember::losses' CUDA kernels for cross_entropy_rows.h: one thread block per row of logits.
//
// forward:  each thread keeps a running (max, sum of exp(x - max)) over its share of the row (read
//           16 bytes at a time where the row allows), the block merges them with warp shuffles, and
//           thread 0 writes max, log(sum) and the row's loss (max - x[target]) + log(sum).
// gradient: each element once more: exp((x - max) - log(sum)) minus 1 at the target, times the
//           scale, rounded once to the logits' dtype.
// The logits are read in their own dtype and every sum is float32, as LibTorch's float32
// log-softmax of the same logits computes it (up to the order of the additions).
#include "cross_entropy_rows_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

namespace ember::cross_entropy_rows::cuda {
namespace {

constexpr int kMaxThreads = 512;

template <class T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }

template <class T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// VEC elements loaded or stored as one access (16 bytes for VEC = 16 / sizeof(T)).
template <class T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// A running softmax denominator: sum of exp(x - m) over the elements seen, m their maximum.
// -inf elements add nothing; a NaN element makes the sum NaN (as LibTorch's log-softmax gives NaN).
struct MaxSum {
  float m, s;
};

// exp(a - m) as the factor that rescales a sum kept against maximum a to maximum m >= a; 0 for an
// empty sum (a = -inf), which also keeps a NaN sum NaN (NaN * 0).
__device__ __forceinline__ float rescale(float a, float m) { return a == -INFINITY ? 0.0f : expf(a - m); }

__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  return {m, a.s * rescale(a.m, m) + b.s * rescale(b.m, m)};
}

template <class T, int VEC>
__device__ __forceinline__ void add_pack(MaxSum& st, const Pack<T, VEC>& p) {
  float x[VEC];
  float m = st.m;
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    x[k] = to_float(p.v[k]);
    m = fmaxf(m, x[k]);  // (fmaxf skips NaN; the sum below carries it)
  }
  float s = st.s * rescale(st.m, m);
#pragma unroll
  for (int k = 0; k < VEC; ++k) s += x[k] == -INFINITY ? 0.0f : expf(x[k] - m);
  st = {m, s};
}

// The whole block's MaxSum, valid in thread 0. blockDim.x is a multiple of 32.
__device__ MaxSum block_merge(MaxSum st) {
  constexpr unsigned kAll = 0xffffffffu;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    st = merge(st, {__shfl_xor_sync(kAll, st.m, offset), __shfl_xor_sync(kAll, st.s, offset)});
  __shared__ float warp_m[kMaxThreads / 32], warp_s[kMaxThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    warp_m[warp] = st.m;
    warp_s[warp] = st.s;
  }
  __syncthreads();
  if (warp == 0) {
    const int warps = blockDim.x / 32;
    st = lane < warps ? MaxSum{warp_m[lane], warp_s[lane]} : MaxSum{-INFINITY, 0.0f};
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
      st = merge(st, {__shfl_xor_sync(kAll, st.m, offset), __shfl_xor_sync(kAll, st.s, offset)});
  }
  return st;
}

template <class T, int VEC>
__global__ void __launch_bounds__(kMaxThreads)
    forward_kernel(const T* __restrict__ logits, int64_t cols, const int64_t* __restrict__ targets, int64_t ignore_index,
                   float* __restrict__ row_max, float* __restrict__ log_sum, float* __restrict__ row_loss) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * cols;
  MaxSum st{-INFINITY, 0.0f};
  const int64_t packs = cols / VEC;
  const auto* xp = reinterpret_cast<const Pack<T, VEC>*>(x);
  for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) add_pack<T, VEC>(st, xp[i]);
  for (int64_t j = packs * VEC + threadIdx.x; j < cols; j += blockDim.x) {
    Pack<T, 1> one;
    one.v[0] = x[j];
    add_pack<T, 1>(st, one);
  }
  st = block_merge(st);
  if (threadIdx.x != 0) return;
  const float ls = logf(st.s);
  row_max[row] = st.m;
  log_sum[row] = ls;
  const int64_t t = targets[row];
  if (t == ignore_index) row_loss[row] = 0.0f;
  else if (t < 0 || t >= cols) row_loss[row] = NAN;  // out of range: poisons the loss rather than reading past the row
  else row_loss[row] = (st.m - to_float(x[t])) + ls;
}

template <class T>
__device__ __forceinline__ T gradient_of(T x, int64_t col, int64_t target, float m, float ls, float scale) {
  const float g = expf((to_float(x) - m) - ls) - (col == target ? 1.0f : 0.0f);
  return from_float<T>(g * scale);
}

// `logits` and `out` may be the same memory: each element is read and then written by one thread.
template <class T, int VEC>
__global__ void __launch_bounds__(kMaxThreads)
    gradient_kernel(const T* logits, T* out, int64_t cols, const int64_t* __restrict__ targets, int64_t ignore_index,
                    const float* __restrict__ row_max, const float* __restrict__ log_sum, const float* __restrict__ scale_ptr) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * cols;
  T* y = out + row * cols;
  const int64_t t = targets[row];
  const bool ignored = t == ignore_index;
  const float m = row_max[row], ls = log_sum[row];
  const float scale = scale_ptr != nullptr ? *scale_ptr : 1.0f;
  const int64_t packs = cols / VEC;
  const auto* xp = reinterpret_cast<const Pack<T, VEC>*>(x);
  auto* yp = reinterpret_cast<Pack<T, VEC>*>(y);
  for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
    const Pack<T, VEC> p = xp[i];
    Pack<T, VEC> q;
#pragma unroll
    for (int k = 0; k < VEC; ++k) q.v[k] = ignored ? from_float<T>(0.0f) : gradient_of(p.v[k], i * VEC + k, t, m, ls, scale);
    yp[i] = q;
  }
  for (int64_t j = packs * VEC + threadIdx.x; j < cols; j += blockDim.x)
    y[j] = ignored ? from_float<T>(0.0f) : gradient_of(x[j], j, t, m, ls, scale);
}

// Enough threads for the row's packs, a multiple of 32, at most kMaxThreads.
int threads_for(int64_t cols, int vec) {
  const int64_t packs = (cols + vec - 1) / vec;
  int64_t threads = 32;
  while (threads < packs && threads < kMaxThreads) threads *= 2;
  return static_cast<int>(threads);
}

// 16-byte accesses where every row starts on a 16-byte boundary.
bool packs_fit(const void* p, int64_t cols, int64_t element_size) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0 && (cols * element_size) % 16 == 0;
}

const char* launched() {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

template <class T>
const char* forward_as(const void* logits, int64_t rows, int64_t cols, const int64_t* targets, int64_t ignore_index, float* row_max,
                       float* log_sum, float* row_loss, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const T* x = static_cast<const T*>(logits);
  if (packs_fit(logits, cols, sizeof(T)))
    forward_kernel<T, kVec><<<static_cast<unsigned>(rows), threads_for(cols, kVec), 0, stream>>>(x, cols, targets, ignore_index, row_max, log_sum, row_loss);
  else
    forward_kernel<T, 1><<<static_cast<unsigned>(rows), threads_for(cols, 1), 0, stream>>>(x, cols, targets, ignore_index, row_max, log_sum, row_loss);
  return launched();
}

template <class T>
const char* gradient_as(const void* logits, void* out, int64_t rows, int64_t cols, const int64_t* targets, int64_t ignore_index,
                        const float* row_max, const float* log_sum, const float* scale, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const T* x = static_cast<const T*>(logits);
  T* y = static_cast<T*>(out);
  if (packs_fit(logits, cols, sizeof(T)) && packs_fit(out, cols, sizeof(T)))
    gradient_kernel<T, kVec><<<static_cast<unsigned>(rows), threads_for(cols, kVec), 0, stream>>>(x, y, cols, targets, ignore_index, row_max, log_sum, scale);
  else
    gradient_kernel<T, 1><<<static_cast<unsigned>(rows), threads_for(cols, 1), 0, stream>>>(x, y, cols, targets, ignore_index, row_max, log_sum, scale);
  return launched();
}

}  // namespace

const char* launch_forward(Dtype dtype, const void* logits, int64_t rows, int64_t cols, const int64_t* targets, int64_t ignore_index,
                           float* row_max, float* log_sum, float* row_loss, void* stream) {
  if (rows == 0) return nullptr;
  const auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case Dtype::float32: return forward_as<float>(logits, rows, cols, targets, ignore_index, row_max, log_sum, row_loss, s);
    case Dtype::bfloat16: return forward_as<__nv_bfloat16>(logits, rows, cols, targets, ignore_index, row_max, log_sum, row_loss, s);
    case Dtype::float16: return forward_as<__half>(logits, rows, cols, targets, ignore_index, row_max, log_sum, row_loss, s);
  }
  return "unknown dtype";
}

const char* launch_gradient(Dtype dtype, const void* logits, void* out, int64_t rows, int64_t cols, const int64_t* targets,
                            int64_t ignore_index, const float* row_max, const float* log_sum, const float* scale, void* stream) {
  if (rows == 0) return nullptr;
  const auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case Dtype::float32: return gradient_as<float>(logits, out, rows, cols, targets, ignore_index, row_max, log_sum, scale, s);
    case Dtype::bfloat16: return gradient_as<__nv_bfloat16>(logits, out, rows, cols, targets, ignore_index, row_max, log_sum, scale, s);
    case Dtype::float16: return gradient_as<__half>(logits, out, rows, cols, targets, ignore_index, row_max, log_sum, scale, s);
  }
  return "unknown dtype";
}

}  // namespace ember::cross_entropy_rows::cuda
