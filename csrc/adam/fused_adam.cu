// Multi-tensor fused Adam/AdamW for CUDA tensors.
//
// One launch updates up to kMaxTensors tensors: every block takes one chunk (kChunkSize elements)
// of one tensor, as listed in the launch's TensorListMeta (passed by value as the kernel argument,
// under the 4 KiB parameter limit). Per element it does the same math, in the same order, as the
// CPU kernel (csrc/adam/cpu_adam.cpp) and torch.optim.Adam/AdamW:
//
//   g = grad * grad_scale;  Adam: g += weight_decay * p  |  AdamW: p *= 1 - lr * weight_decay
//   m = lerp(m, g, 1 - beta1);  v = v * beta2 + (1 - beta2) * g * g
//   p += (-lr / bias_correction1) * m / (sqrt(v) / sqrt(bias_correction2) + eps)
//   param_out = round_to_nearest_even(p)      (optional bf16/fp16 working copy, same pass)
//
// Types: master fp32; grad fp32, bf16 or fp16 (one dtype per call); state fp32; param_out bf16 or
// fp16 (one dtype per call) or none. Build without torch (kernels and the raw launcher only) with
// -DZEROTRAIN_CUDA_NO_TORCH; otherwise it registers torch.ops.zerotrain.fused_adam_cuda.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

// By its path from this file, so that a bare `nvcc -c fused_adam.cu` finds it too.
#include "../includes/adam_scalars.h"

namespace zerotrain {
namespace cuda_adam {

constexpr int kMaxTensors = 36;
constexpr int kMaxBlocks = 320;
constexpr int kChunkSize = 65536;
constexpr int kBlockThreads = 512;
constexpr int kIlp = 4;

enum class GradType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };
enum class OutType : int { kNone = 0, kBF16 = 1, kF16 = 2 };

struct TensorListMeta {
  float* master[kMaxTensors];
  const void* grad[kMaxTensors];
  float* exp_avg[kMaxTensors];
  float* exp_avg_sq[kMaxTensors];
  void* param_out[kMaxTensors];
  int64_t numel[kMaxTensors];
  unsigned char block_to_tensor[kMaxBlocks];
  int block_to_chunk[kMaxBlocks];
};
static_assert(sizeof(TensorListMeta) <= 4000, "kernel parameters must stay under 4 KiB");

// fp32 scalars rounded once from double on the host (adam_scalars.h, shared with the CPU kernel).
using Hyper = AdamScalars;

__device__ __forceinline__ float load_grad(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load_grad(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}
__device__ __forceinline__ float load_grad(const __half* p, int64_t i) { return __half2float(p[i]); }

struct NoOut {};
__device__ __forceinline__ void store_out(NoOut*, int64_t, float) {}
__device__ __forceinline__ void store_out(__nv_bfloat16* p, int64_t i, float x) {
  p[i] = __float2bfloat16_rn(x);
}
__device__ __forceinline__ void store_out(__half* p, int64_t i, float x) { p[i] = __float2half_rn(x); }

__device__ __forceinline__ void adam_element(const Hyper& h, float& p, float g, float& m, float& v) {
  g = __fmul_rn(g, h.grad_scale);
  if (h.wd_mode == WeightDecay::kL2) {
    g = fmaf(p, h.weight_decay, g);
  } else if (h.wd_mode == WeightDecay::kDecoupled) {
    p = __fmul_rn(p, h.decay);
  }
  const float diff = __fsub_rn(g, m);
  m = h.lerp_from_start ? fmaf(h.lerp_weight, diff, m) : fmaf(-diff, h.one_minus_lerp_weight, g);
  v = __fadd_rn(__fmul_rn(v, h.beta2), __fmul_rn(__fmul_rn(h.one_minus_beta2, g), g));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), h.bias_correction2_sqrt), h.eps);
  p = __fadd_rn(p, __fdiv_rn(__fmul_rn(h.neg_step_size, m), denom));
}

template <typename G, typename P>
__global__ void __launch_bounds__(kBlockThreads)
    adam_multi_tensor_kernel(TensorListMeta meta, Hyper h) {
  const int t = meta.block_to_tensor[blockIdx.x];
  const int64_t chunk_start = static_cast<int64_t>(meta.block_to_chunk[blockIdx.x]) * kChunkSize;
  const int64_t n = meta.numel[t] - chunk_start;
  const int64_t limit = n < kChunkSize ? n : kChunkSize;
  float* master = meta.master[t] + chunk_start;
  const G* grad = static_cast<const G*>(meta.grad[t]) + chunk_start;
  float* exp_avg = meta.exp_avg[t] + chunk_start;
  float* exp_avg_sq = meta.exp_avg_sq[t] + chunk_start;
  P* out = static_cast<P*>(meta.param_out[t]) + chunk_start;
  // kIlp independent elements per thread per round keep several loads in flight.
  for (int64_t base = 0; base < limit; base += static_cast<int64_t>(blockDim.x) * kIlp) {
    float p[kIlp], g[kIlp], m[kIlp], v[kIlp];
#pragma unroll
    for (int k = 0; k < kIlp; ++k) {
      const int64_t i = base + threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (i < limit) {
        p[k] = master[i];
        g[k] = load_grad(grad, i);
        m[k] = exp_avg[i];
        v[k] = exp_avg_sq[i];
      }
    }
#pragma unroll
    for (int k = 0; k < kIlp; ++k) {
      const int64_t i = base + threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (i < limit) {
        adam_element(h, p[k], g[k], m[k], v[k]);
        master[i] = p[k];
        exp_avg[i] = m[k];
        exp_avg_sq[i] = v[k];
        store_out(out, i, p[k]);
      }
    }
  }
}

