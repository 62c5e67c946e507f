#include <ember/support/safetensors.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/StringUtil.h>
#include <nlohmann/json.hpp>

#include <ember/error.h>

namespace ember::support {
namespace {

struct DtypeName {
  const char* name;
  at::ScalarType type;
};
constexpr DtypeName kDtypes[] = {
    {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf}, {"BF16", at::kBFloat16}, {"I64", at::kLong},
    {"I32", at::kInt},    {"I16", at::kShort}, {"I8", at::kChar},  {"U8", at::kByte},       {"BOOL", at::kBool},
};

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw ember::RunError(c10::str(path, ": not a valid safetensors file: ", what,
                                 ": re-export it (Python: safetensors.torch.save_file) or run scripts/setup.sh again"));
}

}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    throw ember::RunError(c10::str(path, ": cannot open: ", std::strerror(errno),
                                   ": check the path (the model folder needs model.safetensors)"));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    throw ember::RunError(c10::str(path, ": cannot stat: ", std::strerror(e)));
  }
  const auto size = static_cast<size_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    fail(path, c10::str("only ", size, " bytes, shorter than the 8-byte header length"));
  }
  void* base = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);  // the mapping keeps the file
  if (base == MAP_FAILED) throw ember::RunError(c10::str(path, ": cannot map: ", std::strerror(map_errno)));
  mapping_ = std::shared_ptr<void>(base, [size](void* p) { ::munmap(p, size); });
  const auto* bytes = static_cast<const unsigned char*>(base);

  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[i];
  if (header_len > size - 8) fail(path, c10::str("header length ", header_len, " exceeds the file size ", size));
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(reinterpret_cast<const char*>(bytes) + 8,
                                   reinterpret_cast<const char*>(bytes) + 8 + header_len);
  } catch (const nlohmann::json::exception& e) {
    fail(path, c10::str("header is not JSON (", e.what(), ")"));
  }
  if (!header.is_object()) fail(path, "header is not a JSON object");
  data_ = reinterpret_cast<const char*>(bytes) + 8 + header_len;
  const size_t data_size = size - 8 - header_len;

  std::vector<std::pair<size_t, std::string>> order;
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      if (v.is_object())
        for (const auto& [k, m] : v.items())
          if (m.is_string()) metadata_[k] = m.get<std::string>();
      continue;
    }
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets"))
      fail(path, c10::str("tensor '", name, "' lacks dtype, shape or data_offsets"));
    Entry e{};
    const std::string dtype = v["dtype"].is_string() ? v["dtype"].get<std::string>() : "";
    const auto* d = std::find_if(std::begin(kDtypes), std::end(kDtypes), [&](const DtypeName& x) { return dtype == x.name; });
    if (d == std::end(kDtypes)) fail(path, c10::str("tensor '", name, "' has an unsupported dtype '", dtype, "'"));
    e.dtype = d->type;
    int64_t numel = 1, bytes_needed = 0;
    if (!v["shape"].is_array()) fail(path, c10::str("tensor '", name, "' has a shape that is not a list"));
    for (const auto& s : v["shape"]) {
      if (!s.is_number_unsigned()) fail(path, c10::str("tensor '", name, "' has a negative or non-integer dimension"));
      // A crafted shape whose element count overflows could wrap to the bytes it spans (0) and
      // make a tensor far larger than its data.
      const uint64_t dim = s.get<uint64_t>();
      if (dim > static_cast<uint64_t>(INT64_MAX) || __builtin_mul_overflow(numel, static_cast<int64_t>(dim), &numel) ||
          __builtin_mul_overflow(numel, static_cast<int64_t>(at::elementSize(e.dtype)), &bytes_needed))
        fail(path, c10::str("tensor '", name, "' has a shape whose size overflows 64 bits"));
      e.shape.push_back(static_cast<int64_t>(dim));
    }
    const auto& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      fail(path, c10::str("tensor '", name, "' has data_offsets that are not two integers"));
    e.begin = off[0].get<size_t>();
    e.end = off[1].get<size_t>();
    if (e.begin > e.end || e.end > data_size)
      fail(path, c10::str("tensor '", name, "' spans bytes [", e.begin, ", ", e.end, ") outside the ", data_size,
                          "-byte data section (truncated file?)"));
    const auto expected = static_cast<size_t>(numel) * at::elementSize(e.dtype);  // fits: checked above
    if (e.end - e.begin != expected)
      fail(path, c10::str("tensor '", name, "' holds ", e.end - e.begin, " bytes, its shape and dtype need ", expected));
    order.emplace_back(e.begin, name);
    index_.emplace(name, std::move(e));
  }
  std::sort(order.begin(), order.end());
  for (auto& [_, name] : order) names_.push_back(std::move(name));
}

