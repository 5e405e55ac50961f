// A stateless, one-pass fused Adam/AdamW step for CPU tensors.
//
// One call updates one flat slice in a single pass over memory:
//
//   reads   master (fp32, or bf16|fp16), grad (fp32|bf16|fp16), exp_avg, exp_avg_sq (fp32|bf16)
//   writes  master, exp_avg, exp_avg_sq and, optionally, param_out (bf16|fp16), the low-precision
//           working copy of the parameter, rounded from the new master in the same pass.
//
// A 16-bit master (ZeRO's master_dtype: the working partition is the master) is read into fp32,
// stepped in fp32 and rounded to nearest even once when stored; there is no param_out then.
//
// For the mixed-precision offload case (bf16 grad in, bf16 param out, fp32 state) that is
// 4+2+4+4 bytes read and 4+4+4+2 written = 28 B/param; the unfused pipeline (grad.float(), Adam,
// copy to bf16) moves about 1.5x that.
//
// The math follows torch.optim.Adam/AdamW (single-tensor path), operation by operation:
//   g      = grad * grad_scale                    (grad_scale: 1/loss_scale * clip coefficient)
//   Adam:  g = g + weight_decay * p               AdamW: p = p * (1 - lr * weight_decay)
//   m      = lerp(m, g, 1 - beta1)
//   v      = v * beta2 + (1 - beta2) * g * g
//   denom  = sqrt(v) / sqrt(1 - beta2^step) + eps
//   p      = p + (-lr / (1 - beta1^step)) * m / denom
// Scalars are computed in double and rounded to fp32 once, as torch does for fp32 tensors.
// bf16 state and param_out are rounded to nearest even (stochastic rounding on request for the
// state); elements are independent, so results do not depend on the ISA's lane count, the thread
// count or buffer alignment (unaligned loads are used throughout; 64-byte alignment is merely a
// little faster). The ISA paths can differ from each other in the last bit where the vector paths
// use fused multiply-add and the scalar path does not.
//
// order="deepspeed" runs DeepSpeed 0.19.8's host Adam instead (ds_adam_step: csrc/adam/
// cpu_adam_impl.cpp, includes/cpu_adam.h, as DeepSpeed builds it on an AVX-512 CPU), operation for
// operation, so that its results are bit-identical: scalars in fp32 (adam_scalars.h's
// deepspeed_scalars), and per element, with fma(a, b, c) = a*b+c rounded once,
//   Adam:  g = fma(p, weight_decay, g)            AdamW: p = fma(p, -lr * weight_decay, p)
//   m      = fma(g, 1 - beta1, m * beta1)          v = fma(g * g, 1 - beta2, v * beta2)
//   p      = fma(m / fma(sqrt(v), 1 / sqrt(1 - beta2^step), eps), -lr / (1 - beta1^step), p)
// except the last numel % 16 elements of the call (DeepSpeed's scalar tail, where its compiler fuses
// the other products): m = fma(m, beta1, g * (1 - beta1)), v = fma(v, beta2, (g * g) * (1 - beta2)).
// Which elements are "tail" depends on the call's numel only, so every ISA path here gives the same
// bits; the parameter and moments are stored rounded to nearest even as DeepSpeed's are.
//
// ISA: one object file holds the AVX-512, AVX2 and scalar paths (GCC/Clang target attributes);
// the path is chosen per call: the `isa` argument, else $ZEROTRAIN_ADAM_ISA, else the best the CPU
// supports. Asking for a path the CPU lacks is an error, never a silent downgrade.
#include <torch/extension.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "adam_scalars.h"
#include "isa.h"
#include "simd.h"

