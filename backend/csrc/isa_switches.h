// The instruction-set switches cpu_kernels.cpp binds: the cap backend/kernels.py sets once at load
// (KVYARD_CPU_ISA), and the toggles tests use to run each path of the linears on a CPU that has several.
#pragma once

#include <torch/extension.h>

#include <string>

#include "qlinear.h"
#include "simd.h"

namespace kvyard {

inline bool has_vnni() { return cpu_has_vnni(); }

// Caps the instruction set (IsaLevel) for the rest of the process: the paths an older CPU takes, taken here.
// Called once, by backend/kernels.py as it loads the module, before any kernel runs.
inline void cap_isa(int level) {
  TORCH_CHECK(level >= ISA_AVX2 && level <= ISA_NATIVE, "ISA level 0 (AVX2), 1 (AVX-512) or 2 (native), not ", level);
  isa_cap() = level;
  avx512_on() = cpu_has_avx512();
  vbmi_on() = cpu_has_vbmi();
  int16_code() = cpu_int16_code();
}

// Turns the 512-bit linears on or off (on only where the CPU has AVX-512); returns the previous setting.
// For tests, which check both paths on a CPU that has both.
inline bool use_avx512(bool on) {
  const bool before = avx512_on();
  avx512_on() = on && cpu_has_avx512();
  return before;
}

// Runs the n16 linears on another of the codes this CPU has ("vnni", "avx512": vpmaddwd on 512 bits, "avx2";
// the same bits); returns the previous one. For tests, which compare them on a CPU that has them all.
inline std::string use_int16(const std::string& code) {
  static const char* names[] = {"avx2", "avx512", "vnni"};
  const int want = code == "vnni" ? I16_VNNI : code == "avx512" ? I16_AVX512 : code == "avx2" ? I16_AVX2 : -1;
  TORCH_CHECK(want >= 0, "int16 code vnni, avx512 or avx2, not ", code);
  TORCH_CHECK(want <= cpu_int16_code(), "this CPU (or its KVYARD_CPU_ISA cap) has no ", code, " int16 code");
  const std::string before = names[int16_code()];
  int16_code() = want;
  return before;
}

// Turns the K-quant kernels' VBMI decode on or off (on only where the CPU has it); returns the previous
// setting. For tests: both decodes must give the same bits.
inline bool use_vbmi(bool on) {
  const bool before = vbmi_on();
  vbmi_on() = on && cpu_has_vbmi();
  return before;
}

}  // namespace kvyard
