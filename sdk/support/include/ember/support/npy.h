// NumPy's .npy format (versions 1-3) read from bytes in memory: magic, version, header length, a
// Python dict literal {'descr': '<f4', 'fortran_order': False, 'shape': (N, ...), }, then the
// C-order data. tensor_files reads memory-mapped files with it, webdataset the .npy members of
// its tar shards.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>
#include <ember/error.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace ember::support {

// The array in `bytes` [0, size). `name` (a path, shard:member) opens every error message, which
// throws ember::RunError. With `keep_alive` the tensor views the bytes (when aligned) and calls
// keep_alive when the tensor is freed; without it the data is copied.
inline at::Tensor read_npy(const char* p, size_t size, const std::string& name, std::function<void()> keep_alive = nullptr) {
  // The header dict numpy writes, parsed as the Python literal it is (numpy reads it with
  // ast.literal_eval): {'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), } padded with
  // spaces and a newline. Exactly these three keys, as numpy requires. Hand-written rather than
  // regular expressions: no regex compiled per file, and no recursion as deep as the header is long.
  struct Header {
    std::string descr;
    bool fortran_order = false;
    std::vector<int64_t> shape;
  };

  class HeaderParser {
   public:
    explicit HeaderParser(const std::string& text) : s_(text) {}

    // At most 40 characters of `s` for a message, bytes outside printable ASCII as \xNN (messages
    // stay one line).
    static std::string printable(const std::string& s) {
      std::string out;
      for (size_t i = 0; i < s.size() && i < 40; ++i) {
        const auto c = static_cast<unsigned char>(s[i]);
        if (c >= 0x20 && c < 0x7F) {
          out += static_cast<char>(c);
        } else {
          static const char* hex = "0123456789abcdef";
          out += "\\x";
          out += hex[c >> 4];
          out += hex[c & 15];
        }
      }
      return s.size() > 40 ? out + "..." : out;
    }

    // Empty on success, otherwise what is wrong.
    std::string parse(Header& out) {
      bool has_descr = false, has_order = false, has_shape = false;
      space();
      if (!take('{')) return "the header is not a Python dict ({'descr': ..., 'fortran_order': ..., 'shape': (...)})";
      for (;;) {
        space();
        if (take('}')) break;
        std::string key;
        if (!quoted(key)) return "the header's dict has a key that is not a quoted string at byte " + std::to_string(i_);
        space();
        if (!take(':')) return "the header's dict has no ':' after '" + printable(key) + "'";
        space();
        if (key == "descr") {
          if (has_descr) return "the header names 'descr' twice";
          has_descr = true;
          if (!quoted(out.descr)) return "the header's 'descr' is not a string (a structured dtype is not supported)";
        } else if (key == "fortran_order") {
          if (has_order) return "the header names 'fortran_order' twice";
          has_order = true;
          if (word("True")) out.fortran_order = true;
          else if (word("False")) out.fortran_order = false;
          else return "the header's 'fortran_order' is neither True nor False";
        } else if (key == "shape") {
          if (has_shape) return "the header names 'shape' twice";
          has_shape = true;
          if (std::string why = shape(out.shape); !why.empty()) return why;
        } else {
          return "the header has a key '" + printable(key) + "' numpy does not write (only 'descr', 'fortran_order' and 'shape')";
        }
        space();
        if (take(',')) continue;
        space();
        if (take('}')) break;
        return "the header's dict is malformed at byte " + std::to_string(i_);
      }
      space();
      if (i_ != s_.size()) return "the header has text after its dict";
      if (!has_descr || !has_order || !has_shape) return "the header lacks 'descr', 'fortran_order' or 'shape'";
      return "";
    }

   private:
    void space() {
      while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\t' || s_[i_] == '\r')) ++i_;
    }
    bool take(char c) {
      if (i_ < s_.size() && s_[i_] == c) return ++i_, true;
      return false;
    }
    bool word(const char* w) {
      const size_t n = std::strlen(w);
      if (s_.compare(i_, n, w) != 0) return false;
      i_ += n;
      return true;
    }
    // 'text' or "text", without escapes (numpy's keys and dtype strings have none).
    bool quoted(std::string& out) {
      if (i_ >= s_.size() || (s_[i_] != '\'' && s_[i_] != '"')) return false;
      const char q = s_[i_];
      const size_t end = s_.find(q, i_ + 1);
      if (end == std::string::npos || s_.find('\\', i_ + 1) < end) return false;
      out = s_.substr(i_ + 1, end - i_ - 1);
      i_ = end + 1;
      return true;
    }
    // (), (n,), (n, m), ... with Python 2's long suffix ("3L", written by numpy under Python 2).
    std::string shape(std::vector<int64_t>& out) {
      if (!take('(')) return "the header's 'shape' is not a tuple";
      for (;;) {
        space();
        if (take(')')) return "";
        if (i_ >= s_.size() || s_[i_] < '0' || s_[i_] > '9') return "the header's 'shape' holds something other than sizes (non-negative integers)";
        int64_t d = 0;
        while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') {
          if (__builtin_mul_overflow(d, int64_t{10}, &d) || __builtin_add_overflow(d, int64_t{s_[i_] - '0'}, &d))
            return "the header's 'shape' has a size that does not fit 64 bits";
          ++i_;
        }
        take('L');
        if (out.size() == 64) return "the header's 'shape' has more than 64 dimensions (numpy's limit)";
        out.push_back(d);
        space();
        if (take(')')) return "";
        if (!take(',')) return "the header's 'shape' is malformed at byte " + std::to_string(i_);
      }
    }

    const std::string& s_;
    size_t i_ = 0;
  };

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
  // numpy itself reads at most 10,000 header bytes unless told otherwise (max_header_size).
  constexpr size_t kMaxHeader = 10000;
  if (header_len > kMaxHeader) return fail("a header of " + std::to_string(header_len) + " bytes (numpy reads at most 10000)");
  if (offset + header_len > size) return fail("a truncated header");
  const std::string text(p + offset, header_len);
  Header header;
  if (std::string why = HeaderParser(text).parse(header); !why.empty()) return fail(why);
  if (header.fortran_order) return fail("Fortran order (save numpy.ascontiguousarray(a))");
  const std::vector<int64_t>& shape = header.shape;
  static const std::vector<std::pair<std::string, at::ScalarType>> kinds = {
      {"<f4", at::kFloat}, {"<f8", at::kDouble}, {"<f2", at::kHalf}, {"<i8", at::kLong}, {"<i4", at::kInt}, {"<i2", at::kShort},
      {"|i1", at::kChar},  {"|u1", at::kByte},   {"|b1", at::kBool}, {"<u1", at::kByte}, {"<i1", at::kChar}};
  at::ScalarType dtype = at::kFloat;
  bool known = false;
  for (const auto& [d, t] : kinds)
    if (d == header.descr) dtype = t, known = true;
  if (!known) return fail("dtype '" + HeaderParser::printable(header.descr) + "' (use little-endian float16/32/64, int8/16/32/64, uint8 or bool)");
  // The byte count, checked for overflow: a shape whose size wraps around would pass the size
  // check below and view memory the file does not have.
  // Sizes of 0 count as 1 here: the strides of an empty array must fit too.
  size_t bytes = at::elementSize(dtype), span = bytes;
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(span, static_cast<size_t>(std::max<int64_t>(d, 1)), &span) || span > static_cast<size_t>(INT64_MAX))
      return fail("a shape " + std::string(c10::str(at::IntArrayRef(shape))) + " whose size overflows 64 bits");
    bytes *= static_cast<size_t>(d);  // no larger than span
  }
  const size_t data = offset + header_len;
  if (bytes > size - data) return fail("holds fewer bytes than its shape " + std::string(c10::str(at::IntArrayRef(shape))) + " needs (a truncated file)");
  const char* start = p + data;
  // numpy aligns the data to 64 bytes in a file; an unaligned one is copied rather than viewed.
  if (!keep_alive || reinterpret_cast<uintptr_t>(start) % at::elementSize(dtype) != 0) {
    at::Tensor out = at::empty(shape, dtype);
    if (bytes > 0) std::memcpy(out.data_ptr(), start, bytes);
    return out;
  }
  return at::from_blob(const_cast<char*>(start), shape, [keep_alive](void*) { keep_alive(); }, at::TensorOptions().dtype(dtype));
}

}  // namespace ember::support
