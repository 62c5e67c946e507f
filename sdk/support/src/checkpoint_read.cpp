#include <ember/support/checkpoint_read.h>

#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/StringUtil.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/unpickler.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace ember::support {

namespace {
constexpr size_t kMaxDepth = 256;  // Ember's own checkpoints nest fewer than 10 deep
}  // namespace

// LibTorch's unpickler builds each tensor as a view (offset, sizes, strides) of a storage
// without checking that the view fits it: a file whose checksums are right but whose pickle is
// wrong (a writer's bug, a crafted file) would read past the storage when the tensor is copied
// into the model. Every tensor is checked here against its storage (sized by its record, see
// load_checkpoint_bytes), and the nesting is bounded (other walks over the value, such as
// restore_types, recurse). Throws std::invalid_argument.
void check_loaded_value(const c10::IValue& root) {
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

namespace {

// `v` with every tensor replaced by a meta tensor of its shape and dtype (containers rebuilt; the
// nesting bounded, as check_loaded_value bounds it, since this walk recurses).
c10::IValue with_meta_tensors(const c10::IValue& v, size_t depth) {
  if (depth > kMaxDepth) throw std::invalid_argument("containers nested deeper than " + std::to_string(kMaxDepth));
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) return v;
    return at::empty(t.sizes(), at::TensorOptions().dtype(t.scalar_type()).device(at::kMeta));
  }
  if (v.isGenericDict()) {
    const auto d = v.toGenericDict();
    c10::impl::GenericDict out(d.keyType(), d.valueType());
    for (const auto& e : d) out.insert_or_assign(with_meta_tensors(e.key(), depth + 1), with_meta_tensors(e.value(), depth + 1));
    return out;
  }
  if (v.isList()) {
    const auto list = v.toList();
    c10::impl::GenericList out(list.elementType());
    out.reserve(list.size());
    for (size_t i = 0; i < list.size(); ++i) out.push_back(with_meta_tensors(list.get(i), depth + 1));
    return out;
  }
  if (v.isTuple()) {
    std::vector<c10::IValue> elements;
    for (const auto& e : v.toTupleRef().elements()) elements.push_back(with_meta_tensors(e, depth + 1));
    return c10::ivalue::Tuple::create(std::move(elements));
  }
  return v;
}

}  // namespace

c10::IValue read_checkpoint_skeleton(const std::string& file) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(file, ec)) throw std::runtime_error("cannot open " + file + ": no such file");
  try {
    caffe2::serialize::PyTorchStreamReader reader(file);
    // Not a structured binding: clang before 16 cannot capture one in the lambda below.
    const auto record = reader.getRecord("data.pkl");
    const size_t size = std::get<1>(record);
    const auto* data = static_cast<const char*>(std::get<0>(record).get());
    check_pickle_claims(std::string_view(data, size));
    size_t done = 0;
    torch::jit::Unpickler unpickler(
        [&](char* into, size_t n) -> size_t {
          n = std::min(n, size - done);
          std::memcpy(into, data + done, n);
          done += n;
          return n;
        },
        /*type_resolver=*/nullptr, /*obj_loader=*/nullptr,
        // Each tensor's storage: no bytes, whatever its record holds (or whether it is there). The
        // tensors become meta tensors below, before anything could read them.
        [](const std::string&) { return c10::DataPtr(nullptr, c10::Device(c10::kCPU)); },
        // On the CPU whatever the pickle says (a Python file's cuda tensors are not copied anywhere).
        /*device=*/c10::Device(c10::kCPU));
    unpickler.set_version(reader.version());
    return with_meta_tensors(unpickler.parse_ivalue(), 0);
  } catch (const std::exception& e) {
    std::string what = e.what();
    what.resize(std::min(what.find('\n'), what.size()));  // LibTorch appends a C++ stack
    // and miniz a paragraph of advice after its first sentence
    if (const auto end = what.find(". "); what.size() > 120 && end != std::string::npos) what.resize(end);
    throw std::runtime_error(file + " is not a readable checkpoint: " + what);
  }
}

}  // namespace ember::support
