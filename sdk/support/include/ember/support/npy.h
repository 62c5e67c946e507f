// NumPy's .npy format (versions 1-3) read from bytes in memory: magic, version, header length, a
// Python dict literal {'descr': '<f4', 'fortran_order': False, 'shape': (N, ...), }, then the
// C-order data. tensor_files reads memory-mapped files with it, webdataset the .npy members of
// its tar shards.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>
#include <ember/error.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <regex>
#include <string>
#include <utility>
#include <vector>

namespace ember::support {

// The array in `bytes` [0, size). `name` (a path, shard:member) opens every error message, which
// throws ember::RunError. With `keep_alive` the tensor views the bytes (when aligned) and calls
// keep_alive when the tensor is freed; without it the data is copied.
inline at::Tensor read_npy(const char* p, size_t size, const std::string& name, std::function<void()> keep_alive = nullptr) {
  auto fail = [&](const std::string& why) -> at::Tensor {
    throw ember::RunError(name + ": " + why + " (write it with numpy.save)");
  };
  if (size < 10 || std::memcmp(p, "\x93NUMPY", 6) != 0) return fail("not a .npy file");
  const int major = static_cast<unsigned char>(p[6]);
  size_t header_len = 0, offset = 0;
  if (major == 1) {
    header_len = static_cast<unsigned char>(p[8]) | (static_cast<size_t>(static_cast<unsigned char>(p[9])) << 8);
    offset = 10;
  } else if (major == 2 || major == 3) {
    if (size < 12) return fail("a truncated header");
    for (int i = 0; i < 4; ++i) header_len |= static_cast<size_t>(static_cast<unsigned char>(p[8 + i])) << (8 * i);
    offset = 12;
  } else {
    return fail("format version " + std::to_string(major) + " is unknown");
  }
  if (offset + header_len > size) return fail("a truncated header");
  const std::string header(p + offset, header_len);
  std::smatch m;
  if (!std::regex_search(header, m, std::regex("'descr':\\s*'([^']*)'"))) return fail("no 'descr' in the header");
  const std::string descr = m[1];
  if (std::regex_search(header, std::regex("'fortran_order':\\s*True"))) return fail("Fortran order (save numpy.ascontiguousarray(a))");
  if (!std::regex_search(header, m, std::regex("'shape':\\s*\\(([^)]*)\\)"))) return fail("no 'shape' in the header");
  std::vector<int64_t> shape;
  const std::string dims = m[1];
  const std::regex number("\\d+");
  for (std::sregex_iterator it(dims.begin(), dims.end(), number), end; it != end; ++it) shape.push_back(std::stoll(it->str()));
  static const std::vector<std::pair<std::string, at::ScalarType>> kinds = {
      {"<f4", at::kFloat}, {"<f8", at::kDouble}, {"<f2", at::kHalf}, {"<i8", at::kLong}, {"<i4", at::kInt}, {"<i2", at::kShort},
      {"|i1", at::kChar},  {"|u1", at::kByte},   {"|b1", at::kBool}, {"<u1", at::kByte}, {"<i1", at::kChar}};
  at::ScalarType dtype = at::kFloat;
  bool known = false;
  for (const auto& [d, t] : kinds)
    if (d == descr) dtype = t, known = true;
  if (!known) return fail("dtype '" + descr + "' (use little-endian float16/32/64, int8/16/32/64, uint8 or bool)");
  int64_t count = 1;
  for (int64_t d : shape) count *= d;
  const size_t data = offset + header_len;
  if (data + static_cast<size_t>(count) * at::elementSize(dtype) > size)
    return fail("holds fewer bytes than its shape " + std::string(c10::str(shape)) + " needs (a truncated file)");
  const char* start = p + data;
  // numpy aligns the data to 64 bytes in a file; an unaligned one is copied rather than viewed.
  if (!keep_alive || reinterpret_cast<uintptr_t>(start) % at::elementSize(dtype) != 0) {
    at::Tensor out = at::empty(shape, dtype);
    std::memcpy(out.data_ptr(), start, static_cast<size_t>(count) * at::elementSize(dtype));
    return out;
  }
  return at::from_blob(const_cast<char*>(start), shape, [keep_alive](void*) { keep_alive(); }, at::TensorOptions().dtype(dtype));
}

}  // namespace ember::support
