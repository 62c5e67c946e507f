// Safetensors (Hugging Face's weight format) for the text models: an 8-byte little-endian header
// length, a JSON header {name: {dtype, shape, data_offsets}}, then the raw tensor bytes.
// Reading memory-maps the file and hands out tensors that view the mapping (no copy); writing
// goes to a temporary file renamed into place, so an earlier file survives a failed write.
#pragma once
#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace ember_text {

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

// Writes `tensors` (any device and dtype that safetensors knows; contiguous copies are made on the
// CPU) to `path` atomically. Names must be unique.
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace ember_text
