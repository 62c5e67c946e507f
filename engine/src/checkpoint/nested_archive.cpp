#include "checkpoint/nested_archive.h"

#include <unistd.h>  // pread

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>
#include <torch/csrc/jit/api/compilation_unit.h>
#include <torch/csrc/jit/serialization/storage_context.h>
#include <torch/csrc/jit/serialization/unpickler.h>

#include <ember/support/checkpoint_read.h>

#include "checkpoint/archive.h"  // BufferReader, short_what

namespace ember::engine {
namespace {

// Bytes [offset, offset + size) of an open file, read on demand.
class FileRangeReader final : public caffe2::serialize::ReadAdapterInterface {
 public:
  FileRangeReader(int fd, uint64_t offset, uint64_t size) : fd_(fd), offset_(offset), size_(size) {}
  size_t size() const override { return size_; }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
    if (pos >= size_) return 0;
    n = static_cast<size_t>(std::min<uint64_t>(n, size_ - pos));
    size_t done = 0;
    while (done < n) {
      const ssize_t got = ::pread(fd_, static_cast<char*>(buf) + done, n - done, static_cast<off_t>(offset_ + pos + done));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) break;  // miniz reports the short read as a damaged archive
      done += static_cast<size_t>(got);
    }
    return done;
  }

 private:
  int fd_;
  uint64_t offset_, size_;
};

// The storage data of the record at `offset` of the archive: where its bytes lie, or none (a
// storage of the record's size without data: the checks look at sizes only).
using StorageData = std::function<c10::DataPtr(uint64_t offset)>;

// The claims of a pickle that is only checked, not unpickled here.
void check_claims_of(caffe2::serialize::PyTorchStreamReader& reader, const std::string& name) {
  try {
    const auto [pickle, size] = reader.getRecord(name);
    support::check_pickle_claims(std::string_view(static_cast<const char*>(pickle.get()), size));
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument("record " + name + " is not valid: " + e.what());
  } catch (const std::exception& e) {
    throw std::invalid_argument("record " + name + " cannot be read (" + short_what(e) + ")");
  }
}

// What torch::save writes as the TorchScript of an archive (an optimizer's state, a C++ module's
// parameters): classes of attributes, each line one of
//   class Module(Module):
//     __parameters__ = ["name", ]      (also __buffers__; __annotations__ = [])
//     __annotations__["name"] = TYPE
//     name : TYPE
// with TYPE a name or a bracketed type such as Tuple[float, float]. torch::load compiles the code,
// and runs the __setstate__ of a class that defines one while it loads: code from the file, which
// could loop forever (a crafted one hung torch.jit.load) or, nested deeply enough, overflow the
// compiler's stack (List[ 100,000 deep: a segfault). So every line must be one of these forms,
// checked here before anything compiles it; "" when `line` is, else what is wrong.
constexpr int kMaxTypeDepth = 8;

bool is_name_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.'; }

// Consumes a name (dotted) at `at`; false when there is none.
bool take_name(std::string_view s, size_t& at) {
  const size_t from = at;
  if (at < s.size() && !std::isdigit(static_cast<unsigned char>(s[at])))
    while (at < s.size() && is_name_char(s[at])) ++at;
  return at > from;
}

// Consumes a double-quoted string without escapes at `at`.
bool take_string(std::string_view s, size_t& at) {
  if (at >= s.size() || s[at] != '"') return false;
  const size_t end = s.find_first_of("\"\\\n", at + 1);
  if (end == std::string_view::npos || s[end] != '"') return false;
  at = end + 1;
  return true;
}

bool take(std::string_view s, size_t& at, std::string_view word) {
  if (s.substr(at, word.size()) != word) return false;
  at += word.size();
  return true;
}

// The rest of the line from `at` is a type: names, brackets (at most kMaxTypeDepth deep), commas.
std::string check_type(std::string_view s, size_t at) {
  int depth = 0;
  bool named = false;
  for (; at < s.size(); ++at) {
    const char c = s[at];
    if (c == '[' && ++depth > kMaxTypeDepth) return "its type nests deeper than " + std::to_string(kMaxTypeDepth);
    if (c == ']' && --depth < 0) return "its type closes a bracket it did not open";
    if (c != '[' && c != ']' && c != ',' && c != ' ' && !is_name_char(c)) return "its type holds '" + std::string(1, c) + "'";
    named = named || is_name_char(c);
  }
  if (depth != 0) return "its type leaves a bracket open";
  return named ? "" : "it declares no type";
}

std::string check_declaration(std::string_view line) {
  size_t at = 0;
  if (take(line, at, "class ")) {
    return take_name(line, at) && take(line, at, "(") && take_name(line, at) && take(line, at, "):") && at == line.size()
               ? ""
               : "it is not a class header of the form `class Module(Module):`";
  }
  if (!take(line, at, "  ") || at >= line.size() || line[at] == ' ') return "it is not a class attribute, indented by two spaces";
  for (const std::string_view list : {"__parameters__ = [", "__buffers__ = ["}) {
    if (!take(line, at, list)) continue;
    while (take_string(line, at))
      if (!take(line, at, ", ")) break;
    return take(line, at, "]") && at == line.size() ? "" : "its list holds something other than names";
  }
  if (line.substr(at) == "__annotations__ = []") return "";
  if (take(line, at, "__annotations__[")) {
    if (!take_string(line, at) || !take(line, at, "] = ")) return "its __annotations__ entry is not `[\"name\"] = TYPE`";
    return check_type(line, at);
  }
  if (take_name(line, at) && take(line, at, " : ")) return check_type(line, at);
  return "it is not an attribute declaration (`name : TYPE`)";
}

