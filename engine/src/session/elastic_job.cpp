#include "session/elastic_job.h"

#include <cstdlib>
#include <fstream>
#include <iterator>

#include "checkpoint/atomic_file.h"

namespace fs = std::filesystem;

namespace ember::engine {
namespace {
constexpr const char* kMarker = "torchrun_job_id";

std::string read_marker(const fs::path& dir) {
  std::ifstream in(dir / kMarker, std::ios::binary);
  return in ? std::string(std::istreambuf_iterator<char>(in), {}) : std::string();
}

std::optional<int64_t> version_number(const fs::path& dir) {
  const std::string n = dir.filename().string();
  if (!n.starts_with("version_") || n.size() == 8) return std::nullopt;
  char* end = nullptr;
  const long long v = std::strtoll(n.c_str() + 8, &end, 10);
  if (*end != '\0' || v < 0) return std::nullopt;
  return v;
}
}  // namespace

std::string torchrun_job_id() {
  const char* id = std::getenv("TORCHELASTIC_RUN_ID");
  if (id == nullptr || *id == '\0' || std::string(id) == "none") return "";
  return id;
}

std::optional<int64_t> version_of_torchrun_job(const fs::path& base, std::optional<int64_t> version, const std::string& id) {
  if (id.empty()) return std::nullopt;
  if (version) {
    if (read_marker(base / ("version_" + std::to_string(*version))) == id) return version;
    return std::nullopt;
  }
  std::optional<int64_t> newest;
  std::error_code ec;
  if (fs::is_directory(base, ec))
    for (const auto& e : fs::directory_iterator(base, ec)) {
      const auto v = version_number(e.path());
      if (v && (!newest || *v > *newest) && read_marker(e.path()) == id) newest = v;
    }
  return newest;
}

void mark_torchrun_job(const fs::path& dir, const std::string& id) {
  if (id.empty() || read_marker(dir) == id) return;
  atomic_write(dir / kMarker, id.data(), id.size());
}

}  // namespace ember::engine
