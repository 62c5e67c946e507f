#include "checkpoint/crc32c.h"

#include <nmmintrin.h>

#include <cinttypes>
#include <cstdio>
#include <cstring>

#include <boost/crc.hpp>

namespace ember::engine {
namespace {
using Crc32cBoost = boost::crc_optimal<32, 0x1EDC6F41, 0xFFFFFFFF, 0xFFFFFFFF, true, true>;

__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(uint32_t crc, const unsigned char* p, size_t n) {
  uint64_t c = crc ^ 0xFFFFFFFFu;
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7u) != 0) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
    --n;
  }
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
    p += 8;
    n -= 8;
  }
  while (n-- > 0) c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
  return static_cast<uint32_t>(c) ^ 0xFFFFFFFFu;
}
}  // namespace

std::string hex32(uint32_t v) {
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08" PRIx32, v);
  return buf;
}

uint32_t crc32c_portable_extend(uint32_t crc, const void* data, size_t size) {
  // Boost.CRC takes the register unreflected: the reflected algorithm's inverted checksum, bit-reversed.
  uint32_t reg = ~crc, unreflected = 0;
  for (int i = 0; i < 32; ++i)
    if ((reg >> i) & 1u) unreflected |= 1u << (31 - i);
  Crc32cBoost c(unreflected);
  c.process_bytes(data, size);
  return c.checksum();
}

uint32_t crc32c_portable(const void* data, size_t size) { return crc32c_portable_extend(0, data, size); }

uint32_t crc32c_extend(uint32_t crc, const void* data, size_t size) {
  static const bool has_sse42 = __builtin_cpu_supports("sse4.2");
  if (size == 0) return crc;
  return has_sse42 ? crc32c_sse42(crc, static_cast<const unsigned char*>(data), size) : crc32c_portable_extend(crc, data, size);
}

uint32_t crc32c(const void* data, size_t size) { return crc32c_extend(0, data, size); }

}  // namespace ember::engine