struct TensorPtrs {
  float* master;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* param_out;
  int64_t numel;
};

template <typename G, typename P>
cudaError_t launch_typed(const TensorPtrs* tensors, int count, const Hyper& h, cudaStream_t stream) {
  TensorListMeta meta;
  int n_tensors = 0;
  int n_blocks = 0;
  for (int t = 0; t < count; ++t) {
    const TensorPtrs& x = tensors[t];
    if (x.numel == 0) continue;
    meta.master[n_tensors] = x.master;
    meta.grad[n_tensors] = x.grad;
    meta.exp_avg[n_tensors] = x.exp_avg;
    meta.exp_avg_sq[n_tensors] = x.exp_avg_sq;
    meta.param_out[n_tensors] = x.param_out;
    meta.numel[n_tensors] = x.numel;
    ++n_tensors;
    const int64_t chunks = (x.numel + kChunkSize - 1) / kChunkSize;
    for (int64_t c = 0; c < chunks; ++c) {
      meta.block_to_tensor[n_blocks] = static_cast<unsigned char>(n_tensors - 1);
      meta.block_to_chunk[n_blocks] = static_cast<int>(c);
      ++n_blocks;
      const bool last_chunk = c == chunks - 1;
      const bool blocks_full = n_blocks == kMaxBlocks;
      const bool tensors_full = n_tensors == kMaxTensors && last_chunk;
      const bool last_of_all = t == count - 1 && last_chunk;
      if (blocks_full || tensors_full || last_of_all) {
        adam_multi_tensor_kernel<G, P><<<n_blocks, kBlockThreads, 0, stream>>>(meta, h);
        const cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess) return err;
        n_blocks = 0;
        if (last_chunk) {
          n_tensors = 0;
        } else {  // the current tensor continues in the next launch, in slot 0
          meta.master[0] = meta.master[n_tensors - 1];
          meta.grad[0] = meta.grad[n_tensors - 1];
          meta.exp_avg[0] = meta.exp_avg[n_tensors - 1];
          meta.exp_avg_sq[0] = meta.exp_avg_sq[n_tensors - 1];
          meta.param_out[0] = meta.param_out[n_tensors - 1];
          meta.numel[0] = meta.numel[n_tensors - 1];
          n_tensors = 1;
        }
      }
    }
  }
  if (n_blocks > 0) {  // only reached when trailing tensors were empty
    adam_multi_tensor_kernel<G, P><<<n_blocks, kBlockThreads, 0, stream>>>(meta, h);
    return cudaGetLastError();
  }
  return cudaSuccess;
}

template <typename G>
cudaError_t launch_out(const TensorPtrs* t, int count, OutType out, const Hyper& h, cudaStream_t s) {
  switch (out) {
    case OutType::kBF16: return launch_typed<G, __nv_bfloat16>(t, count, h, s);
    case OutType::kF16: return launch_typed<G, __half>(t, count, h, s);
    default: return launch_typed<G, NoOut>(t, count, h, s);
  }
}

// The raw launcher: all pointers are device pointers of contiguous buffers on the current device.
cudaError_t launch_fused_adam(const TensorPtrs* tensors, int count, GradType grad, OutType out,
                              const Hyper& h, cudaStream_t stream) {
  switch (grad) {
    case GradType::kBF16: return launch_out<__nv_bfloat16>(tensors, count, out, h, stream);
    case GradType::kF16: return launch_out<__half>(tensors, count, out, h, stream);
    default: return launch_out<float>(tensors, count, out, h, stream);
  }
}

}  // namespace cuda_adam
}  // namespace zerotrain

#ifndef ZEROTRAIN_CUDA_NO_TORCH
// Only core headers: the stream comes from Python (torch.cuda.current_stream().cuda_stream) and
// the caller makes the tensors' device current, so no c10/cuda header is needed and the file also
// compiles against a CPU-only torch install (the compile-check test does exactly that).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <vector>

