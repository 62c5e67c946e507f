// Safetensors (Hugging Face's weight format): an 8-byte little-endian header length, a JSON
// header {name: {dtype, shape, data_offsets}, "__metadata__": {str: str}}, then the raw tensor
// bytes. Reading memory-maps the file and hands out tensors that view the mapping (no copy);
// writing goes to a temporary file that is synced and renamed into place, so an earlier file
// survives a failed write. Compiled library Ember::safetensors (the bert model reads pretrained
// weights with it, `engine export` writes them); it depends on the SDK only.
#pragma once
#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace ember::support {

class SafetensorsFile {
 public:
  // Maps `path` and checks the header: every tensor's dtype is known, its offsets lie inside the
  // data section and match its shape. Throws ember::RunError naming the file and the problem.
  explicit SafetensorsFile(const std::string& path);
  const std::string& path() const { return path_; }
  // Names in the header's order of offsets (the order the file stores them).
  const std::vector<std::string>& names() const { return names_; }
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  // A CPU tensor viewing the mapped bytes (read-only in spirit: copy before changing it). The
  // mapping lives as long as any tensor handed out.
  at::Tensor tensor(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  struct Entry {
    at::ScalarType dtype;
    std::vector<int64_t> shape;
    size_t begin = 0, end = 0;  // offsets into the data section
  };
  std::string path_;
  std::shared_ptr<void> mapping_;
  const char* data_ = nullptr;  // start of the data section
  std::map<std::string, Entry> index_;
  std::vector<std::string> names_;
  std::map<std::string, std::string> metadata_;
};

// Writes `tensors` (any device and dtype that safetensors knows; each is copied to the CPU as a
// contiguous tensor while it is written) to `path` atomically. Names must be unique. Python's
// safetensors and transformers want metadata {"format": "pt"} for PyTorch tensors.
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace ember::support
