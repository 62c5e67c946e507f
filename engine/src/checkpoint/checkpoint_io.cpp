// Checkpoint files: save and load in torch.save's layout with Ember's manifest (the archive and
// manifest: archive.*; the guards around the unpickler: <ember/support/checkpoint_read.h>; container types:
// container_types.*; atomic writes: atomic_file.*; checksums: crc32c.*; the torch::save archives
// inside a checkpoint: nested_archive.*).
#include "checkpoint/checkpoint_io.h"

#include <fcntl.h>   // open
#include <unistd.h>  // pread, close

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string_view>

#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/api/compilation_unit.h>
#include <torch/csrc/jit/serialization/import_read.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/csrc/jit/serialization/pickler_helper.h>
#include <torch/csrc/jit/serialization/storage_context.h>
#include <torch/csrc/jit/serialization/unpickler.h>

#include <ember/support/checkpoint_read.h>

#include "checkpoint/archive.h"
#include "checkpoint/container_types.h"
#include "checkpoint/nested_archive.h"

namespace fs = std::filesystem;

namespace ember::engine {

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
  std::string position;
  if (checkpoint.isGenericDict()) {
    const auto d = checkpoint.toGenericDict();
    if (d.contains("format_version") && d.at("format_version").isInt()) manifest.format_version = d.at("format_version").toInt();
    manifest.weights_only = d.contains("weights_only") && d.at("weights_only").isBool() && d.at("weights_only").toBool();
    if (d.contains("global_step") && d.at("global_step").isInt())
      position = "global_step " + std::to_string(d.at("global_step").toInt()) + "\nepoch " +
                 std::to_string(d.contains("epoch") && d.at("epoch").isInt() ? d.at("epoch").toInt() : 0) + "\n";
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
    if (!position.empty()) put(kPositionRecord, position.data(), position.size());
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
// The manifest of a file that has one, readable and of a format this engine knows, or throws.
Manifest read_manifest(caffe2::serialize::PyTorchStreamReader& reader, const std::string& where) {
  Manifest manifest;
  try {
    manifest = parse_manifest(read_record_text(reader, kManifestRecord));
  } catch (const std::exception& e) {
    throw std::runtime_error("checkpoint " + where + " is damaged: its manifest (" + std::string(kManifestRecord) +
                             ") is unreadable: " + short_what(e));
  }
  if (manifest.format_version > kCheckpointFormatVersion)
    throw std::runtime_error("checkpoint " + where + " has format version " + std::to_string(manifest.format_version) +
                             ", newer than this engine's " + std::to_string(kCheckpointFormatVersion) + " (upgrade the engine)");
  return manifest;
}

// Byte tensors that hold a torch::save archive (an optimizer's state, whole or in a sharded part
// or a pipeline stage's) are later read by torch::load, whose unpickler trusts its pickles as
// much as the checkpoint's own: their claims are checked here, once, for every strategy.
void check_archives_within(const c10::IValue& v, const std::string& path) {
  auto child = [&](const std::string& key) { return path.empty() ? key : path + "/" + key; };
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (t.scalar_type() != at::kByte || t.dim() != 1 || t.numel() < 4 || !t.device().is_cpu()) return;
    const at::Tensor c = t.contiguous();
    const std::string_view bytes(static_cast<const char*>(c.const_data_ptr()), static_cast<size_t>(c.numel()));
    if (bytes.substr(0, 4) != std::string_view("PK\x03\x04", 4)) return;  // not a zip archive
    try {
      check_nested_archive(bytes);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument("its entry '" + path + "' holds a torch::save archive whose " + e.what());
    }
  } else if (v.isGenericDict()) {
    for (const auto& e : v.toGenericDict())
      check_archives_within(e.value(), child(e.key().isString() ? e.key().toStringRef() : e.key().tagKind()));
  } else if (v.isList()) {
    const auto list = v.toList();
    for (size_t i = 0; i < list.size(); ++i) check_archives_within(list.get(i), child(std::to_string(i)));
  } else if (v.isTuple()) {
    const auto& items = v.toTupleRef().elements();
    for (size_t i = 0; i < items.size(); ++i) check_archives_within(items[i], child(std::to_string(i)));
  }
}

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
  if (has_manifest) verify_records(*reader, read_manifest(*reader, where), bytes, where);
  try {
    if (reader->hasRecord("data.pkl")) {
      const auto [pickle, pickle_size] = reader->getRecord("data.pkl");
      support::check_pickle_claims(std::string_view(static_cast<const char*>(pickle.get()), pickle_size));
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
    support::check_loaded_value(value);
    check_archives_within(value, "");
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

namespace {
// The global_step of the position record, when the file has one that its manifest vouches for.
std::optional<int64_t> read_position(caffe2::serialize::PyTorchStreamReader& reader, const Manifest& m) {
  const auto listed = std::find_if(m.records.begin(), m.records.end(), [](const ManifestEntry& r) { return r.name == kPositionRecord; });
  if (listed == m.records.end() || !reader.hasRecord(kPositionRecord)) return std::nullopt;
  const std::string text = read_record_text(reader, kPositionRecord);
  if (text.size() != listed->size || crc32c(text.data(), text.size()) != listed->crc) return std::nullopt;
  std::istringstream in(text);
  std::string word;
  int64_t step = -1;
  if (!(in >> word >> step) || word != "global_step" || step < 0) return std::nullopt;
  return step;
}
}  // namespace

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
        out.global_step = read_position(reader, m);
        return out;
      }
    }
    // Format 1 (no manifest): the whole file.
    const auto d = load_checkpoint_file(path);
    out.ember = true;
    out.weights_only = d.contains("weights_only") && d.at("weights_only").isBool() && d.at("weights_only").toBool();
    if (d.contains("global_step") && d.at("global_step").isInt()) out.global_step = d.at("global_step").toInt();
  } catch (const std::exception& e) {
    out.ember = false;
    out.why = short_what(e);
  }
  return out;
}

