#include "fuzz_inputs.h"

#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>
#include <torch/serialize/input-archive.h>

#include <cstring>
#include <memory>

#include "checkpoint/checkpoint_io.h"
#include "config/run_config.h"
#include "config/engine_schema.h"
#include "registry/plugin_registry.h"

namespace ember::fuzz {
namespace {

using ember::ConfigError;
using engine::KeySchema;
using engine::RawConfig;
using engine::ResolvedConfig;
using engine::SectionSchema;
using engine::UsageError;

void one_line(const char* kind, const std::string& what) {
  if (what.empty()) throw Finding(std::string(kind) + " with an empty message");
  if (what.find('\n') != std::string::npos) throw Finding(std::string(kind) + " spans several lines: " + what);
}

// The sections a run can have: the engine's, model/data with the keys of the bundled mlp and
// synthetic plugins, and one per strategy, precision, callback and logger plugin found.
struct ConfigWorld {
  std::vector<SectionSchema> schemas;
  std::vector<std::string> printed;  // callbacks and loggers, as `plugins = [...]` prints them
};

const ConfigWorld& config_world() {
  static const ConfigWorld world = [] {
    ConfigWorld w;
    engine::PluginRegistry registry(engine::PluginRegistry::default_search_paths({}));
    std::vector<const engine::PluginInfo*> plugins = registry.load_all([](const std::string&) {});
    auto keys_of = [&](const std::string& name) {
      for (const auto* p : plugins)
        if (p->name == name) return engine::keys_from_descriptor(p->descriptor->config_keys, p->descriptor->num_config_keys);
      return std::vector<KeySchema>{};
    };
    auto with_base = [&](const char* section, std::vector<KeySchema> keys, const std::string& plugin) {
      SectionSchema s;
      s.name = section;
      s.keys = std::move(keys);
      for (auto& k : keys_of(plugin))
        if (!s.find(k.key)) s.keys.push_back(std::move(k));
      return s;
    };
    w.schemas.push_back(engine::trainer_schema());
    w.schemas.push_back(with_base("model", engine::model_base_keys(), "mlp"));
    w.schemas.push_back(with_base("data", engine::data_base_keys(), "synthetic"));
    w.schemas.push_back(engine::optimizer_schema());
    for (const auto* p : plugins) {
      const uint32_t kind = p->descriptor->kind;
      if (kind == EMBER_KIND_MODEL || kind == EMBER_KIND_DATA) continue;
      SectionSchema s;
      s.name = p->name;
      s.keys = engine::keys_from_descriptor(p->descriptor->config_keys, p->descriptor->num_config_keys);
      w.schemas.push_back(std::move(s));
      if (kind == EMBER_KIND_CALLBACK || kind == EMBER_KIND_LOGGER) w.printed.push_back(p->name);
    }
    return w;
  }();
  return world;
}

// Every set value read back the way a plugin reads it; a validated value must be readable.
void read_back(const ResolvedConfig& rc, const std::vector<SectionSchema>& schemas) {
  for (const auto& schema : schemas) {
    const auto& section = rc.section(schema.name);
    for (const auto& k : schema.keys) {
      if (!section.has(k.key)) continue;
      try {
        switch (k.type) {
          case EMBER_TYPE_BOOL: section.get_bool(k.key); break;
          case EMBER_TYPE_INT: section.get_int(k.key); break;
          case EMBER_TYPE_FLOAT: section.get_float(k.key); break;
          case EMBER_TYPE_NUMBER:
            section.get_float(k.key);
            // Plugins read a count as an integer when it is one; an integral float of any size
            // must give a clean error, never an out-of-range cast.
            try {
              section.get_int(k.key);
            } catch (const ConfigError& e) {
              one_line("ConfigError", e.what());
            }
            break;
          case EMBER_TYPE_STRING: section.get_string(k.key); break;
          case EMBER_TYPE_INT_LIST: section.get_int_list(k.key); break;
          case EMBER_TYPE_FLOAT_LIST: section.get_float_list(k.key); break;
          case EMBER_TYPE_STRING_LIST: section.get_string_list(k.key); break;
        }
        section.where(k.key);
      } catch (const ConfigError& e) {
        throw Finding(schema.name + "." + k.key + " passed validation but cannot be read: " + e.what());
      }
    }
  }
}

}  // namespace

bool config_one(std::string_view input, std::string* error) {
  const ConfigWorld& world = config_world();
  std::string_view text = input;
  std::vector<std::string> sets;
  if (auto sep = input.find("\n%%\n"); sep != std::string_view::npos) {
    text = input.substr(0, sep + 1);
    std::string_view rest = input.substr(sep + 4);
    while (!rest.empty()) {
      const auto nl = rest.find('\n');
      sets.emplace_back(rest.substr(0, nl));
      rest = nl == std::string_view::npos ? std::string_view() : rest.substr(nl + 1);
    }
  }
  std::string printed;
  try {
    RawConfig raw = RawConfig::parse(text, "fuzz.toml");
    for (const auto& s : sets) raw.add_override(s);
    raw.integer_as_string("trainer", "precision");
    raw.plugin_list();
    raw.peek_string("trainer", "strategy");
    const ResolvedConfig rc = ResolvedConfig::resolve(raw, world.schemas, world.printed);
    read_back(rc, world.schemas);
    printed = rc.to_toml();
  } catch (const UsageError& e) {
    one_line("UsageError", e.what());
    if (error) *error = e.what();
    return false;
  } catch (const ConfigError& e) {
    one_line("ConfigError", e.what());
    if (error) *error = e.what();
    return false;
  } catch (const Finding&) {
    throw;
  } catch (const std::exception& e) {
    throw Finding(std::string("unexpected exception: ") + e.what());
  }
  // What `engine config` prints and checkpoints store must resolve to the same configuration.
  try {
    const ResolvedConfig again = ResolvedConfig::resolve(RawConfig::parse(printed, "resolved.toml"), world.schemas, world.printed);
    if (again.to_toml() != printed) throw Finding("the resolved config printed as TOML resolves differently:\n" + printed + "\n---\n" + again.to_toml());
  } catch (const Finding&) {
    throw;
  } catch (const std::exception& e) {
    throw Finding(std::string("the resolved config printed as TOML is refused: ") + e.what() + "\n" + printed);
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
namespace {

class BufferReader final : public caffe2::serialize::ReadAdapterInterface {
 public:
  explicit BufferReader(std::string_view bytes) : bytes_(bytes) {}
  size_t size() const override { return bytes_.size(); }
  size_t read(uint64_t pos, void* buf, size_t n, const char*) const override {
    if (pos >= bytes_.size()) return 0;
    n = std::min<size_t>(n, bytes_.size() - static_cast<size_t>(pos));
    std::memcpy(buf, bytes_.data() + pos, n);
    return n;
  }

 private:
  std::string_view bytes_;
};

bool payload_name(const std::string& n) {
  if (n == "data.pkl" || n == engine::kTypesRecord) return true;
  if (n.rfind("data/", 0) != 0 || n.size() == 5 || n.size() > 12) return false;
  return n.find_first_not_of("0123456789", 5) == std::string::npos;
}

// Reads every tensor's memory (a tensor whose view does not fit its storage would be caught by
// ASan here), without recursing deeper than any checkpoint Ember writes.
void touch(const c10::IValue& v, int depth) {
  if (depth > 64) return;
  if (v.isTensor()) {
    try {
      const at::Tensor t = v.toTensor().clone();
      // A torch::save archive the reader let through (an optimizer's state): read it as the
      // strategies do, with torch::load's InputArchive, which compiles its code and unpickles it.
      if (t.scalar_type() == at::kByte && t.dim() == 1 && t.numel() >= 4 &&
          std::memcmp(t.const_data_ptr(), "PK\x03\x04", 4) == 0) {
        torch::serialize::InputArchive archive;
        archive.load_from(static_cast<const char*>(t.const_data_ptr()), static_cast<size_t>(t.numel()));
      }
    } catch (const std::exception&) {  // a clean error is what a strategy reports
    }
  } else if (v.isGenericDict()) {
    for (const auto& e : v.toGenericDict()) {
      touch(e.key(), depth + 1);
      touch(e.value(), depth + 1);
    }
  } else if (v.isList()) {
    const auto l = v.toList();
    for (size_t i = 0; i < l.size(); ++i) touch(l.get(i), depth + 1);
  } else if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements()) touch(e, depth + 1);
  }
}

}  // namespace

std::string encode_records(const std::vector<Record>& records) {
  std::string out;
  for (const auto& r : records) {
    out += r.name;
    out.push_back('\0');
    const auto n = static_cast<uint32_t>(r.data.size());
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xFF));
    out += r.data;
  }
  return out;
}

