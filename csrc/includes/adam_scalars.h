// The per-call scalars of one Adam/AdamW step, derived from the hyperparameters once, on the host,
// by both kernels (csrc/adam/cpu_adam.cpp and csrc/adam/fused_adam.cu), so that they round the
// same way and stay equal to torch.optim.Adam/AdamW:
//
//   Adam:  g = g + weight_decay * p               AdamW: p = p * decay,  decay = 1 - lr * wd
//   m      = lerp(m, g, lerp_weight),  lerp_weight = 1 - beta1
//   v      = v * beta2 + one_minus_beta2 * g * g
//   denom  = sqrt(v) / bias_correction2_sqrt + eps
//   p      = p + neg_step_size * m / denom,       neg_step_size = -lr / (1 - beta1^step)
//
// Each scalar is computed in double and rounded to fp32 once, as torch does for fp32 tensors.
// Plain host C++ (no torch, no CUDA headers), so nvcc and the C++ compiler both take it.
#pragma once

#include <cmath>
#include <cstdint>

namespace zerotrain {

enum class WeightDecay : int { kNone = 0, kL2 = 1, kDecoupled = 2 };

struct AdamScalars {
  float grad_scale, weight_decay, decay, lerp_weight, one_minus_lerp_weight;
  float beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size;
  WeightDecay wd_mode;
  // torch's lerp: start + w*(end-start) if w < 0.5, else end - (end-start)*(1-w)
  bool lerp_from_start;
};

inline AdamScalars adam_scalars(int64_t step, double lr, double beta1, double beta2, double eps,
                                double weight_decay, bool adamw, bool bias_correction,
                                double grad_scale) {
  AdamScalars h{};
  h.grad_scale = static_cast<float>(grad_scale);
  h.weight_decay = static_cast<float>(weight_decay);
  h.decay = static_cast<float>(1.0 - lr * weight_decay);
  h.wd_mode = weight_decay == 0.0 ? WeightDecay::kNone
                                  : (adamw ? WeightDecay::kDecoupled : WeightDecay::kL2);
  const float w = static_cast<float>(1.0 - beta1);
  h.lerp_weight = w;
  // Rounded from double like the rest; for one subtraction of fp32 values that equals the fp32
  // subtraction 1.0f - w (double rounding is harmless there: 53 >= 2 * 24 + 2 bits).
  h.one_minus_lerp_weight = static_cast<float>(1.0 - static_cast<double>(w));
  h.lerp_from_start = w < 0.5f;
  h.beta2 = static_cast<float>(beta2);
  h.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  const double s = static_cast<double>(step);
  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, s) : 1.0;
  const double bc2 = bias_correction ? 1.0 - std::pow(beta2, s) : 1.0;
  h.bias_correction2_sqrt = static_cast<float>(std::sqrt(bc2));
  h.eps = static_cast<float>(eps);
  h.neg_step_size = static_cast<float>(-(lr / bc1));
  return h;
}

}  // namespace zerotrain