namespace zerotrain {
namespace {

using simd::Bf16;
using simd::Fp16;

using isa::Isa;

// Everything one span of the step needs: the step's scalars (adam_scalars.h, shared with the CUDA
// kernel) and the buffers.
struct StepArgs : AdamScalars {
  void* master = nullptr;
  const void* grad = nullptr;
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  void* param_out = nullptr;
  int64_t numel = 0;
  bool stochastic = false;  // stochastic rounding of bf16 state
  uint32_t seed = 0;        // key of the stochastic-rounding hash
  bool ds_order = false;    // DeepSpeed's operation order (ds_span)
  DeepSpeedScalars ds{};    // order="deepspeed" only
};

struct NoOut {};  // "no param_out" marker type

template <class S>
struct Consts {
  typename S::V grad_scale, weight_decay, decay, w, one_minus_w, beta2, one_minus_beta2, bc2_sqrt,
      eps, neg_step_size;
  explicit Consts(const StepArgs& a)
      : grad_scale(S::set1(a.grad_scale)),
        weight_decay(S::set1(a.weight_decay)),
        decay(S::set1(a.decay)),
        w(S::set1(a.lerp_weight)),
        one_minus_w(S::set1(a.one_minus_lerp_weight)),
        beta2(S::set1(a.beta2)),
        one_minus_beta2(S::set1(a.one_minus_beta2)),
        bc2_sqrt(S::set1(a.bias_correction2_sqrt)),
        eps(S::set1(a.eps)),
        neg_step_size(S::set1(a.neg_step_size)) {}
};

template <class S, class St>
inline void store_state(St* dst, typename S::V x, const StepArgs& a, uint32_t index, uint32_t salt) {
  if constexpr (std::is_same_v<St, Bf16>) {
    if (a.stochastic) {
      S::store_sr(dst, x, simd::hash_u32<S>(index, a.seed ^ salt));
      return;
    }
  }
  S::store(dst, x);
}

// S::kWidth consecutive elements starting at pointer offset 0; `index` is the element index used
// by the stochastic-rounding hash.
template <class S, class G, class St, class P, class M>
inline void adam_lanes(const StepArgs& a, const Consts<S>& c, M* pp, const G* pg, St* pm,
                       St* pv, P* pout, uint32_t index) {
  using V = typename S::V;
  V p = S::load(pp);
  V g = S::mul(S::load(pg), c.grad_scale);
  if (a.wd_mode == WeightDecay::kL2) {
    g = S::fmadd(p, c.weight_decay, g);
  } else if (a.wd_mode == WeightDecay::kDecoupled) {
    p = S::mul(p, c.decay);
  }
  V m = S::load(pm);
  V v = S::load(pv);
  const V diff = S::sub(g, m);
  m = a.lerp_from_start ? S::fmadd(c.w, diff, m) : S::fnmadd(diff, c.one_minus_w, g);
  v = S::add(S::mul(v, c.beta2), S::mul(S::mul(c.one_minus_beta2, g), g));
  const V denom = S::add(S::div(S::sqrt(v), c.bc2_sqrt), c.eps);
  p = S::add(p, S::div(S::mul(c.neg_step_size, m), denom));
  S::store(pp, p);
  store_state<S>(pm, m, a, index, 0x3C6EF372u);
  store_state<S>(pv, v, a, index, 0xA54FF53Au);
  if constexpr (!std::is_same_v<P, NoOut>) S::store(pout, p);
}

// Elements [begin, end). The last partial vector goes through zero-padded stack buffers so that it
// runs the very same vector code as the body.
template <class S, class G, class St, class P, class M>
inline void adam_span(const StepArgs& a, int64_t begin, int64_t end) {
  constexpr int W = S::kWidth;
  const Consts<S> c(a);
  M* master = static_cast<M*>(a.master);
  const G* grad = static_cast<const G*>(a.grad);
  St* m = static_cast<St*>(a.exp_avg);
  St* v = static_cast<St*>(a.exp_avg_sq);
  P* out = static_cast<P*>(a.param_out);
  int64_t i = begin;
  for (; i + W <= end; i += W) {
    P* o = nullptr;
    if constexpr (!std::is_same_v<P, NoOut>) o = out + i;
    adam_lanes<S, G, St, P, M>(a, c, master + i, grad + i, m + i, v + i, o,
                               static_cast<uint32_t>(i));
  }
  const int64_t rest = end - i;
  if (rest <= 0) return;
  M bp[W] = {};
  G bg[W] = {};
  St bm[W] = {};
  St bv[W] = {};
  P bo[W] = {};
  std::copy(master + i, master + end, bp);
  std::copy(grad + i, grad + end, bg);
  std::copy(m + i, m + end, bm);
  std::copy(v + i, v + end, bv);
  adam_lanes<S, G, St, P, M>(a, c, bp, bg, bm, bv, bo, static_cast<uint32_t>(i));
  std::copy(bp, bp + rest, master + i);
  std::copy(bm, bm + rest, m + i);
  std::copy(bv, bv + rest, v + i);
  if constexpr (!std::is_same_v<P, NoOut>) std::copy(bo, bo + rest, out + i);
}

// order="deepspeed": fma that rounds once on every path (the scalar path's S::fmadd does not fuse).
template <class S>
inline typename S::V fused(typename S::V a, typename S::V b, typename S::V c) {
  if constexpr (std::is_same_v<S, simd::Scalar>) {
    return std::fma(a, b, c);
  } else {
    return S::fmadd(a, b, c);
  }
}

template <class S>
struct DsConsts {
  typename S::V grad_scale, beta1, one_minus_beta1, beta2, one_minus_beta2, bias_correction2, eps,
      step_size, decoupled_decay, weight_decay;
  explicit DsConsts(const DeepSpeedScalars& d)
      : grad_scale(S::set1(d.grad_scale)),
        beta1(S::set1(d.beta1)),
        one_minus_beta1(S::set1(d.one_minus_beta1)),
        beta2(S::set1(d.beta2)),
        one_minus_beta2(S::set1(d.one_minus_beta2)),
        bias_correction2(S::set1(d.bias_correction2)),
        eps(S::set1(d.eps)),
        step_size(S::set1(d.step_size)),
        decoupled_decay(S::set1(d.decoupled_decay)),
        weight_decay(S::set1(d.weight_decay)) {}
};

// DeepSpeed's element step (see the top of the file); kTail: its scalar tail's products.
template <class S, bool kTail, class G, class St, class P, class M>
inline void ds_lanes(const StepArgs& a, const DsConsts<S>& c, M* pp, const G* pg, St* pm, St* pv,
                     P* pout, uint32_t index) {
  using V = typename S::V;
  V p = S::load(pp);
  V g = S::load(pg);
  if (a.ds.grad_scale != 1.0f) g = S::mul(g, c.grad_scale);
  if (a.ds.wd_mode == WeightDecay::kL2) g = fused<S>(p, c.weight_decay, g);
  V m = S::load(pm);
  V v = S::load(pv);
  if constexpr (kTail) {
    m = fused<S>(m, c.beta1, S::mul(g, c.one_minus_beta1));
    v = fused<S>(v, c.beta2, S::mul(S::mul(g, g), c.one_minus_beta2));
  } else {
    m = fused<S>(g, c.one_minus_beta1, S::mul(m, c.beta1));
    v = fused<S>(S::mul(g, g), c.one_minus_beta2, S::mul(v, c.beta2));
  }
  const V update = S::div(m, fused<S>(S::sqrt(v), c.bias_correction2, c.eps));
  if (a.ds.wd_mode == WeightDecay::kDecoupled) p = fused<S>(p, c.decoupled_decay, p);
  p = fused<S>(update, c.step_size, p);
  S::store(pp, p);
  store_state<S>(pm, m, a, index, 0x3C6EF372u);
  store_state<S>(pv, v, a, index, 0xA54FF53Au);
  if constexpr (!std::is_same_v<P, NoOut>) S::store(pout, p);
}

// Elements [begin, end): below numel rounded down to 16 DeepSpeed's vector step (whole vectors:
// begin is a multiple of 64), the rest its scalar tail, one element at a time.
template <class S, class G, class St, class P, class M>
inline void ds_span(const StepArgs& a, int64_t begin, int64_t end) {
  constexpr int W = S::kWidth;
  const DsConsts<S> c(a.ds);
  const DsConsts<simd::Scalar> c1(a.ds);
  M* master = static_cast<M*>(a.master);
  const G* grad = static_cast<const G*>(a.grad);
  St* m = static_cast<St*>(a.exp_avg);
  St* v = static_cast<St*>(a.exp_avg_sq);
  P* out = static_cast<P*>(a.param_out);
  const int64_t vec_end = std::min(end, std::max(begin, a.numel & ~static_cast<int64_t>(15)));
  int64_t i = begin;
  for (; i < vec_end; i += W) {
    P* o = nullptr;
    if constexpr (!std::is_same_v<P, NoOut>) o = out + i;
    ds_lanes<S, false, G, St, P, M>(a, c, master + i, grad + i, m + i, v + i, o,
                                    static_cast<uint32_t>(i));
  }
  for (; i < end; ++i) {
    P* o = nullptr;
    if constexpr (!std::is_same_v<P, NoOut>) o = out + i;
    ds_lanes<simd::Scalar, true, G, St, P, M>(a, c1, master + i, grad + i, m + i, v + i, o,
                                              static_cast<uint32_t>(i));
  }
}

template <class S, class G, class St, class P, class M>
inline void any_span(const StepArgs& a, int64_t begin, int64_t end) {
  if (a.ds_order) {
    ds_span<S, G, St, P, M>(a, begin, end);
  } else {
    adam_span<S, G, St, P, M>(a, begin, end);
  }
}

using SpanFn = void (*)(const StepArgs&, int64_t, int64_t);

// One wrapper per ISA. `flatten` inlines the whole kernel (and S's target-specific members) into
// a function compiled for that ISA, so nothing else in this file needs -mavx*.
template <class G, class St, class P, class M>
__attribute__((flatten)) void span_scalar(const StepArgs& a, int64_t b, int64_t e) {
  any_span<simd::Scalar, G, St, P, M>(a, b, e);
}
#if ZT_SIMD_X86
template <class G, class St, class P, class M>
ZT_TARGET_AVX2 __attribute__((flatten)) void span_avx2(const StepArgs& a, int64_t b, int64_t e) {
  any_span<simd::Avx2, G, St, P, M>(a, b, e);
}
template <class G, class St, class P, class M>
ZT_TARGET_AVX512 __attribute__((flatten)) void span_avx512(const StepArgs& a, int64_t b,
                                                           int64_t e) {
  any_span<simd::Avx512, G, St, P, M>(a, b, e);
}
#endif

template <class G, class St, class P, class M = float>
SpanFn pick_isa(Isa isa) {
#if ZT_SIMD_X86
  if (isa == Isa::kAvx512) return &span_avx512<G, St, P, M>;
  if (isa == Isa::kAvx2) return &span_avx2<G, St, P, M>;
#endif
  return &span_scalar<G, St, P, M>;
}

template <class G, class St>
SpanFn pick_out(Isa isa, std::optional<at::ScalarType> out) {
  if (!out) return pick_isa<G, St, NoOut>(isa);
  return *out == at::kBFloat16 ? pick_isa<G, St, Bf16>(isa) : pick_isa<G, St, Fp16>(isa);
}

template <class G>
SpanFn pick_state(Isa isa, at::ScalarType state, std::optional<at::ScalarType> out) {
  return state == at::kBFloat16 ? pick_out<G, Bf16>(isa, out) : pick_out<G, float>(isa, out);
}

// A 16-bit master (no param_out): its gradient has its own type (checked), the state fp32 or bf16.
template <class M>
SpanFn pick_low_master(Isa isa, at::ScalarType state) {
  return state == at::kBFloat16 ? pick_isa<M, Bf16, NoOut, M>(isa) : pick_isa<M, float, NoOut, M>(isa);
}

SpanFn pick_kernel(Isa isa, at::ScalarType master, at::ScalarType grad, at::ScalarType state,
                   std::optional<at::ScalarType> out) {
  if (master == at::kBFloat16) return pick_low_master<Bf16>(isa, state);
  if (master == at::kHalf) return pick_low_master<Fp16>(isa, state);
  if (grad == at::kBFloat16) return pick_state<Bf16>(isa, state, out);
  if (grad == at::kHalf) return pick_state<Fp16>(isa, state, out);
  return pick_state<float>(isa, state, out);
}

constexpr const char* kIsaEnv = "ZEROTRAIN_ADAM_ISA";

std::string selected_isa(const std::string& requested) {
  return isa::isa_name(isa::resolve_isa(requested, kIsaEnv));
}

// ------------------------------------------------------------------------------------------------
// Input checks
// ------------------------------------------------------------------------------------------------
void check_tensor(const at::Tensor& t, const char* name, int64_t numel) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "cpu_adam: `", name, "` must be a CPU tensor, got ",
                    t.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), "cpu_adam: `", name,
                    "` must be contiguous (call .contiguous() or pass a flat buffer slice)");
  TORCH_CHECK_VALUE(t.numel() == numel, "cpu_adam: `", name, "` has ", t.numel(),
                    " elements but `master` has ", numel);
  TORCH_CHECK_VALUE(!t.is_complex() && t.layout() == at::kStrided, "cpu_adam: `", name,
                    "` must be a dense real tensor");
}