std::vector<Record> decode_records(std::string_view bytes) {
  std::vector<Record> out;
  while (!bytes.empty()) {
    const auto nul = bytes.find('\0');
    if (nul == std::string_view::npos) break;
    Record r;
    r.name = std::string(bytes.substr(0, nul));
    bytes.remove_prefix(nul + 1);
    uint32_t n = 0;
    for (int i = 0; i < 4 && !bytes.empty(); ++i) {
      n |= static_cast<uint32_t>(static_cast<unsigned char>(bytes[0])) << (8 * i);
      bytes.remove_prefix(1);
    }
    const size_t take = std::min<size_t>(n, bytes.size());
    r.data = std::string(bytes.substr(0, take));
    bytes.remove_prefix(take);
    out.push_back(std::move(r));
  }
  return out;
}

std::vector<Record> archive_records(std::string_view file_bytes) {
  caffe2::serialize::PyTorchStreamReader reader(std::make_shared<BufferReader>(file_bytes));
  std::vector<Record> out;
  for (const auto& name : reader.getAllRecords()) {
    if (!payload_name(name)) continue;
    auto [ptr, size] = reader.getRecord(name);
    out.push_back({name, std::string(static_cast<const char*>(ptr.get()), size)});
  }
  return out;
}

bool checkpoint_one(std::string_view input, std::string* error) {
  if (input.empty()) return false;
  const int mode = input[0] & 1;
  input.remove_prefix(1);
  std::string file;
  if (mode == 0) {
    file = std::string(input);
  } else {
    // A well-formed archive of the given records with a manifest that fits them.
    try {
      std::string archive;
      caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t n) -> size_t {
        archive.append(static_cast<const char*>(data), n);
        return n;
      });
      std::vector<std::string> written;
      for (const auto& r : decode_records(input)) {
        if (!payload_name(r.name) || std::find(written.begin(), written.end(), r.name) != written.end()) continue;
        writer.writeRecord(r.name, r.data.data(), r.data.size());
        written.push_back(r.name);
      }
      writer.writeEndOfFile();
      file = engine::reseal_checkpoint_bytes(archive);
    } catch (const std::exception& e) {
      if (error) *error = std::string("no archive could be made of the records: ") + e.what();
      return false;  // the test's own archive could not be made: nothing to read
    }
  }
  c10::impl::GenericDict loaded(c10::StringType::get(), c10::AnyType::get());
  try {
    loaded = engine::load_checkpoint_bytes(file.data(), file.size(), "fuzz.ckpt");
  } catch (const c10::Error& e) {
    throw Finding(std::string("c10::Error escaped the reader: ") + e.what_without_backtrace());
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    one_line("std::runtime_error", what);
    if (what.find("fuzz.ckpt") == std::string::npos) throw Finding("the error does not name the file: " + what);
    if (error) *error = what;
    return false;
  } catch (const std::exception& e) {
    throw Finding(std::string("unexpected exception from the reader: ") + e.what());
  }
  touch(loaded, 0);
  return true;
}

}  // namespace ember::fuzz
