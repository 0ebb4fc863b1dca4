// AVX2/FMA/F16C helpers shared by kvyard's CPU kernels (no torch here: plain pointers).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace kvyard {

constexpr int QK = 32;  // weights per GGUF quant block (Q4_1 and Q8_0)

using half_t = uint16_t;  // IEEE binary16 bits (a float16 KV cache row)

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// The 8 lane-sums of a[0..7], as one vector (a transposed horizontal add).
inline __m256 hsum8(const __m256 a[8]) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  // h0 = [s0 s1 s2 s3 | s0' s1' s2' s3'] (low/high 128-bit halves of each sum), same for h1.
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}

// The KV cache is float32 or float16 (KV_CACHE_DTYPE): 8 values of a cache row as floats, and back.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const half_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline void store_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_row(const float* src, half_t* dst, int64_t n) {
  constexpr int round = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), round));
  for (; i < n; ++i) dst[i] = static_cast<half_t>(_cvtss_sh(src[i], round));
}

// e^x for 8 floats, x ≤ 0 (scores minus their max; -|g| for SiLU): 2^n · p(r) with x = n ln2 + r,
// |r| ≤ ln2/2, p a degree-6 Taylor polynomial (relative error < 2e-7 on that range).
inline __m256 exp_ps(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  const __m256 rr = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// The widest instruction set the kernels may use (KVYARD_CPU_ISA, set by backend/kernels.py before any
// kernel runs): 0 AVX2, 1 AVX-512 without VNNI, 2 whatever the CPU has. A lower level runs the code paths
// of an older CPU on this one, for tests and for measuring those paths.
enum IsaLevel : int { ISA_AVX2 = 0, ISA_AVX512 = 1, ISA_NATIVE = 2 };
inline int& isa_cap() {
  static int cap = ISA_NATIVE;
  return cap;
}

inline bool cpu_has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return yes && isa_cap() >= ISA_AVX512;
}

// Whether the linears take the 512-bit path: the CPU's answer unless a test turned it off (use_avx512).
inline bool& avx512_on() {
  static bool on = cpu_has_avx512();
  return on;
}

inline float half_to_float(half_t h) { return _cvtsh_ss(h); }

// n float16 values → floats (8 at a time).
inline void halves_to_floats(const half_t* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
  for (; i < n; ++i) dst[i] = half_to_float(src[i]);
}

// [begin, end) of `n` items that thread `tid` of `nt` takes: contiguous, sizes differ by at most one.
inline void split_range(int64_t n, int tid, int nt, int64_t& begin, int64_t& end) {
  begin = n * tid / nt;
  end = n * (tid + 1) / nt;
}

}  // namespace kvyard
