#include "checkpoint_io.h"

#include <fcntl.h>
#include <nmmintrin.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstring>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string_view>

#include <boost/crc.hpp>
#include <ATen/EmptyTensor.h>
#include <c10/util/StringUtil.h>
#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>
#include <torch/csrc/jit/serialization/import_read.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/csrc/jit/serialization/pickler_helper.h>
#include <torch/csrc/jit/serialization/storage_context.h>
#include <torch/csrc/jit/serialization/unpickler.h>

namespace fs = std::filesystem;

namespace ember::engine {
namespace {
[[noreturn]] void fail(const fs::path& p, const std::string& what, int err) {
  throw std::runtime_error("cannot write checkpoint " + p.string() + ": " + what + " (" + std::strerror(err) + ")");
}

__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(const unsigned char* p, size_t n) {
  uint64_t c = 0xFFFFFFFFu;
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

std::string hex32(uint32_t v) {
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08" PRIx32, v);
  return buf;
}

// The whole file in memory, read with plain read(2) (no per-byte stream iterators).
struct FileBytes {
  std::unique_ptr<char[]> data;
  size_t size = 0;
};

FileBytes read_whole_file(const fs::path& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error("cannot read checkpoint " + path.string() + ": " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const int err = errno;
    ::close(fd);
    throw std::runtime_error("cannot read checkpoint " + path.string() + ": " + (err ? std::strerror(err) : "not a regular file"));
  }
  FileBytes out;
  out.size = static_cast<size_t>(st.st_size);
  out.data.reset(new char[std::max<size_t>(out.size, 1)]);
  size_t done = 0;
  while (done < out.size) {
    ssize_t n = ::read(fd, out.data.get() + done, out.size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : 0;
      ::close(fd);
      throw std::runtime_error("cannot read checkpoint " + path.string() + ": " +
                               (err ? std::strerror(err) : "the file shrank while it was read"));
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  return out;
}

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
std::string format_manifest(const Manifest& m) {
  std::ostringstream out;
  out << "ember-manifest 1\nformat_version " << m.format_version << "\nweights_only " << (m.weights_only ? 1 : 0) << "\n";
  for (const auto& r : m.records) out << "record " << hex32(r.crc) << " " << r.size << " " << r.name << "\n";
  std::string text = out.str();
  text += "end " + hex32(crc32c(text.data(), text.size())) + "\n";
  return text;
}

// Throws std::invalid_argument with what is wrong.
Manifest parse_manifest(const std::string& text) {
  // The last line checks the others.
  const size_t end = text.size() >= 14 ? text.rfind("\nend ", text.size() - 1) : std::string::npos;
  if (end == std::string::npos || text.size() != end + 1 + 4 + 8 + 1 || text.back() != '\n')
    throw std::invalid_argument("its last line is not 'end <checksum>'");
  const std::string body = text.substr(0, end + 1);
  if (text.compare(end + 5, 8, hex32(crc32c(body.data(), body.size()))) != 0)
    throw std::invalid_argument("its own checksum does not match");
  std::istringstream in(body);
  std::string line;
  if (!std::getline(in, line) || line != "ember-manifest 1") throw std::invalid_argument("its first line is not 'ember-manifest 1'");
  Manifest m;
  int line_no = 1;
  while (std::getline(in, line)) {
    ++line_no;
    std::istringstream ls(line);
    std::string word;
    ls >> word;
    bool ok = true;
    if (word == "format_version") {
      ok = static_cast<bool>(ls >> m.format_version);
    } else if (word == "weights_only") {
      int v = -1;
      ok = static_cast<bool>(ls >> v) && (v == 0 || v == 1);
      m.weights_only = v == 1;
    } else if (word == "record") {
      ManifestEntry e;
      std::string crc;
      ok = static_cast<bool>(ls >> crc >> e.size >> e.name) && crc.size() == 8 &&
           crc.find_first_not_of("0123456789abcdef") == std::string::npos;
      if (ok) e.crc = static_cast<uint32_t>(std::stoul(crc, nullptr, 16));
      m.records.push_back(std::move(e));
    } else {
      ok = false;
    }
    std::string rest;
    if (!ok || (ls >> rest)) throw std::invalid_argument("line " + std::to_string(line_no) + " is malformed");
  }
  if (m.format_version < 2 || m.records.empty()) throw std::invalid_argument("it lacks the format version or the records");
  return m;
}

// Payload records a checkpoint must have listed in its manifest.
bool is_payload_record(const std::string& name) {
  return name == "data.pkl" || name.rfind("data/", 0) == 0 || (name.rfind("ember/", 0) == 0 && name != kManifestRecord);
}

std::string read_record_text(caffe2::serialize::PyTorchStreamReader& reader, const std::string& name) {
  auto [ptr, size] = reader.getRecord(name);
  return std::string(static_cast<const char*>(ptr.get()), size);
}

// The first line of an error, and of a long one its first sentence (LibTorch's zip reader adds
// a paragraph of advice).
std::string short_what(const std::exception& e) {
  std::string what = e.what();
  if (auto nl = what.find('\n'); nl != std::string::npos) what.resize(nl);
  if (what.size() > 120)
    if (auto dot = what.find(". "); dot != std::string::npos) what.resize(dot);
  return what.substr(0, 200);
}

// Checks every payload record against the manifest's CRC32C and size, before anything is
// unpickled (a damaged pickle must not reach the unpickler). Throws with one line.
void verify_records(caffe2::serialize::PyTorchStreamReader& reader, const Manifest& m, std::string_view bytes,
                    const std::string& where) {
  auto damaged = [&](const std::string& what) -> std::runtime_error {
    return std::runtime_error("checkpoint " + where + " is damaged: " + what +
                              "; it changed after it was written (disk, copy or transfer error): use another checkpoint");
  };
  // The zip reader's own errors (a damaged local header, an unknown compression method) are
  // damage too, said in one line naming the file.
  try {
    std::vector<std::string> listed;
    for (const auto& r : m.records) {
      if (!reader.hasRecord(r.name)) throw damaged("record '" + r.name + "' named in the manifest is missing");
      const size_t size = reader.getRecordSize(r.name);
      if (size != r.size)
        throw damaged("record '" + r.name + "' has " + std::to_string(size) + " bytes, the manifest says " + std::to_string(r.size));
      const size_t offset = reader.getRecordOffset(r.name);
      if (offset > bytes.size() || size > bytes.size() - offset) throw damaged("record '" + r.name + "' lies past the end of the file");
      const uint32_t now = crc32c(bytes.data() + offset, size);
      if (now != r.crc)
        throw damaged("record '" + r.name + "' (" + std::to_string(size) + " bytes) fails its CRC32C check (stored " + hex32(r.crc) +
                      ", computed " + hex32(now) + ")");
      listed.push_back(r.name);
    }
    for (const auto& name : reader.getAllRecords())
      if (is_payload_record(name) && std::find(listed.begin(), listed.end(), name) == listed.end())
        throw damaged("record '" + name + "' is not in the manifest");
  } catch (const c10::Error& e) {
    throw damaged("its archive cannot be read (" + short_what(e) + ")");
  }
}

// LibTorch's unpickler builds each tensor as a view (offset, sizes, strides) of a storage
// without checking that the view fits it: a file whose checksums are right but whose pickle is
// wrong (a writer's bug, a crafted file) would read past the storage when the tensor is copied
// into the model. Every tensor is checked here against its storage (sized by its record, see
// load_checkpoint_bytes), and the nesting is bounded (other walks over the value, such as
// restore_types, recurse). Throws std::invalid_argument.
void check_loaded_value(const c10::IValue& root) {
  constexpr size_t kMaxDepth = 256;  // Ember's own checkpoints nest fewer than 10 deep
  std::vector<std::pair<c10::IValue, size_t>> todo{{root, 0}};  // copies: reference counts only
  size_t tensors = 0;
  while (!todo.empty()) {
    const auto [v, depth] = std::move(todo.back());
    todo.pop_back();
    if (depth > kMaxDepth) throw std::invalid_argument("containers nested deeper than " + std::to_string(kMaxDepth));
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      const std::string which = "tensor " + std::to_string(++tensors);
      if (!t.defined() || t.numel() == 0) continue;
      if (t.layout() != at::kStrided || !t.device().is_cpu()) throw std::invalid_argument(which + " is not a dense CPU tensor");
      if (t.storage_offset() < 0) throw std::invalid_argument(which + " has a negative offset");
      for (const int64_t st : t.strides())
        if (st < 0) throw std::invalid_argument(which + " has a negative stride");
      size_t needed = 0;
      try {
        needed = at::detail::computeStorageNbytes(t.sizes(), t.strides(), t.dtype().itemsize(), static_cast<size_t>(t.storage_offset()));
      } catch (const c10::Error&) {
        throw std::invalid_argument(which + " has a size that overflows");
      }
      const size_t have = t.storage() ? t.storage().nbytes() : 0;
      if (needed > have)
        throw std::invalid_argument(which + " (sizes " + c10::str(t.sizes()) + ", offset " + std::to_string(t.storage_offset()) +
                                    ") does not fit its storage of " + std::to_string(have) + " bytes");
    } else if (v.isGenericDict()) {
      for (const auto& e : v.toGenericDict()) {
        todo.emplace_back(e.key(), depth + 1);
        todo.emplace_back(e.value(), depth + 1);
      }
    } else if (v.isList()) {
      const auto list = v.toList();
      for (size_t i = 0; i < list.size(); ++i) todo.emplace_back(list.get(i), depth + 1);
    } else if (v.isTuple()) {
      for (const auto& e : v.toTupleRef().elements()) todo.emplace_back(e, depth + 1);
    }
  }
}

// Untagged pickles (what torch.load accepts without allow-listing) lose the static types of
// dicts and lists (Dict[str, Tensor], List[float], ...), which C++ readers rely on (toTensorList,
// toTypedDict). The writer records them in `ember/types`, one TorchScript annotation per line, in
// the order `for_each_container` visits the containers; the reader puts them back.
template <typename F>
void for_each_container(const c10::IValue& v, const F& f) {
  if (v.isGenericDict()) {
    f(v);
    for (const auto& e : v.toGenericDict()) {
      for_each_container(e.key(), f);
      for_each_container(e.value(), f);
    }
  } else if (v.isList()) {
    f(v);
    const auto list = v.toList();
    for (size_t i = 0; i < list.size(); ++i) for_each_container(list.get(i), f);
  } else if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements()) for_each_container(e, f);
  }
}

std::string container_type(const c10::IValue& v) {
  if (v.isGenericDict()) {
    const auto d = v.toGenericDict();
    return c10::DictType::create(d.keyType(), d.valueType())->annotation_str();
  }
  return c10::ListType::create(v.toList().elementType())->annotation_str();
}

// `v` with every list as a plain List[Any]: LibTorch's pickler writes List[int], List[float],
// List[bool] and List[Tensor] through torch.jit._pickle helpers that torch.load refuses.
c10::IValue plain(const c10::IValue& v) {
  if (v.isGenericDict()) {
    const auto d = v.toGenericDict();
    c10::impl::GenericDict out(d.keyType(), d.valueType());
    out.reserve(d.size());
    for (const auto& e : d) out.insert_or_assign(plain(e.key()), plain(e.value()));
    return out;
  }
  if (v.isList()) {
    const auto list = v.toList();
    c10::impl::GenericList out(c10::AnyType::get());
    out.reserve(list.size());
    for (size_t i = 0; i < list.size(); ++i) out.push_back(plain(list.get(i)));
    return out;
  }
  if (v.isTuple()) {
    std::vector<c10::IValue> elements;
    for (const auto& e : v.toTupleRef().elements()) elements.push_back(plain(e));
    return c10::ivalue::Tuple::create(std::move(elements));
  }
  return v;
}

// The inverse: every dict and list of `v` rebuilt with its recorded type. Throws
// std::invalid_argument when the record does not fit the pickle.
struct Retyper {
  std::vector<c10::TypePtr> types;
  size_t next = 0;

