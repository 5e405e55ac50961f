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

// DeepSpeed's order (`order="deepspeed"`, csrc/adam/cpu_adam.cpp): the scalars as DeepSpeed
// 0.19.8's host Adam (ds_adam_step) derives them, every one in fp32: the hyperparameters rounded
// to fp32 first, the bias corrections from the caller's fp32 powers beta^step (DeepSpeed keeps
// them as a running fp32 product), bias_correction2 = 1 / sqrt(1 - beta2^step) (a multiplier),
// step_size = -lr / (1 - beta1^step), decoupled_decay = -lr * weight_decay. Weight decay applies
// only when it is > 0.
struct DeepSpeedScalars {
  float grad_scale, beta1, one_minus_beta1, beta2, one_minus_beta2, bias_correction2, eps;
  float step_size, decoupled_decay, weight_decay;
  WeightDecay wd_mode;
};

inline DeepSpeedScalars deepspeed_scalars(double lr, double beta1, double beta2, double eps,
                                          double weight_decay, bool adamw, bool bias_correction,
                                          double grad_scale, double beta1_power,
                                          double beta2_power) {
  DeepSpeedScalars h{};
  const float alpha = static_cast<float>(lr);
  h.grad_scale = static_cast<float>(grad_scale);
  h.beta1 = static_cast<float>(beta1);
  h.beta2 = static_cast<float>(beta2);
  h.one_minus_beta1 = 1.0f - h.beta1;
  h.one_minus_beta2 = 1.0f - h.beta2;
  h.eps = static_cast<float>(eps);
  h.weight_decay = static_cast<float>(weight_decay);
  float bc1 = 1.0f;
  h.bias_correction2 = 1.0f;
  if (bias_correction) {
    bc1 = 1.0f - static_cast<float>(beta1_power);
    h.bias_correction2 = 1.0f / std::sqrt(1.0f - static_cast<float>(beta2_power));
  }
  h.step_size = -alpha / bc1;
  h.decoupled_decay = -alpha * h.weight_decay;
  h.wd_mode = h.weight_decay > 0.0f ? (adamw ? WeightDecay::kDecoupled : WeightDecay::kL2)
                                    : WeightDecay::kNone;
  return h;
}

}  // namespace zerotrain
