// The archive side of a checkpoint file (docs/checkpoint.md): torch.save's zip layout read from
// memory, and Ember's manifest record, which lists the CRC32C and size of every payload record
// and is checked before anything is unpickled.
#pragma once
#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace ember::engine {

// PyTorchStreamReader over bytes already in memory (no copy).
class BufferReader final : public caffe2::serialize::ReadAdapterInterface {
 public:
  BufferReader(const char* data, size_t size) : data_(data), size_(size) {}
  size_t size() const override { return size_; }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
    if (pos >= size_) return 0;
    n = std::min<size_t>(n, size_ - static_cast<size_t>(pos));
    std::memcpy(buf, data_ + pos, n);
    return n;
  }

 private:
  const char* data_;
  size_t size_;
};

struct ManifestEntry {
  uint32_t crc = 0;
  uint64_t size = 0;
  std::string name;
};

struct Manifest {
  int64_t format_version = -1;
  bool weights_only = false;
  std::vector<ManifestEntry> records;
};

// Text, one item per line:
//   ember-manifest 1
//   format_version <n>
//   weights_only <0|1>
//   record <crc32c, 8 hex digits> <size> <record name>
//   end <crc32c of every line above, 8 hex digits>
std::string format_manifest(const Manifest& m);
// Throws std::invalid_argument with what is wrong.
Manifest parse_manifest(const std::string& text);

// Payload records a checkpoint must have listed in its manifest.
bool is_payload_record(const std::string& name);
std::string read_record_text(caffe2::serialize::PyTorchStreamReader& reader, const std::string& name);
// The first line of an error, and of a long one its first sentence (LibTorch's zip reader adds
// a paragraph of advice).
std::string short_what(const std::exception& e);
// Checks every payload record against the manifest's CRC32C and size, before anything is
// unpickled (a damaged pickle must not reach the unpickler). Throws std::runtime_error with one
// line naming `where`.
void verify_records(caffe2::serialize::PyTorchStreamReader& reader, const Manifest& m, std::string_view bytes,
                    const std::string& where);
// The same over an archive of `archive_size` bytes read piece by piece: `crc_of(offset, size)` is
// the CRC32C of that range (a file checked in chunks, never whole in memory).
using RangeCrc = std::function<uint32_t(uint64_t offset, uint64_t size)>;
void verify_records(caffe2::serialize::PyTorchStreamReader& reader, const Manifest& m, uint64_t archive_size,
                    const RangeCrc& crc_of, const std::string& where);

}  // namespace ember::engine
