// Where the text plugins look for what scripts/setup.sh installed (pretrained models, data sets):
// a bare name ("all-minilm-l6-v2") means a folder in the Ember cache ($EMBER_CACHE, default
// ~/.cache/ember). A path that exists from the working folder is used as given; otherwise a
// relative path found under the cache is taken from there.
#pragma once
#include <cstdlib>
#include <filesystem>
#include <string>

namespace ember_text {

inline std::filesystem::path cache_dir() {
  if (const char* c = std::getenv("EMBER_CACHE"); c != nullptr && *c != '\0') return c;
  const char* home = std::getenv("HOME");
  return std::filesystem::path(home != nullptr ? home : ".") / ".cache" / "ember";
}

inline std::filesystem::path resolve_asset(const std::string& value) {
  const std::filesystem::path p(value);
  if (p.is_absolute() || std::filesystem::exists(p)) return p;
  if (std::filesystem::exists(cache_dir() / p)) return cache_dir() / p;
  return value.find('/') == std::string::npos ? cache_dir() / p : p;
}

}  // namespace ember_text
