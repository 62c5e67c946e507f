// `engine checkpoint info CKPT`: what a checkpoint holds (position, versions, the model's tensors,
// the plugins' states), read from its pickle alone (ember::support::read_checkpoint_skeleton: no
// tensor data, so a 90 GB file answers in a moment). `engine checkpoint verify` checks the checksums.
#include <ember/support/checkpoint_read.h>
#include <ember/support/number_text.h>

#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <sstream>
#include <vector>

#include <ember/error.h>

#include "app/commands.h"
#include "checkpoint/checkpoint_io.h"
#include "checkpoint/omitted_parameters.h"

namespace fs = std::filesystem;

namespace ember::engine {
namespace {

// A TOML basic string: a class list printed this way pastes into a data module's `labels`.
std::string toml_string(const std::string& s) {
  std::string out = "\"";
  for (const unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20 || c == 0x7f) {
      char hex[16];
      std::snprintf(hex, sizeof hex, "\\u%04x", c);
      out += hex;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

// A value short enough for one line: numbers, strings, booleans; "" for anything else.
std::string scalar_text(const c10::IValue& v) {
  if (v.isString()) return v.toStringRef();
  if (v.isInt()) return std::to_string(v.toInt());
  if (v.isDouble()) return shortest_number(v.toDouble());
  if (v.isBool()) return v.toBool() ? "true" : "false";
  return "";
}

const c10::IValue* entry(const c10::impl::GenericDict& d, const std::string& key) {
  const auto it = d.find(c10::IValue(key));
  return it == d.end() ? nullptr : &it->value();
}

// A dict of plugin name -> state (callbacks, loggers, plugins): each name, and its short entries.
void print_states(std::ostream& out, const char* label, const c10::IValue* states) {
  if (states == nullptr || !states->isGenericDict() || states->toGenericDict().empty()) return;
  out << label << ":\n";
  for (const auto& e : states->toGenericDict()) {
    out << "  " << scalar_text(e.key()) << "\n";
    if (!e.value().isGenericDict()) continue;
    for (const auto& f : e.value().toGenericDict()) {
      const std::string text = scalar_text(f.value());
      if (!text.empty() && text.size() <= 200) out << "    " << scalar_text(f.key()) << " " << text << "\n";
    }
  }
}

}  // namespace

std::string size_text(uintmax_t bytes) {
  char buf[32];
  const double b = static_cast<double>(bytes);
  if (b >= 1e9) std::snprintf(buf, sizeof buf, "%.2f GB", b / 1e9);
  else if (b >= 1e6) std::snprintf(buf, sizeof buf, "%.1f MB", b / 1e6);
  else std::snprintf(buf, sizeof buf, "%.1f kB", b / 1e3);
  return buf;
}

int checkpoint_info(const std::string& checkpoint, std::ostream& out) {
  std::error_code ec;
  const bool sharded = fs::is_directory(checkpoint, ec);
  const fs::path file = sharded ? fs::path(checkpoint) / "meta.ckpt" : fs::path(checkpoint);
  if (!fs::exists(checkpoint, ec)) throw RunError("engine checkpoint info: " + checkpoint + " does not exist: name a checkpoint file or a sharded checkpoint directory");
  if (sharded && !fs::is_regular_file(file, ec))
    throw RunError("engine checkpoint info: " + checkpoint + " is a folder without meta.ckpt: name a checkpoint file or a sharded checkpoint directory");
  c10::IValue root;
  try {
    root = support::read_checkpoint_skeleton(file.string());
  } catch (const std::exception& e) {
    throw RunError(std::string("engine checkpoint info: ") + e.what());
  }
  uintmax_t bytes = 0;
  size_t parts = 0;
  if (sharded) {
    for (const auto& f : fs::directory_iterator(checkpoint, ec))
      if (f.is_regular_file(ec)) {
        bytes += f.file_size(ec);
        parts += f.path().filename().string().starts_with("rank") ? 1 : 0;
      }
  } else {
    bytes = fs::file_size(file, ec);
  }
  out << checkpoint << ": ";
  if (!root.isGenericDict()) {
    out << "not a checkpoint dict (a pickled " << root.tagKind() << "), " << size_text(bytes) << "\n";
    return 0;
  }
  const auto d = root.toGenericDict();
  const c10::IValue* format = entry(d, "format");
  const bool ember = format != nullptr && format->isString() && format->toStringRef() == kCheckpointFormat;
  if (!ember) {
    out << "not an Ember checkpoint (no format tag), " << size_text(bytes) << "; its entries:";
    for (const auto& e : d) out << " " << scalar_text(e.key());
    out << "\n";
    return 0;
  }
  const c10::IValue* version = entry(d, "format_version");
  out << "Ember checkpoint, format " << (version != nullptr ? scalar_text(*version) : "?") << ", " << size_text(bytes);
  if (sharded) out << " in meta.ckpt and " << parts << " part(s) (a sharded directory)";
  out << "\n";
  std::string written;
  for (const char* key : {"ember_version", "torch_version", "sdk_abi"})
    if (const auto* v = entry(d, key)) written += std::string(written.empty() ? "" : ", ") + key + " " + scalar_text(*v);
  if (!written.empty()) out << "written by: " << written << "\n";
  const c10::IValue* weights_only = entry(d, "weights_only");
  const bool only_weights = weights_only != nullptr && weights_only->isBool() && weights_only->toBool();
  std::string position;
  for (const char* key : {"epoch", "global_step"})
    if (const auto* v = entry(d, key)) position += std::string(position.empty() ? "" : ", ") + key + " " + scalar_text(*v);
  if (const auto* loops = entry(d, "loops"); loops != nullptr && loops->isGenericDict()) {
    const auto l = loops->toGenericDict();
    const auto* finished = entry(l, "epoch_finished");
    const auto* done = entry(l, "batches_done");
    if (finished != nullptr && finished->isBool())
      position += finished->toBool() ? " (epoch finished)"
                                     : " (mid-epoch, after " + (done != nullptr ? scalar_text(*done) : std::string("?")) + " batches)";
  }
  if (!position.empty()) out << "position: " << position << "\n";
  out << "resumable: "
      << (only_weights ? "no, weights only (save_weights_only): it can be tested, exported, or trained on from ([model] init_checkpoint)"
                       : entry(d, "optimizer") != nullptr || sharded ? "yes (weights, optimizer, loops, random state)"
                                                                     : "no optimizer state")
      << "\n";
  if (const auto* sd = entry(d, "state_dict"); sd != nullptr && sd->isGenericDict()) {
    const auto s = sd->toGenericDict();
    int64_t elements = 0;
    std::map<std::string, int64_t> by_dtype;
    size_t width = 0;
    for (const auto& e : s) width = std::max(width, scalar_text(e.key()).size());
    std::ostringstream rows;
    for (const auto& e : s) {
      if (!e.value().isTensor()) continue;
      const at::Tensor& t = e.value().toTensor();
      elements += t.numel();
      by_dtype[std::string(c10::toString(t.scalar_type()))] += t.numel();
      const std::string name = scalar_text(e.key());
      rows << "  " << name << std::string(width - name.size() + 2, ' ') << c10::toString(t.scalar_type()) << " " << t.sizes() << "\n";
    }
    out << "model: " << s.size() << " tensors, " << elements << " elements (";
    bool first = true;
    for (const auto& [dtype, n] : by_dtype) {
      out << (first ? "" : ", ") << dtype << " " << n;
      first = false;
    }
    out << ")\n" << rows.str();
  } else if (sharded) {
    out << "model: in the parts, sharded (`engine checkpoint consolidate` makes one file)\n";
  }
  if (const auto* omitted = entry(d, "omitted_parameters"); omitted != nullptr) {
    try {
      const auto o = OmittedParameters::from_ivalue(*omitted, checkpoint, file);
      out << "frozen weights left out: " << o.names.size();
      if (!o.base.empty() && !o.from_base.empty())
        out << " (loading reads " << o.from_base.size() << " of them from " << o.base << ", its run's model.init_checkpoint"
            << (o.moved ? ", found relative to this checkpoint: the folders moved since it was written" : "")
            << (o.from_base.size() == o.names.size() ? "" : ", the others from the model as it is built") << ")\n";
      else
        out << " (taken from the model when it loads)\n";
    } catch (const RunError& e) {
      out << "frozen weights left out: ? (" << e.what() << ")\n";
    }
  }
  if (const auto* classes = entry(d, "class_names"); classes != nullptr && classes->isList()) {
    const auto names = classes->toList();
    out << "classes (" << names.size() << ", in output order): [";
    for (size_t i = 0; i < names.size(); ++i) {
      const c10::IValue name = names.get(i);
      out << (i ? ", " : "") << (name.isString() ? toml_string(name.toStringRef()) : "?");
    }
    out << "]\n";
  }
  print_states(out, "plugins", entry(d, "plugins"));
  print_states(out, "callbacks", entry(d, "callbacks"));
  // States that differ between ranks (loop/rank_states.h): which, and for how many ranks.
  if (const auto* by_rank = entry(d, "callbacks_by_rank"); by_rank != nullptr && by_rank->isGenericDict()) {
    const auto r = by_rank->toGenericDict();
    const auto* world = entry(r, "world_size");
    const auto* states = entry(r, "states");
    const auto* in_parts = entry(r, "in_parts");
    std::vector<c10::IValue> names;
    if (states != nullptr && states->isGenericDict())
      for (const auto& e : states->toGenericDict()) names.push_back(e.key());
    if (in_parts != nullptr && in_parts->isList())
      for (const auto& n : in_parts->toListRef()) names.push_back(n);
    if (world != nullptr && world->isInt() && !names.empty()) {
      out << "callback states per rank (" << world->toInt() << " ranks" << (in_parts != nullptr ? ", each in its part" : "")
          << "; a resume with as many ranks gives each its own):";
      for (size_t i = 0; i < names.size(); ++i) out << (i ? ", " : " ") << scalar_text(names[i]);
      out << "\n";
    }
  }
  print_states(out, "loggers", entry(d, "loggers"));
  if (const auto* versions = entry(d, "plugin_versions"); versions != nullptr && versions->isGenericDict()) {
    out << "plugin versions:";
    bool first = true;
    for (const auto& e : versions->toGenericDict()) {
      out << (first ? " " : ", ") << scalar_text(e.key()) << " " << scalar_text(e.value());
      first = false;
    }
    out << "\n";
  }
  out << "checksums: not checked here; `engine checkpoint verify " << checkpoint << "` checks them, as every load does\n";
  return 0;
}

}  // namespace ember::engine