  c10::TypePtr take() {
    if (next >= types.size()) throw std::invalid_argument("more containers than recorded types");
    return types[next++];
  }
  c10::IValue operator()(const c10::IValue& v) {
    if (v.isGenericDict()) {
      const auto t = take()->cast<c10::DictType>();
      if (!t) throw std::invalid_argument("a dict's recorded type is not a Dict");
      c10::impl::GenericDict out(t->getKeyType(), t->getValueType());
      const auto d = v.toGenericDict();
      out.reserve(d.size());
      for (const auto& e : d) {
        auto key = (*this)(e.key());
        out.insert_or_assign(std::move(key), (*this)(e.value()));
      }
      return out;
    }
    if (v.isList()) {
      const auto t = take()->cast<c10::ListType>();
      if (!t) throw std::invalid_argument("a list's recorded type is not a List");
      c10::impl::GenericList out(t->getElementType());
      const auto list = v.toList();
      out.reserve(list.size());
      for (size_t i = 0; i < list.size(); ++i) out.push_back((*this)(list.get(i)));
      return out;
    }
    if (v.isTuple()) {
      std::vector<c10::IValue> elements;
      for (const auto& e : v.toTupleRef().elements()) elements.push_back((*this)(e));
      return c10::ivalue::Tuple::create(std::move(elements));
    }
    return v;
  }
};

c10::IValue restore_types(const c10::IValue& v, const std::string& record) {
  Retyper r;
  std::map<std::string, c10::TypePtr> parsed;
  std::istringstream in(record);
  for (std::string line; std::getline(in, line);) {
    auto it = parsed.find(line);
    if (it == parsed.end()) it = parsed.emplace(line, torch::jit::Unpickler::defaultTypeParser(line)).first;
    r.types.push_back(it->second);
  }
  auto out = r(v);
  if (r.next != r.types.size()) throw std::invalid_argument("fewer containers than recorded types");
  return out;
}



// LibTorch's unpickler trusts the sizes a pickle states: a LONG_BINPUT memo index makes it reserve
// room for twice that many values, a string's 4-byte length is allocated before it is read. A
// crafted or damaged data.pkl (with its checksums made right) could so ask for tens of gigabytes
// (found by the fuzz test under AddressSanitizer: a 25.6 GB reserve). This walk over the opcodes
// LibTorch's pickler writes checks those claims against the pickle's own size first; at an
// opcode it does not know it stops and leaves the rest to the unpickler. Throws
// std::invalid_argument.
void check_pickle_claims(std::string_view pickle) {
  size_t at = 0;
  auto need = [&](size_t n, const char* what) {
    if (n > pickle.size() - at)
      throw std::invalid_argument("its pickle's " + std::string(what) + " at byte " + std::to_string(at) + " claims " +
                                  std::to_string(n) + " bytes, " + std::to_string(pickle.size() - at) + " remain");
  };
  auto uint_le = [&](size_t n) {
    need(n, "field");
    uint64_t v = 0;
    for (size_t k = 0; k < n; ++k) v |= static_cast<uint64_t>(static_cast<unsigned char>(pickle[at + k])) << (8 * k);
    at += n;
    return v;
  };
  while (at < pickle.size()) {
    const auto op = static_cast<unsigned char>(pickle[at++]);
    switch (op) {
      case '.': return;  // STOP
      // Every opcode of pickle protocols 0-5 is walked, so that the walk never stops where the
      // unpickler goes on (it did at LIST/DICT, and a fuzzed file's LONG_BINPUT after them claimed
      // a 31 GB memo); a byte that is no opcode at all is the unpickler's error to report.
      case '(': case ')': case ']': case '}': case 'N': case 0x88: case 0x89: case 'e': case 'a': case 't': case 0x85:
      case 0x86: case 0x87: case 's': case 'u': case 'R': case 'b': case 0x81: case 'Q': case '0': case 0x94:
      case 'l': case 'd': case '1': case '2': case 'o': case 0x8f: case 0x90: case 0x91: case 0x92: case 0x93: case 0x97: case 0x98:
        break;
      case 'I': case 'F': case 'L': case 'S': case 'V': case 'P': case 'g': case 'p': case 'i': {  // text operands, a line each
        for (int line = op == 'i' ? 2 : 1; line > 0; --line) {
          const auto nl = pickle.find('\n', at);
          if (nl == std::string_view::npos) throw std::invalid_argument("its pickle ends inside a text operand");
          at = nl + 1;
        }
        break;
      }
      case 0x82: uint_le(1); break;  // EXT1
      case 0x83: uint_le(2); break;  // EXT2
      case 0x84: uint_le(4); break;  // EXT4
      case 0x80: case 'K': case 'q': case 'h': uint_le(1); break;  // PROTO, BININT1, BINPUT, BINGET
      case 'M': uint_le(2); break;                                 // BININT2
      case 'J': uint_le(4); break;                                 // BININT
      case 'G': uint_le(8); break;                                 // BINFLOAT
      case 'r': case 'j': {                                        // LONG_BINPUT, LONG_BINGET
        const uint64_t id = uint_le(4);
        // Memo indices count up from 0, one per BINPUT of at least 2 bytes.
        if (id > pickle.size())
          throw std::invalid_argument("its pickle's memo index " + std::to_string(id) + " at byte " + std::to_string(at - 5) +
                                      " is out of range for a " + std::to_string(pickle.size()) + "-byte pickle");
        break;
      }
      case 0x8a: case 'U': case 'C': case 0x8c: {  // LONG1, SHORT_BINSTRING, SHORT_BINBYTES, SHORT_BINUNICODE
        const uint64_t n = uint_le(1);
        need(n, "string");
        at += n;
        break;
      }
      case 0x8b: case 'X': case 'T': case 'B': {  // LONG4, BINUNICODE, BINSTRING, BINBYTES
        const uint64_t n = uint_le(4);
        need(n, "string");
        at += n;
        break;
      }
      // Protocol 4's 8-byte lengths: LibTorch's unpickler reads BINUNICODE8 / BINBYTES8 /
      // BYTEARRAY8 into a string of the claimed size (a fuzzed file claimed 2^58 bytes).
      case 0x8d: case 0x8e: case 0x96: {
        const uint64_t n = uint_le(8);
        need(n, "string");
        at += n;
        break;
      }
      case 0x95: uint_le(8); break;  // FRAME: a length hint, no data of its own
      case 'c':  // GLOBAL module\nname\n
        for (int line = 0; line < 2; ++line) {
          const auto nl = pickle.find('\n', at);
          if (nl == std::string_view::npos) throw std::invalid_argument("its pickle ends inside a GLOBAL name");
          at = nl + 1;
        }
        break;
      default: return;  // no pickle opcode: the unpickler refuses it
    }
  }
}

}  // namespace

uint32_t crc32c_portable(const void* data, size_t size) {
  boost::crc_optimal<32, 0x1EDC6F41, 0xFFFFFFFF, 0xFFFFFFFF, true, true> crc;
  crc.process_bytes(data, size);
  return crc.checksum();
}

uint32_t crc32c(const void* data, size_t size) {
  static const bool has_sse42 = __builtin_cpu_supports("sse4.2");
  if (size == 0) return 0;
  return has_sse42 ? crc32c_sse42(static_cast<const unsigned char*>(data), size) : crc32c_portable(data, size);
}

void atomic_write(const fs::path& path, const std::function<void(const ByteSink&)>& fill) {
  fs::path dir = path.parent_path().empty() ? fs::path(".") : path.parent_path();
  std::error_code ec;
  fs::create_directories(dir, ec);
  std::string tmp_name = ".";  // (built step by step: GCC 12 warns falsely on "lit" + string&&)
  tmp_name += path.filename().string();
  tmp_name += ".tmp.";
  tmp_name += std::to_string(getpid());
  fs::path tmp = dir / tmp_name;
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(path, "cannot create " + tmp.string(), errno);
  // The sink never throws (it may be called from inside LibTorch's zip writer, whose destructor
  // would otherwise throw during unwinding): it keeps the first error and drops the rest.
  int write_error = 0;
  const ByteSink sink = [&](const char* data, size_t size) {
    size_t written = 0;
    while (write_error == 0 && written < size) {
      ssize_t n = ::write(fd, data + written, size - written);
      if (n < 0) {
        if (errno == EINTR) continue;
        write_error = errno;
        break;
      }
      written += static_cast<size_t>(n);
    }
  };
  try {
    fill(sink);
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (write_error != 0) {
    ::close(fd);
    ::unlink(tmp.c_str());
    fail(path, "write failed", write_error);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail(path, "fsync failed", err);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail(path, "rename failed", err);
  }
  // Make the rename itself durable.
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

void atomic_write(const fs::path& path, const char* data, size_t size) {
  atomic_write(path, [&](const ByteSink& sink) { sink(data, size); });
}

void save_checkpoint_file(const fs::path& path, const c10::IValue& checkpoint) {
  // torch.save's layout, as torch::jit::pickle_save writes it, but with untagged containers (no
  // torch.jit._pickle globals, so torch.load's weights_only unpickler takes it as it is), plus
  // the container types and the manifest.
  std::string types;
  for_each_container(checkpoint, [&](const c10::IValue& c) { types += container_type(c) + "\n"; });
  std::vector<char> pickle;
  torch::jit::Pickler pickler([&](const char* p, size_t n) { pickle.insert(pickle.end(), p, p + n); }, nullptr, nullptr,
                              nullptr, nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(plain(checkpoint));
  pickler.stop();

  Manifest manifest;
  manifest.format_version = kCheckpointFormatVersion;
  if (checkpoint.isGenericDict()) {
    const auto d = checkpoint.toGenericDict();
    if (d.contains("format_version") && d.at("format_version").isInt()) manifest.format_version = d.at("format_version").toInt();
    manifest.weights_only = d.contains("weights_only") && d.at("weights_only").isBool() && d.at("weights_only").toBool();
  }
  atomic_write(path, [&](const ByteSink& sink) {
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t n) -> size_t {
      sink(static_cast<const char*>(data), n);
      return n;
    });
    auto put = [&](const std::string& name, const void* data, size_t size) {
      writer.writeRecord(name, data, size);
      manifest.records.push_back({crc32c(data, size), size, name});
    };
    const auto& tensors = pickler.tensorData();
    for (size_t i = 0; i < tensors.size(); ++i) {
      const auto td = torch::jit::getWriteableTensorData(tensors[i]);
      put("data/" + std::to_string(i), td.data(), td.sizeInBytes());
    }
    put("data.pkl", pickle.data(), pickle.size());
    put(kTypesRecord, types.data(), types.size());
    const std::string text = format_manifest(manifest);
    writer.writeRecord(kManifestRecord, text.data(), text.size());
    writer.writeEndOfFile();
  });
}

namespace {
c10::impl::GenericDict load_checkpoint(const char* data, size_t size, const std::string& where,
                                       const std::shared_ptr<const char>& owner);
}  // namespace

c10::impl::GenericDict load_checkpoint_file(const fs::path& path) {
  auto bytes = std::make_shared<FileBytes>(read_whole_file(path));
  // The loaded tensors share the file's bytes (see load_checkpoint): one copy of the file in memory.
  return load_checkpoint(bytes->data.get(), bytes->size, path.string(), std::shared_ptr<const char>(bytes, bytes->data.get()));
}

c10::impl::GenericDict load_checkpoint_bytes(const char* data, size_t size, const std::string& where) {
  return load_checkpoint(data, size, where, nullptr);
}

namespace {
// `owner`, when given, keeps `data` alive: tensors of a file whose manifest has been verified then
// use the file's bytes where they lie instead of a copy (every such record was checked at its
// offset, so it is stored uncompressed), which halves the memory a load takes (a 7B-parameter
// model's checkpoint would otherwise sit in memory twice while it loads). Without it, or for a
// file without a manifest, each record is copied.
c10::impl::GenericDict load_checkpoint(const char* data, size_t size, const std::string& where,
                                       const std::shared_ptr<const char>& owner) {
  const std::string_view bytes(data, size);
  auto not_a_checkpoint = [&](const std::exception& e) {
    return std::runtime_error("checkpoint " + where + " is corrupt or not a checkpoint (" + short_what(e) + ")");
  };
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> reader;
  try {
    reader = std::make_unique<caffe2::serialize::PyTorchStreamReader>(std::make_shared<BufferReader>(data, size));
  } catch (const std::exception& e) {
    throw not_a_checkpoint(e);
  }
  bool has_manifest = false;
  try {
    has_manifest = reader->hasRecord(kManifestRecord);
  } catch (const std::exception& e) {
    throw not_a_checkpoint(e);
  }
  if (has_manifest) {
    Manifest manifest;
    try {
      manifest = parse_manifest(read_record_text(*reader, kManifestRecord));
    } catch (const std::exception& e) {
      throw std::runtime_error("checkpoint " + where + " is damaged: its manifest (" + std::string(kManifestRecord) +
                               ") is unreadable: " + short_what(e));
    }
    if (manifest.format_version > kCheckpointFormatVersion)
      throw std::runtime_error("checkpoint " + where + " has format version " + std::to_string(manifest.format_version) +
                               ", newer than this engine's " + std::to_string(kCheckpointFormatVersion) + " (upgrade the engine)");
    verify_records(*reader, manifest, bytes, where);
  }
  try {
    if (reader->hasRecord("data.pkl")) {
      const auto [pickle, pickle_size] = reader->getRecord("data.pkl");
      check_pickle_claims(std::string_view(static_cast<const char*>(pickle.get()), pickle_size));
    }
  } catch (const std::invalid_argument& e) {
    throw std::runtime_error("checkpoint " + where + " is not a valid checkpoint: " + e.what());
  } catch (const std::exception& e) {
    throw not_a_checkpoint(e);
  }
  c10::IValue value;
  try {
    // Every storage record is handed to the unpickler with its real size: left to itself, it
    // sizes a storage by the element count the pickle claims, whatever the record holds.
    auto storages = std::make_shared<torch::jit::DeserializationStorageContext>();
    for (const auto& name : reader->getAllRecords()) {
      if (name.rfind("data/", 0) != 0) continue;
      if (owner != nullptr && has_manifest) {
        const size_t offset = reader->getRecordOffset(name), n = reader->getRecordSize(name);
        auto* keep = new std::shared_ptr<const char>(owner);
        c10::DataPtr shared(const_cast<char*>(data + offset), keep,
                            [](void* k) { delete static_cast<std::shared_ptr<const char>*>(k); }, c10::Device(c10::kCPU));
        storages->addStorage(name.substr(5), c10::Storage(c10::Storage::use_byte_size_t(), n, std::move(shared), nullptr, false));
        continue;
      }
      auto [ptr, size] = reader->getRecord(name);
      storages->addStorage(name.substr(5), c10::Storage(c10::Storage::use_byte_size_t(), size, std::move(ptr), nullptr, false));
    }
    value = torch::jit::readArchiveAndTensors("data", /*pickle_prefix=*/"", /*tensor_prefix=*/"", std::nullopt, std::nullopt,
                                              std::nullopt, *reader, torch::jit::Unpickler::defaultTypeParser, storages);
  } catch (const std::exception& e) {
    throw not_a_checkpoint(e);
  }
  try {
    check_loaded_value(value);
  } catch (const std::invalid_argument& e) {
    throw std::runtime_error("checkpoint " + where + " is not a valid checkpoint: " + e.what());
  }
  if (has_manifest) {
    try {
      if (reader->hasRecord(kTypesRecord)) value = restore_types(value, read_record_text(*reader, kTypesRecord));
    } catch (const std::exception& e) {
      throw std::runtime_error("checkpoint " + where + " is not a valid checkpoint: its " + std::string(kTypesRecord) +
                               " record does not fit its contents (" + short_what(e) + ")");
    }
  }
  if (!value.isGenericDict()) throw std::runtime_error("checkpoint " + where + " is not an Ember checkpoint");
  auto dict = value.toGenericDict();
  if (!dict.contains("format") || !dict.at("format").isString() || dict.at("format").toStringRef() != kCheckpointFormat)
    throw std::runtime_error("checkpoint " + where + " is not an Ember checkpoint (no format tag)");
  int64_t version = dict.contains("format_version") && dict.at("format_version").isInt() ? dict.at("format_version").toInt() : -1;
  if (version > kCheckpointFormatVersion)
    throw std::runtime_error("checkpoint " + where + " has format version " + std::to_string(version) +
                             ", newer than this engine's " + std::to_string(kCheckpointFormatVersion) + " (upgrade the engine)");
  // Format 2 and later always carry the manifest: without it, its checksums cannot be checked.
  if (version >= 2 && !has_manifest)
    throw std::runtime_error("checkpoint " + where + " is damaged: it lacks its manifest (" + std::string(kManifestRecord) +
                             "), so its checksums cannot be verified: use another checkpoint");
  return dict;
}
}  // namespace

std::string reseal_checkpoint_bytes(std::string_view bytes) {
  caffe2::serialize::PyTorchStreamReader reader(std::make_shared<BufferReader>(bytes.data(), bytes.size()));
  Manifest manifest;
  manifest.format_version = kCheckpointFormatVersion;
  if (reader.hasRecord(kManifestRecord)) {
    try {
      const Manifest old = parse_manifest(read_record_text(reader, kManifestRecord));
      manifest.format_version = old.format_version;
      manifest.weights_only = old.weights_only;
    } catch (const std::invalid_argument&) {
    }
  }
  std::string out;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t n) -> size_t {
    out.append(static_cast<const char*>(data), n);
    return n;
  });
  for (const auto& name : reader.getAllRecords()) {
    if (name == kManifestRecord || !is_payload_record(name)) continue;  // the writer adds its own version records
    auto [ptr, size] = reader.getRecord(name);
    writer.writeRecord(name, ptr.get(), size);
    manifest.records.push_back({crc32c(ptr.get(), size), size, name});
  }
  const std::string text = format_manifest(manifest);
  writer.writeRecord(kManifestRecord, text.data(), text.size());
  writer.writeEndOfFile();
  return out;
}

CheckpointProbe probe_checkpoint_file(const fs::path& path) {
  CheckpointProbe out;
  try {
    std::error_code ec;
    if (!fs::is_regular_file(path, ec)) {
      out.why = "not a regular file";
      return out;
    }
    {
      caffe2::serialize::PyTorchStreamReader reader(path.string());
      if (reader.hasRecord(kManifestRecord)) {
        const Manifest m = parse_manifest(read_record_text(reader, kManifestRecord));
        if (m.format_version > kCheckpointFormatVersion) {
          out.why = "format version " + std::to_string(m.format_version) + " is newer than this engine's";
          return out;
        }
        out.ember = true;
        out.weights_only = m.weights_only;
        return out;
      }
    }
    // Format 1 (no manifest): the whole file.
    const auto d = load_checkpoint_file(path);
    out.ember = true;
    out.weights_only = d.contains("weights_only") && d.at("weights_only").isBool() && d.at("weights_only").toBool();
  } catch (const std::exception& e) {
    out.ember = false;
    out.why = short_what(e);
  }
  return out;
}

}  // namespace ember::engine
