// Private to the SDK's compiled helpers (Ember::activations, Ember::losses): what their CPU loops
// share so that they vectorise the same way.
#pragma once
#include <algorithm>
#include <bit>
#include <cstdint>

// Each loop marked with it is compiled for AVX-512, for AVX2 + FMA and for the baseline, and the
// loader picks the one this CPU runs (GCC's function multi-versioning), as ATen dispatches its own
// kernels. Not under sanitizers: their runtimes start after the loader has run the ifunc resolvers.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && \
    !defined(__SANITIZE_THREAD__) && !defined(__SANITIZE_ADDRESS__)
#define EMBER_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define EMBER_CPU_CLONES
#endif

namespace ember::cpu_math {

// e^x in float32 (Cephes' expf: x = n ln2 + r, |r| <= ln2/2, a degree-6 polynomial in r, scaled by
// 2^n through the exponent bits), written without calls or branches so that it vectorises. The
// argument is clamped to where 2^n stays a normal float; NaN passes through.
inline float exp_f32(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  // Round to nearest by adding and subtracting 1.5 * 2^23 (|x log2 e| < 2^22).
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f;  // ln 2 in two parts, so that r keeps its low bits
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

}  // namespace ember::cpu_math