void check_source(caffe2::serialize::PyTorchStreamReader& reader, const std::string& name) {
  std::string source;
  try {
    const auto [data, size] = reader.getRecord(name);
    source.assign(static_cast<const char*>(data.get()), size);
  } catch (const std::exception& e) {
    throw std::invalid_argument("record " + name + " cannot be read (" + short_what(e) + ")");
  }
  size_t number = 0;
  for (size_t from = 0; from < source.size();) {
    const size_t end = std::min(source.find('\n', from), source.size());
    std::string_view line(source.data() + from, end - from);
    from = end + 1;
    ++number;
    while (!line.empty() && (line.back() == ' ' || line.back() == '\r')) line.remove_suffix(1);
    if (line.empty()) continue;
    if (const std::string why = check_declaration(line); !why.empty()) {
      const std::string shown = line.size() > 60 ? std::string(line.substr(0, 57)) + "..." : std::string(line);
      throw std::invalid_argument("record " + name + " is not valid: its line " + std::to_string(number) + " (`" + shown + "`): " + why +
                                  "; torch::load would compile it, and an archive inside a checkpoint may only declare "
                                  "classes of attributes, as torch::save of an optimizer's state does");
    }
  }
}

// Each pickle of the archive is read once: its claims are checked, then the archives torch::load
// unpickles ("data", "constants") are unpickled here with every storage sized by its record, and
// every object's tensors checked as the checkpoint's own are. The TorchScript classes of the
// objects (an optimizer's state is a scripted module) are stand-ins: only their states are looked at.
bool check_archive(const std::shared_ptr<caffe2::serialize::ReadAdapterInterface>& in, const StorageData& storage_data) {
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> reader;
  std::vector<std::string> records;
  try {
    reader = std::make_unique<caffe2::serialize::PyTorchStreamReader>(in);
    records = reader->getAllRecords();
  } catch (const std::exception&) {
    return false;
  }
  auto cu = std::make_shared<torch::jit::CompilationUnit>();
  const torch::jit::TypeResolver resolve = [&](const c10::QualifiedName& name) {
    return c10::StrongTypePtr(cu, c10::ClassType::create(name, cu));
  };
  const torch::jit::ObjLoader check_state = [](const at::StrongTypePtr& type, const c10::IValue& state) {
    support::check_loaded_value(state);
    return c10::ivalue::Object::create(type, 0);
  };
  for (const auto& name : records) {
    if (name.rfind("code/", 0) == 0 && name.ends_with(".py")) {
      check_source(*reader, name);
      continue;
    }
    if (name.ends_with(".debug_pkl")) {  // source ranges, unpickled when torch::load reports an error
      check_claims_of(*reader, name);
      continue;
    }
    if (!name.ends_with(".pkl")) continue;
    const std::string archive = name.substr(0, name.size() - 4);
    try {
      const auto pickle = reader->getRecord(name);  // no structured binding: clang < 16 cannot capture one
      const size_t size = std::get<1>(pickle);
      const auto* data = static_cast<const char*>(std::get<0>(pickle).get());
      support::check_pickle_claims(std::string_view(data, size));
      if (archive != "data" && archive != "constants") continue;  // torch::load reads no other
      auto storages = std::make_shared<torch::jit::DeserializationStorageContext>();
      const std::string prefix = archive + "/";
      for (const auto& record : records) {
        if (record.rfind(prefix, 0) != 0) continue;
        const uint64_t offset = reader->getRecordOffset(record), n = reader->getRecordSize(record);
        if (offset > in->size() || n > in->size() - offset)
          throw std::invalid_argument("its record " + record + " lies past the end of the archive");
        storages->addStorage(record.substr(prefix.size()),
                             c10::Storage(c10::Storage::use_byte_size_t(), n, storage_data(offset), nullptr, false));
      }
      size_t done = 0;
      torch::jit::Unpickler unpickler(
          [&](char* into, size_t want) -> size_t {
            want = std::min(want, size - done);
            std::memcpy(into, data + done, want);
            done += want;
            return want;
          },
          resolve, check_state,
          // Every storage the pickle names is in `storages`; one that is not has no record.
          [&](const std::string& key) -> c10::DataPtr {
            throw std::invalid_argument("it names storage " + key + ", which has no record " + prefix + key);
          },
          c10::Device(c10::kCPU), false, torch::jit::Unpickler::defaultTypeParser, storages);
      unpickler.set_version(reader->version());
      support::check_loaded_value(unpickler.parse_ivalue());
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument("record " + name + " is not valid: " + e.what());
    } catch (const std::exception& e) {
      throw std::invalid_argument("record " + name + " cannot be read (" + short_what(e) + ")");
    }
  }
  return true;
}

}  // namespace

bool check_nested_archive(std::string_view bytes) {
  // Storages point into `bytes`: nothing is copied, and nothing could read past a record.
  return check_archive(std::make_shared<BufferReader>(bytes.data(), bytes.size()), [&](uint64_t offset) {
    return c10::DataPtr(const_cast<char*>(bytes.data() + offset), c10::Device(c10::kCPU));
  });
}

bool check_nested_archive_in_file(int fd, uint64_t offset, uint64_t size) {
  // As read_checkpoint_skeleton's: storages without data (the unpickler reads none).
  return check_archive(std::make_shared<FileRangeReader>(fd, offset, size),
                       [](uint64_t) { return c10::DataPtr(nullptr, c10::Device(c10::kCPU)); });
}

}  // namespace ember::engine