namespace zerotrain {
namespace cuda_adam {

void check_list(const at::TensorList& list, const at::TensorList& masters, const char* name) {
  TORCH_CHECK_VALUE(list.size() == masters.size(), "fused_adam_cuda: `", name, "` has ",
                    list.size(), " tensors but `masters` has ", masters.size());
  for (size_t i = 0; i < list.size(); ++i) {
    const at::Tensor& t = list[i];
    TORCH_CHECK_VALUE(t.is_cuda() && t.device() == masters[0].device(), "fused_adam_cuda: `",
                      name, "[", i, "]` must be on ", masters[0].device(), ", got ", t.device());
    TORCH_CHECK_VALUE(t.is_contiguous(), "fused_adam_cuda: `", name, "[", i,
                      "]` must be contiguous");
    TORCH_CHECK_VALUE(t.numel() == masters[i].numel(), "fused_adam_cuda: `", name, "[", i,
                      "]` has ", t.numel(), " elements but `masters[", i, "]` has ",
                      masters[i].numel());
  }
}

void check_dtype(const at::TensorList& list, const char* name, at::ScalarType dtype) {
  for (size_t i = 0; i < list.size(); ++i) {
    TORCH_CHECK_TYPE(list[i].scalar_type() == dtype, "fused_adam_cuda: `", name, "[", i,
                     "]` is ", list[i].scalar_type(), "; every tensor of `", name, "` must be ",
                     dtype);
  }
}

void fused_adam_cuda(at::TensorList masters, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList param_outs, int64_t step,
                     double lr, double beta1, double beta2, double eps, double weight_decay,
                     bool adamw, bool bias_correction, double grad_scale, int64_t stream) {
  if (masters.empty()) return;
  check_list(masters, masters, "masters");
  check_list(grads, masters, "grads");
  check_list(exp_avgs, masters, "exp_avgs");
  check_list(exp_avg_sqs, masters, "exp_avg_sqs");
  check_dtype(masters, "masters", at::kFloat);
  check_dtype(exp_avgs, "exp_avgs", at::kFloat);
  check_dtype(exp_avg_sqs, "exp_avg_sqs", at::kFloat);
  const at::ScalarType gt = grads[0].scalar_type();
  TORCH_CHECK_TYPE(gt == at::kFloat || gt == at::kBFloat16 || gt == at::kHalf,
                   "fused_adam_cuda: `grads` must be float32, bfloat16 or float16, got ", gt);
  check_dtype(grads, "grads", gt);
  OutType out = OutType::kNone;
  if (!param_outs.empty()) {
    check_list(param_outs, masters, "param_outs");
    const at::ScalarType ot = param_outs[0].scalar_type();
    TORCH_CHECK_TYPE(ot == at::kBFloat16 || ot == at::kHalf,
                     "fused_adam_cuda: `param_outs` must be bfloat16 or float16, got ", ot);
    check_dtype(param_outs, "param_outs", ot);
    out = ot == at::kBFloat16 ? OutType::kBF16 : OutType::kF16;
  }
  TORCH_CHECK_VALUE(lr >= 0.0, "fused_adam_cuda: `lr` must be >= 0, got ", lr);
  TORCH_CHECK_VALUE(beta1 >= 0.0 && beta1 < 1.0, "fused_adam_cuda: `beta1` must be in [0, 1)");
  TORCH_CHECK_VALUE(beta2 >= 0.0 && beta2 < 1.0, "fused_adam_cuda: `beta2` must be in [0, 1)");
  TORCH_CHECK_VALUE(step >= 1 || !bias_correction, "fused_adam_cuda: `step` must be >= 1");

  std::vector<TensorPtrs> ptrs(masters.size());
  for (size_t i = 0; i < masters.size(); ++i) {
    ptrs[i] = TensorPtrs{masters[i].data_ptr<float>(), grads[i].data_ptr(),
                         exp_avgs[i].data_ptr<float>(), exp_avg_sqs[i].data_ptr<float>(),
                         param_outs.empty() ? nullptr : param_outs[i].data_ptr(),
                         masters[i].numel()};
  }
  const GradType g = gt == at::kBFloat16 ? GradType::kBF16
                                         : (gt == at::kHalf ? GradType::kF16 : GradType::kF32);
  int current_device = -1;
  TORCH_CHECK(cudaGetDevice(&current_device) == cudaSuccess &&
                  current_device == masters[0].device().index(),
              "fused_adam_cuda: make ", masters[0].device(), " the current device first");
  const Hyper h = adam_scalars(step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction,
                               grad_scale);
  const cudaError_t err = launch_fused_adam(ptrs.data(), static_cast<int>(ptrs.size()), g, out, h,
                                            reinterpret_cast<cudaStream_t>(stream));
  TORCH_CHECK(err == cudaSuccess, "fused_adam_cuda: kernel launch failed: ",
              cudaGetErrorString(err));
}

}  // namespace cuda_adam
}  // namespace zerotrain

TORCH_LIBRARY_FRAGMENT(zerotrain, m) {
  m.def(
      "fused_adam_cuda(Tensor(a!)[] masters, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] param_outs, int step, float lr, float beta1, "
      "float beta2, float eps, float weight_decay, bool adamw, bool bias_correction, "
      "float grad_scale, int stream) -> ()");
}

TORCH_LIBRARY_IMPL(zerotrain, CUDA, m) {
  m.impl("fused_adam_cuda", &zerotrain::cuda_adam::fused_adam_cuda);
}
#endif  // ZEROTRAIN_CUDA_NO_TORCH
