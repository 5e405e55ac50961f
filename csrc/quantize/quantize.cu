// Block-wise symmetric int8 quantization for CUDA tensors: the same definition as the CPU kernel
// (csrc/quantize/quantize.cpp) and the oracle (zerotrain/ops/quantize_reference.py), bit for bit:
//
//   scale = absmax / 127;  q = clamp(round_half_even(x / scale), -127, 127);  x' = q * scale
//   an all-zero block: scale 0, q 0;  a block holding inf/NaN: scale NaN, q 0 (x' = NaN)
//
// Quantize: one thread block per quantization block; its threads stride over the block for the
// |x| max and a non-finite flag (shared-memory reduction; max is exact in any order), then write
// the codes. Dequantize: one thread per element. Every operation is an explicitly rounded
// intrinsic (__fdiv_rn, __fmul_rn, rintf), so -use_fast_math cannot change the results.
//
// Build without torch (kernels and raw launchers only) with -DZEROTRAIN_CUDA_NO_TORCH; otherwise it
// registers torch.ops.zerotrain.quantize_blockwise_cuda and dequantize_blockwise_cuda.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

namespace zerotrain {
namespace cuda_quantize {

constexpr int kThreads = 256;

enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

__device__ __forceinline__ void from_f32(float* p, float x) { *p = x; }
__device__ __forceinline__ void from_f32(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }
__device__ __forceinline__ void from_f32(__half* p, float x) { *p = __float2half_rn(x); }

template <typename T>
__global__ void quantize_kernel(const T* __restrict__ x, int8_t* __restrict__ q,
                                float* __restrict__ scales, int64_t numel, int64_t block) {
  __shared__ float smax[kThreads];
  const int64_t b = blockIdx.x;
  const int64_t begin = b * block;
  const int64_t n = min(block, numel - begin);
  float amax = 0.0f;
  int bad = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float a = fabsf(to_f32(x[begin + i]));
    bad |= !(a < INFINITY);  // inf or NaN
    amax = fmaxf(amax, a);
  }
  smax[threadIdx.x] = amax;
  const int nonfinite = __syncthreads_or(bad);
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) smax[threadIdx.x] = fmaxf(smax[threadIdx.x], smax[threadIdx.x + s]);
    __syncthreads();
  }
  const float scale = __fdiv_rn(smax[0], 127.0f);
  if (threadIdx.x == 0) scales[b] = nonfinite ? NAN : scale;
  const float div = scale == 0.0f ? 1.0f : scale;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    float r = 0.0f;
    if (!nonfinite) r = fminf(127.0f, fmaxf(-127.0f, rintf(__fdiv_rn(to_f32(x[begin + i]), div))));
    q[begin + i] = static_cast<int8_t>(r);
  }
}

template <typename T>
__global__ void dequantize_kernel(const int8_t* __restrict__ q, const float* __restrict__ scales,
                                  T* __restrict__ out, int64_t numel, int64_t block) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= numel) return;
  from_f32(out + i, __fmul_rn(static_cast<float>(q[i]), scales[i / block]));
}

// Raw launchers (no torch): pointers, sizes, the element type and a stream.
inline cudaError_t launch_quantize(const void* x, DType t, int8_t* q, float* scales, int64_t numel,
                                   int64_t block, cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  const int64_t blocks = (numel + block - 1) / block;
  const dim3 grid(static_cast<unsigned>(blocks));
  switch (t) {
    case DType::kBF16:
      quantize_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(x), q,
                                                     scales, numel, block);
      break;
    case DType::kF16:
      quantize_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const __half*>(x), q, scales,
                                                     numel, block);
      break;
    default:
      quantize_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const float*>(x), q, scales,
                                                     numel, block);
  }
  return cudaGetLastError();
}