void check_dtype(const at::Tensor& t, const char* name, std::initializer_list<at::ScalarType> ok,
                 const char* allowed) {
  bool found = std::find(ok.begin(), ok.end(), t.scalar_type()) != ok.end();
  TORCH_CHECK_TYPE(found, "cpu_adam: `", name, "` must be ", allowed, ", got ", t.scalar_type());
}

// Written buffers must not overlap each other or the gradient.
void check_no_overlap(const std::vector<std::pair<const at::Tensor*, const char*>>& ts) {
  for (size_t i = 0; i < ts.size(); ++i) {
    for (size_t j = i + 1; j < ts.size(); ++j) {
      const at::Tensor& a = *ts[i].first;
      const at::Tensor& b = *ts[j].first;
      if (a.numel() == 0 || b.numel() == 0) continue;
      auto a0 = reinterpret_cast<uintptr_t>(a.data_ptr());
      auto b0 = reinterpret_cast<uintptr_t>(b.data_ptr());
      auto a1 = a0 + a.nbytes();
      auto b1 = b0 + b.nbytes();
      TORCH_CHECK_VALUE(a1 <= b0 || b1 <= a0, "cpu_adam: `", ts[i].second, "` and `",
                        ts[j].second, "` share memory; each needs its own buffer");
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Entry point
// ------------------------------------------------------------------------------------------------
void adam_step(at::Tensor master, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
               std::optional<at::Tensor> param_out, int64_t step, double lr, double beta1,
               double beta2, double eps, double weight_decay, bool adamw, bool bias_correction,
               double grad_scale, bool stochastic_rounding, int64_t seed, int64_t n_threads,
               const std::string& isa_request, const std::string& order, double beta1_power,
               double beta2_power) {
  const int64_t n = master.numel();
  check_dtype(master, "master", {at::kFloat, at::kBFloat16, at::kHalf},
              "float32, bfloat16 or float16 (a 16-bit master is stepped in fp32, rounded once)");
  check_tensor(master, "master", n);
  check_dtype(grad, "grad", {at::kFloat, at::kBFloat16, at::kHalf}, "float32, bfloat16 or float16");
  check_tensor(grad, "grad", n);
  check_dtype(exp_avg, "exp_avg", {at::kFloat, at::kBFloat16}, "float32 or bfloat16");
  check_tensor(exp_avg, "exp_avg", n);
  check_dtype(exp_avg_sq, "exp_avg_sq", {at::kFloat, at::kBFloat16}, "float32 or bfloat16");
  check_tensor(exp_avg_sq, "exp_avg_sq", n);
  TORCH_CHECK_TYPE(exp_avg.scalar_type() == exp_avg_sq.scalar_type(),
                   "cpu_adam: `exp_avg` (", exp_avg.scalar_type(), ") and `exp_avg_sq` (",
                   exp_avg_sq.scalar_type(), ") must have the same dtype");
  std::vector<std::pair<const at::Tensor*, const char*>> buffers = {
      {&master, "master"}, {&grad, "grad"}, {&exp_avg, "exp_avg"}, {&exp_avg_sq, "exp_avg_sq"}};
  std::optional<at::ScalarType> out_type;
  if (param_out) {
    check_dtype(*param_out, "param_out", {at::kBFloat16, at::kHalf}, "bfloat16 or float16");
    check_tensor(*param_out, "param_out", n);
    out_type = param_out->scalar_type();
    buffers.emplace_back(&*param_out, "param_out");
  }
  if (master.scalar_type() != at::kFloat) {
    TORCH_CHECK_TYPE(grad.scalar_type() == master.scalar_type(), "cpu_adam: a ", master.scalar_type(),
                     " `master` takes a gradient of its own dtype (as the optimizer reads it), got ",
                     grad.scalar_type());
    TORCH_CHECK_VALUE(!param_out, "cpu_adam: a ", master.scalar_type(),
                      " `master` is the working copy itself; `param_out` must be None");
  }
  check_no_overlap(buffers);
  TORCH_CHECK_VALUE(lr >= 0.0, "cpu_adam: `lr` must be >= 0, got ", lr);
  TORCH_CHECK_VALUE(beta1 >= 0.0 && beta1 < 1.0, "cpu_adam: `beta1` must be in [0, 1), got ", beta1);
  TORCH_CHECK_VALUE(beta2 >= 0.0 && beta2 < 1.0, "cpu_adam: `beta2` must be in [0, 1), got ", beta2);
  TORCH_CHECK_VALUE(eps >= 0.0, "cpu_adam: `eps` must be >= 0, got ", eps);
  TORCH_CHECK_VALUE(weight_decay >= 0.0, "cpu_adam: `weight_decay` must be >= 0, got ",
                    weight_decay);
  TORCH_CHECK_VALUE(step >= 1 || !bias_correction,
                    "cpu_adam: `step` must be >= 1 (the step being taken, counted from 1), got ",
                    step);
  TORCH_CHECK_VALUE(order == "torch" || order == "deepspeed", "cpu_adam: `order` must be ",
                    "\"torch\" or \"deepspeed\", got \"", order, "\"");
  const Isa isa = isa::resolve_isa(isa_request, kIsaEnv);
  // Like any in-place torch op, tell autograd these tensors changed (inference tensors have no
  // version counter).
  for (const auto& [t, name] : buffers) {
    if (t != &grad && !t->is_inference()) torch::autograd::impl::bump_version(*t);
  }
  if (n == 0) return;

  StepArgs a{adam_scalars(step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction,
                          grad_scale)};
  a.master = master.data_ptr();
  a.grad = grad.data_ptr();
  a.exp_avg = exp_avg.data_ptr();
  a.exp_avg_sq = exp_avg_sq.data_ptr();
  a.param_out = param_out ? param_out->data_ptr() : nullptr;
  a.numel = n;
  a.stochastic = stochastic_rounding && exp_avg.scalar_type() == at::kBFloat16;
  a.seed = static_cast<uint32_t>(static_cast<uint64_t>(seed) & 0xFFFFFFFFu);
  a.ds_order = order == "deepspeed";
  if (a.ds_order) {
    a.ds = deepspeed_scalars(lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, grad_scale,
                             beta1_power, beta2_power);
  }

  const SpanFn fn = pick_kernel(isa, master.scalar_type(), grad.scalar_type(), exp_avg.scalar_type(), out_type);

  // Threads over contiguous spans of >= kMinSpan elements, cut at multiples of 64 elements (a
  // cache line of fp32 and whole vectors of every ISA).
  constexpr int64_t kMinSpan = 1 << 15;
  int64_t threads = n_threads > 0 ? n_threads : at::get_num_threads();
  threads = std::max<int64_t>(1, std::min<int64_t>(threads, (n + kMinSpan - 1) / kMinSpan));
  if (threads == 1) {
    fn(a, 0, n);
    return;
  }
  const int64_t per = ((n + threads - 1) / threads + 63) / 64 * 64;
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    const int64_t begin = std::min<int64_t>(n, per * omp_get_thread_num());
    const int64_t end = std::min<int64_t>(n, begin + per);
    if (begin < end) fn(a, begin, end);
  }
}

}  // namespace
}  // namespace zerotrain

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "zerotrain one-pass fused Adam/AdamW step for CPU tensors (see cpu_adam.cpp)";
  m.def("adam_step", &zerotrain::adam_step, py::arg("master"), py::arg("grad"),
        py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("param_out"), py::arg("step"),
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("adamw"), py::arg("bias_correction"),
        py::arg("grad_scale"), py::arg("stochastic_rounding"), py::arg("seed"),
        py::arg("n_threads"), py::arg("isa"), py::arg("order") = "torch",
        py::arg("beta1_power") = 0.0, py::arg("beta2_power") = 0.0, py::call_guard<py::gil_scoped_release>(),
        "In-place fused Adam/AdamW step on one flat slice; see zerotrain.ops.fused_adam_step.");
  m.def("selected_isa", &zerotrain::selected_isa, py::arg("requested") = "",
        "The ISA a call with this `isa` argument would use (honours $ZEROTRAIN_ADAM_ISA).");
  m.def("supported_isas", &zerotrain::isa::supported_isas, "ISA paths this CPU can run, best first.");
}