VerifiedCheckpoint verify_checkpoint_file(const fs::path& path) {
  const std::string where = path.string();
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) throw std::runtime_error("checkpoint " + where + " is missing or not a regular file");
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> reader;
  try {
    reader = std::make_unique<caffe2::serialize::PyTorchStreamReader>(where);
  } catch (const std::exception& e) {
    throw std::runtime_error("checkpoint " + where + " is corrupt or not a checkpoint (" + short_what(e) + ")");
  }
  bool has_manifest = false;
  try {
    has_manifest = reader->hasRecord(kManifestRecord);
  } catch (const std::exception& e) {
    throw std::runtime_error("checkpoint " + where + " is corrupt or not a checkpoint (" + short_what(e) + ")");
  }
  if (!has_manifest)
    throw std::runtime_error("checkpoint " + where + " has no checksums to check (" + std::string(kManifestRecord) +
                             " is missing: an Ember checkpoint of format 1, or a file another program wrote); "
                             "`engine validate --ckpt` shows whether it loads");
  const Manifest manifest = read_manifest(*reader, where);
  VerifiedCheckpoint out;
  // The records are read in chunks with pread: a 90 GB file is checked in a few MB of memory.
  const int fd = ::open(where.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error("cannot read checkpoint " + where + ": " + std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  std::vector<char> chunk(size_t{8} << 20);
  const RangeCrc crc_of = [&](uint64_t offset, uint64_t size) {
    uint32_t crc = 0;
    while (size > 0) {
      const ssize_t got = ::pread(fd, chunk.data(), std::min<uint64_t>(size, chunk.size()), static_cast<off_t>(offset));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0)
        throw std::runtime_error("cannot read checkpoint " + where + " at byte " + std::to_string(offset) + ": " +
                                 (got < 0 ? std::strerror(errno) : "the file ends early (it shrank while being read)"));
      crc = crc32c_extend(crc, chunk.data(), static_cast<size_t>(got));
      offset += static_cast<uint64_t>(got);
      size -= static_cast<uint64_t>(got);
    }
    return crc;
  };
  verify_records(*reader, manifest, fs::file_size(path, ec), crc_of, where);
  out.format_version = manifest.format_version;
  out.weights_only = manifest.weights_only;
  out.records = manifest.records.size();
  for (const auto& r : manifest.records) out.payload_bytes += r.size;
  // The checksums say the bytes are the ones written; the pickle must also read as a checkpoint
  // (its claims checked, its tensors as meta tensors: no tensor data).
  c10::IValue root;
  try {
    root = support::read_checkpoint_skeleton(where);
  } catch (const std::exception& e) {
    throw std::runtime_error(e.what());  // names the file and what is wrong
  }
  const bool tagged = root.isGenericDict() && root.toGenericDict().contains("format") &&
                      root.toGenericDict().at("format").isString() &&
                      root.toGenericDict().at("format").toStringRef() == kCheckpointFormat;
  if (!tagged) throw std::runtime_error("checkpoint " + where + " is not an Ember checkpoint (no format tag)");
  // The torch::save archives within (an optimizer's state) are read by torch::load on a resume:
  // their pickles are checked as a load checks them (check_archives_within), their tensor data
  // left unread. Any storage record that holds a zip archive is one.
  for (const auto& r : manifest.records) {
    if (r.name.rfind("data/", 0) != 0 || r.size < 4) continue;
    const uint64_t offset = reader->getRecordOffset(r.name);
    char head[4];
    if (::pread(fd, head, sizeof head, static_cast<off_t>(offset)) != 4 || std::memcmp(head, "PK\x03\x04", 4) != 0) continue;
    try {
      if (check_nested_archive_in_file(fd, offset, r.size)) ++out.archives;
    } catch (const std::invalid_argument& e) {
      throw std::runtime_error("checkpoint " + where + " is not a valid checkpoint: its record '" + r.name +
                               "' holds a torch::save archive whose " + e.what());
    }
  }
  out.skeleton = std::move(root);
  return out;
}

}  // namespace ember::engine
