// Run-time choice of the CPU kernels' SIMD path, shared by every CPU op (cpu_adam.cpp,
// quantize.cpp): which paths this CPU (and build) can run, and which one a call takes.
//
// A call takes the path named by its `isa` argument, else by the op's environment variable (e.g.
// $ZEROTRAIN_ADAM_ISA), else the best the CPU supports. Asking for a path the CPU lacks is an
// error, never a silent downgrade: a test that forces a path must really run it.
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "simd.h"

namespace zerotrain {
namespace isa {

enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

inline bool cpu_has(Isa isa) {
#if ZT_SIMD_X86 && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (isa == Isa::kAvx2) return avx2;
  if (isa == Isa::kAvx512) return avx2 && __builtin_cpu_supports("avx512f");
#endif
  return isa == Isa::kScalar;
}

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

inline std::vector<std::string> supported_isas() {
  std::vector<std::string> out;
  for (Isa isa : {Isa::kAvx512, Isa::kAvx2, Isa::kScalar}) {
    if (cpu_has(isa)) out.emplace_back(isa_name(isa));
  }
  return out;
}

// The path for a call: `requested` ("", "auto", "avx512", "avx2", "scalar"), else $`env_var`.
inline Isa resolve_isa(const std::string& requested, const char* env_var) {
  std::string name = requested;
  std::string source = "the `isa` argument";
  if (name.empty() || name == "auto") {
    const char* env = std::getenv(env_var);
    name = env ? env : "";
    source = env_var;
  }
  if (name.empty() || name == "auto") {
    for (Isa isa : {Isa::kAvx512, Isa::kAvx2}) {
      if (cpu_has(isa)) return isa;
    }
    return Isa::kScalar;
  }
  Isa isa;
  if (name == "avx512") {
    isa = Isa::kAvx512;
  } else if (name == "avx2") {
    isa = Isa::kAvx2;
  } else if (name == "scalar") {
    isa = Isa::kScalar;
  } else {
    TORCH_CHECK_VALUE(false, source, "='", name,
                      "' is not a known ISA; use one of avx512, avx2, scalar (or auto)");
  }
  TORCH_CHECK(cpu_has(isa), source, "='", name,
              "' but this CPU (or build) lacks it; it supports: ",
              c10::Join(", ", supported_isas()), ". Unset ", source, " to choose automatically.");
  return isa;
}

}  // namespace isa
}  // namespace zerotrain
