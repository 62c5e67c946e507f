// `engine checkpoint verify CKPT`: whether a checkpoint file, or every file of a sharded directory,
// is the bytes that were written (each record against its manifest's CRC32C, read in chunks) and
// reads as a checkpoint. For a copy between machines or a file left on a scratch disk, checked on
// a login node without a GPU and in a few MB of memory, before a job is queued to resume from it.
#include <filesystem>
#include <optional>
#include <utility>
#include <string>
#include <vector>

#include <ember/error.h>

#include "app/commands.h"
#include "checkpoint/checkpoint_io.h"
#include "checkpoint/omitted_parameters.h"

namespace fs = std::filesystem;

namespace ember::engine {
namespace {

// The world size a sharded directory's meta.ckpt records (`meta`: its pickle), or throws.
int64_t sharded_world_size(const c10::IValue& meta, const fs::path& file) {
  if (meta.isGenericDict()) {
    const auto d = meta.toGenericDict();
    const auto layout = d.find(c10::IValue(std::string("sharded")));
    if (layout != d.end() && layout->value().isGenericDict()) {
      const auto l = layout->value().toGenericDict();
      const auto world = l.find(c10::IValue(std::string("world_size")));
      if (world != l.end() && world->value().isInt() && world->value().toInt() > 0) return world->value().toInt();
    }
  }
  throw std::runtime_error(file.string() + " has no sharded layout (world_size): not an Ember sharded checkpoint's meta.ckpt");
}

// The omitted_parameters record of a file that took the frozen weights it left out from a base
// (its run's init_checkpoint), that base found from `file`; none for a file that holds them or
// builds them (or whose record is not one: loading it says so).
std::optional<OmittedParameters> base_of(const c10::IValue& skeleton, const fs::path& file) {
  if (!skeleton.isGenericDict()) return std::nullopt;
  const auto d = skeleton.toGenericDict();
  const auto omitted = d.find(c10::IValue(std::string("omitted_parameters")));
  if (omitted == d.end()) return std::nullopt;
  try {
    auto o = OmittedParameters::from_ivalue(omitted->value(), file.string(), file);
    if (o.base.empty() || o.from_base.empty()) return std::nullopt;
    return o;
  } catch (const RunError&) {
    return std::nullopt;
  }
}

int verify(const std::string& checkpoint, std::ostream& out, int depth);

}  // namespace

int checkpoint_verify(const std::string& checkpoint, std::ostream& out) { return verify(checkpoint, out, 0); }

namespace {

int verify(const std::string& checkpoint, std::ostream& out, int depth) {
  std::error_code ec;
  if (!fs::exists(checkpoint, ec))
    throw RunError("engine checkpoint verify: " + checkpoint + " does not exist: name a checkpoint file or a sharded checkpoint directory");
  const bool sharded = fs::is_directory(checkpoint, ec);
  const fs::path first = sharded ? fs::path(checkpoint) / "meta.ckpt" : fs::path(checkpoint);
  if (sharded && !fs::is_regular_file(first, ec))
    throw RunError("engine checkpoint verify: " + checkpoint + " is a folder without meta.ckpt: name a checkpoint file or a sharded checkpoint directory");
  // A sharded directory's meta.ckpt comes first: the parts to check are the ones its layout names.
  std::vector<fs::path> files{first};
  size_t damaged = 0;
  std::string first_problem;
  uint64_t total = 0;
  std::optional<OmittedParameters> base;
  for (size_t i = 0; i < files.size(); ++i) {
    const fs::path file = files[i];
    try {
      if (!fs::is_regular_file(file, ec))
        throw std::runtime_error("sharded checkpoint " + checkpoint + " lacks " + file.filename().string() + " (an incomplete copy?)");
      const VerifiedCheckpoint v = verify_checkpoint_file(file);
      if (sharded && i == 0)
        for (int64_t rank = 0, world = sharded_world_size(v.skeleton, file); rank < world; ++rank)
          files.push_back(fs::path(checkpoint) / ("rank" + std::to_string(rank) + ".ckpt"));
      if (!sharded) base = base_of(v.skeleton, file);
      total += v.payload_bytes;
      out << file.string() << ": good: " << v.records << " records, " << size_text(v.payload_bytes)
          << ", every CRC32C matches its manifest and the pickle reads"
          << (v.archives == 0 ? std::string()
                              : v.archives == 1 ? std::string(", with the torch::save archive within")
                                                : ", with the " + std::to_string(v.archives) + " torch::save archives within")
          << " (format " << v.format_version
          << (v.weights_only ? ", weights only" : "") << ")\n";
    } catch (const std::exception& e) {
      if (sharded && i == 0) throw RunError("engine checkpoint verify: " + std::string(e.what()));  // no parts to name
      ++damaged;
      if (first_problem.empty()) first_problem = e.what();
      if (files.size() > 1) out << file.string() << ": BAD: " << e.what() << "\n";
    }
  }
  if (damaged == 0) {
    if (files.size() > 1) out << checkpoint << ": good: all " << files.size() << " files, " << size_text(total) << "\n";
    if (!base) return 0;
    // Loading it reads its base too: that must be there and whole as well.
    if (const auto why = unreadable_base(checkpoint, *base, depth); !why.empty()) throw RunError("engine checkpoint verify: " + why);
    out << checkpoint << ": its frozen weights come from " << base->base
        << (base->moved ? " (where it lies relative to it: the folders moved since it was written)" : "") << ", checked next\n";
    return verify(base->base, out, depth + 1);
  }
  if (files.size() == 1) throw RunError("engine checkpoint verify: " + first_problem);
  throw RunError("engine checkpoint verify: " + std::to_string(damaged) + " of the " + std::to_string(files.size()) + " files of " +
                 checkpoint + " are bad (listed above); the first: " + first_problem);
}

}  // namespace
}  // namespace ember::engine
