// TFRecord framing of TensorBoard event files, free of Ember and protobuf types so unit tests
// include it directly. A record is
//   uint64 length | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)
// little endian, with CRC-32C (Castagnoli) masked as TensorFlow's crc32c::Mask does.
#pragma once
#include <boost/crc.hpp>

#include <cstdint>
#include <string>
#include <string_view>

namespace ember_tb {

inline uint32_t crc32c(std::string_view data) {
  boost::crc_optimal<32, 0x1EDC6F41, 0xFFFFFFFF, 0xFFFFFFFF, true, true> crc;
  crc.process_bytes(data.data(), data.size());
  return crc.checksum();
}

inline uint32_t masked_crc32c(std::string_view data) {
  const uint32_t c = crc32c(data);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

inline void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// The framed record of `data`.
inline std::string frame_record(std::string_view data) {
  std::string out;
  out.reserve(data.size() + 16);
  put_le(out, data.size(), 8);
  put_le(out, masked_crc32c(std::string_view(out.data(), 8)), 4);
  out.append(data);
  put_le(out, masked_crc32c(data), 4);
  return out;
}

}  // namespace ember_tb