inline cudaError_t launch_dequantize(const int8_t* q, const float* scales, void* out, DType t,
                                     int64_t numel, int64_t block, cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((numel + kThreads - 1) / kThreads));
  switch (t) {
    case DType::kBF16:
      dequantize_kernel<<<grid, kThreads, 0, stream>>>(q, scales,
                                                       static_cast<__nv_bfloat16*>(out), numel,
                                                       block);
      break;
    case DType::kF16:
      dequantize_kernel<<<grid, kThreads, 0, stream>>>(q, scales, static_cast<__half*>(out),
                                                       numel, block);
      break;
    default:
      dequantize_kernel<<<grid, kThreads, 0, stream>>>(q, scales, static_cast<float*>(out), numel,
                                                       block);
  }
  return cudaGetLastError();
}

}  // namespace cuda_quantize
}  // namespace zerotrain

#ifndef ZEROTRAIN_CUDA_NO_TORCH
#include <torch/library.h>
#include <ATen/ATen.h>

namespace zerotrain {
namespace cuda_quantize {

DType dtype_of(const at::Tensor& t, const char* name) {
  const auto st = t.scalar_type();
  TORCH_CHECK_TYPE(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, "quantize_cuda: ",
                   name, ".dtype=", st, ": unsupported; valid: float32, bfloat16, float16");
  return st == at::kBFloat16 ? DType::kBF16 : (st == at::kHalf ? DType::kF16 : DType::kF32);
}

void check_codes(const at::Tensor& data, const at::Tensor& q, const at::Tensor& scales,
                 int64_t block) {
  TORCH_CHECK_VALUE(block >= 1, "quantize_cuda: block=", block, ": valid: >= 1");
  const int64_t n = data.numel();
  TORCH_CHECK_VALUE((n + block - 1) / block <= 0x7FFFFFFF, "quantize_cuda: ", n,
                    " elements in blocks of ", block, ": too many blocks; valid: < 2^31");
  for (const at::Tensor* t : {&data, &q, &scales}) {
    TORCH_CHECK_VALUE(t->is_cuda() && t->device() == data.device() && t->is_contiguous(),
                      "quantize_cuda: every tensor must be contiguous on ", data.device());
  }
  TORCH_CHECK_TYPE(q.scalar_type() == at::kChar && q.numel() == n, "quantize_cuda: q must be int8 ",
                   "with ", n, " elements");
  TORCH_CHECK_TYPE(scales.scalar_type() == at::kFloat && scales.numel() == (n + block - 1) / block,
                   "quantize_cuda: scales must be float32, one per block");
}

void quantize_blockwise_cuda(const at::Tensor& x, at::Tensor q, at::Tensor scales, int64_t block,
                             int64_t stream) {
  check_codes(x, q, scales, block);
  const cudaError_t err = launch_quantize(x.data_ptr(), dtype_of(x, "x"), q.data_ptr<int8_t>(),
                                          scales.data_ptr<float>(), x.numel(), block,
                                          reinterpret_cast<cudaStream_t>(stream));
  TORCH_CHECK(err == cudaSuccess, "quantize_cuda: launch failed: ", cudaGetErrorString(err));
}

void dequantize_blockwise_cuda(const at::Tensor& q, const at::Tensor& scales, at::Tensor out,
                               int64_t block, int64_t stream) {
  check_codes(out, q, scales, block);
  const cudaError_t err = launch_dequantize(q.data_ptr<int8_t>(), scales.data_ptr<float>(),
                                            out.data_ptr(), dtype_of(out, "out"), out.numel(),
                                            block, reinterpret_cast<cudaStream_t>(stream));
  TORCH_CHECK(err == cudaSuccess, "dequantize_cuda: launch failed: ", cudaGetErrorString(err));
}

}  // namespace cuda_quantize
}  // namespace zerotrain

TORCH_LIBRARY_FRAGMENT(zerotrain, m) {
  m.def("quantize_blockwise_cuda(Tensor x, Tensor(a!) q, Tensor(b!) scales, int block, int stream) -> ()");
  m.def("dequantize_blockwise_cuda(Tensor q, Tensor scales, Tensor(a!) out, int block, int stream) -> ()");
}

TORCH_LIBRARY_IMPL(zerotrain, CUDA, m) {
  m.impl("quantize_blockwise_cuda", &zerotrain::cuda_quantize::quantize_blockwise_cuda);
  m.impl("dequantize_blockwise_cuda", &zerotrain::cuda_quantize::dequantize_blockwise_cuda);
}
#endif  // ZEROTRAIN_CUDA_NO_TORCH