at::Tensor SafetensorsFile::tensor(const std::string& name) const {
  const auto it = index_.find(name);
  if (it == index_.end()) throw ember::RunError(c10::str(path_, ": has no tensor '", name, "'"));
  const Entry& e = it->second;
  auto keep = mapping_;
  // The data section is only byte-aligned: an unaligned tensor is copied rather than viewed.
  const char* p = data_ + e.begin;
  const auto align = at::elementSize(e.dtype);
  if (reinterpret_cast<uintptr_t>(p) % align != 0) {
    at::Tensor out = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
    std::memcpy(out.data_ptr(), p, e.end - e.begin);
    return out;
  }
  return at::from_blob(const_cast<char*>(p), e.shape, [keep](void*) {}, at::TensorOptions().dtype(e.dtype));
}

void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  size_t offset = 0;
  for (const auto& [name, t] : tensors) {
    if (name == "__metadata__" || header.contains(name))
      throw ember::RunError(c10::str(path, ": tensor name '", name, "' appears twice or is reserved"));
    const at::ScalarType type = t.scalar_type();  // a lambda cannot capture a structured binding before clang 16
    const auto* d = std::find_if(std::begin(kDtypes), std::end(kDtypes), [&](const DtypeName& x) { return x.type == type; });
    if (d == std::end(kDtypes))
      throw ember::RunError(c10::str(path, ": tensor '", name, "' has dtype ", t.scalar_type(), ", which safetensors cannot hold"));
    const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
    header[name] = {{"dtype", d->name}, {"shape", t.sizes().vec()}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keeps the data section 8-byte aligned
  const std::filesystem::path target(path);
  const std::filesystem::path tmp = target.string() + ".tmp";
  // The temporary file is closed and removed on every way out but success.
  struct TempFile {
    std::filesystem::path path;
    int fd = -1;
    bool keep = false;
    ~TempFile() {
      if (fd >= 0) ::close(fd);
      std::error_code ignored;
      if (!keep) std::filesystem::remove(path, ignored);
    }
  } file{tmp};
  file.fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (file.fd < 0) throw ember::RunError(c10::str(tmp.string(), ": cannot write: ", std::strerror(errno)));
  auto write_all = [&](const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t w = ::write(file.fd, p, n);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0)
        throw ember::RunError(c10::str(tmp.string(), ": write failed: ", std::strerror(w < 0 ? errno : ENOSPC), "; ", path,
                                       " is unchanged"));
      p += w;
      n -= static_cast<size_t>(w);
    }
  };
  unsigned char len[8];
  uint64_t n = text.size();
  for (unsigned char& b : len) { b = static_cast<unsigned char>(n & 0xff); n >>= 8; }
  write_all(len, 8);
  write_all(text.data(), text.size());
  // One CPU copy at a time: exporting a large model needs no second copy of all of it.
  for (const auto& [name, t] : tensors) {
    const at::Tensor cpu = t.detach().to(at::kCPU).contiguous();
    write_all(cpu.data_ptr(), static_cast<size_t>(cpu.numel()) * cpu.element_size());
  }
  if (::fsync(file.fd) != 0) throw ember::RunError(c10::str(tmp.string(), ": cannot sync to disk: ", std::strerror(errno)));
  ::close(file.fd);
  file.fd = -1;
  std::error_code ec;
  std::filesystem::rename(tmp, target, ec);
  if (ec) throw ember::RunError(c10::str(path, ": cannot rename the finished file into place: ", ec.message()));
  file.keep = true;
}

}  // namespace ember::support
