#include "shard_source.h"

#include <ember/error.h>

#include "shard_index.h"

#include <curl/curl.h>
#include <glob.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <unistd.h>

namespace fs = std::filesystem;

namespace ember_webdataset {

namespace {

bool all_digits(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isdigit(c); });
}

// More names than any shard list needs (a million shards of ten thousand samples are ten billion
// samples): a pattern that expands further is a typo ({0..99999999999}) that would take memory and
// time without end.
constexpr size_t kMaxShardNames = 1000000;

void expand_into(const std::string& pattern, const std::string& where, std::vector<std::string>& out) {
  const size_t open = pattern.find('{');
  if (open == std::string::npos) {
    if (out.size() >= kMaxShardNames)
      throw ember::ConfigError(where + ": shard pattern expands to more than " + std::to_string(kMaxShardNames) +
                               " shard names: check its {first..last} ranges");
    out.push_back(pattern);
    return;
  }
  const size_t close = pattern.find('}', open);
  if (close == std::string::npos) throw ember::ConfigError(where + ": shard pattern '" + pattern + "' has a '{' without its '}'");
  const std::string inside = pattern.substr(open + 1, close - open - 1);
  const std::string head = pattern.substr(0, open), tail = pattern.substr(close + 1);
  std::vector<std::string> choices;
  const size_t dots = inside.find("..");
  if (dots != std::string::npos && all_digits(inside.substr(0, dots)) && all_digits(inside.substr(dots + 2))) {
    const std::string first = inside.substr(0, dots), last = inside.substr(dots + 2);
    const size_t width = first.size();  // zero-padded to the first bound's width, as braceexpand does
    if (first.size() > 18 || last.size() > 18)
      throw ember::ConfigError(where + ": shard range {" + inside + "} has a bound of more than 18 digits");
    const long long lo = std::stoll(first), hi = std::stoll(last);
    if (hi < lo) throw ember::ConfigError(where + ": shard range {" + inside + "} counts down: write it low..high");
    if (static_cast<unsigned long long>(hi - lo) >= kMaxShardNames)
      throw ember::ConfigError(where + ": shard range {" + inside + "} names " + std::to_string(hi - lo + 1) + " shards, more than " +
                               std::to_string(kMaxShardNames) + ": check its bounds");
    for (long long i = lo; i <= hi; ++i) {
      std::string n = std::to_string(i);
      if (n.size() < width) n.insert(0, width - n.size(), '0');
      choices.push_back(n);
    }
  } else {
    size_t start = 0;
    while (true) {
      const size_t comma = inside.find(',', start);
      choices.push_back(inside.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
  }
  for (const auto& c : choices) expand_into(head + c + tail, where, out);
}

std::vector<ShardLocation> read_shard_list(const fs::path& list, const std::string& where, std::vector<std::string>* classes) {
  std::ifstream in(list);
  if (!in) throw ember::RunError("webdataset: cannot read the shard list " + list.string() + " (" + where + ")");
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    throw ember::RunError("webdataset: " + list.string() + " is not valid JSON: " + e.what());
  }
  if (!doc.is_object() || !doc.contains("shardlist") || !doc["shardlist"].is_array())
    throw ember::RunError("webdataset: " + list.string() + " has no \"shardlist\" array: write {\"shardlist\": [{\"url\": \"shard-000000.tar\", \"nsamples\": 1000}, ...]}");
  if (classes != nullptr && classes->empty() && doc.contains("classes") && doc["classes"].is_array())
    for (const auto& c : doc["classes"])
      if (c.is_string()) classes->push_back(c.get<std::string>());
  std::vector<ShardLocation> out;
  size_t n = 0;
  for (const auto& item : doc["shardlist"]) {
    ++n;
    if (!item.is_object() || !item.contains("url") || !item["url"].is_string())
      throw ember::RunError("webdataset: " + list.string() + ": shardlist entry " + std::to_string(n) + " has no \"url\" string");
    std::string url = item["url"].get<std::string>();
    if (!is_remote(url) && fs::path(url).is_relative()) url = (list.parent_path() / url).string();
    int64_t samples = -1;
    if (item.contains("nsamples")) {
      if (!item["nsamples"].is_number_integer() || item["nsamples"].get<int64_t>() < 0)
        throw ember::RunError("webdataset: " + list.string() + ": shardlist entry " + std::to_string(n) + " has an \"nsamples\" that is not a count");
      samples = item["nsamples"].get<int64_t>();
    }
    out.push_back({url, samples});
  }
  return out;
}

size_t write_to_file(char* data, size_t size, size_t count, void* file) {
  return std::fwrite(data, size, count, static_cast<std::FILE*>(file)) * size;
}

}  // namespace

bool is_remote(const std::string& source) { return source.rfind("http://", 0) == 0 || source.rfind("https://", 0) == 0; }

std::vector<std::string> expand_braces(const std::string& pattern, const std::string& where) {
  std::vector<std::string> out;
  expand_into(pattern, where, out);
  return out;
}

std::vector<ShardLocation> expand_shards(const std::vector<std::string>& entries, const std::string& where, std::vector<std::string>* classes) {
  std::vector<ShardLocation> out;
  for (const auto& entry : entries)
    for (const auto& item : expand_braces(entry, where)) {
      if (is_remote(item)) {
        out.push_back({item, -1});
      } else if (item.find_first_of("*?[") != std::string::npos) {
        glob_t g{};
        const int rc = ::glob(item.c_str(), 0, nullptr, &g);
        std::unique_ptr<glob_t, void (*)(glob_t*)> guard(&g, globfree);
        if (rc != 0 || g.gl_pathc == 0)
          throw ember::RunError("webdataset: no shard matches " + item + " (" + where + ")");
        for (size_t i = 0; i < g.gl_pathc; ++i) out.push_back({g.gl_pathv[i], -1});  // glob sorts its matches
      } else if (fs::path(item).extension() == ".json") {
        for (auto& s : read_shard_list(item, where, classes)) out.push_back(std::move(s));
      } else {
        if (!fs::is_regular_file(item))
          throw ember::RunError("webdataset: shard " + item + " does not exist (" + where + "): list .tar files, brace ranges like "
                                "shard-{000000..000009}.tar, globs, http(s) URLs or a .json shard list");
        out.push_back({item, -1});
      }
    }
  if (out.empty()) throw ember::ConfigError(where + ": the list names no shard");
  return out;
}

namespace {

void download(const std::string& source, const fs::path& cache_dir, const fs::path& target) {
  static std::once_flag curl_init;
  std::call_once(curl_init, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  std::error_code ec;
  fs::create_directories(cache_dir, ec);
  if (ec) throw ember::RunError("webdataset: cannot create the shard cache " + cache_dir.string() + ": " + ec.message() + " (set data.cache_dir)");
  // A temporary name per process and thread: ranks of one node may fetch the same shard at once.
  const fs::path partial = target.string() + ".partial." + std::to_string(::getpid()) + "." +
                           std::to_string(std::hash<std::thread::id>{}(std::this_thread::get_id()));
  std::FILE* file = std::fopen(partial.c_str(), "wb");
  if (file == nullptr) throw ember::RunError("webdataset: cannot write " + partial.string() + " (set data.cache_dir to a writable folder)");
  std::unique_ptr<CURL, void (*)(CURL*)> curl(curl_easy_init(), curl_easy_cleanup);
  char error[CURL_ERROR_SIZE] = {0};
  curl_easy_setopt(curl.get(), CURLOPT_URL, source.c_str());
  curl_easy_setopt(curl.get(), CURLOPT_FOLLOWLOCATION, 1L);
  curl_easy_setopt(curl.get(), CURLOPT_FAILONERROR, 1L);
  curl_easy_setopt(curl.get(), CURLOPT_WRITEFUNCTION, write_to_file);
  curl_easy_setopt(curl.get(), CURLOPT_WRITEDATA, file);
  curl_easy_setopt(curl.get(), CURLOPT_ERRORBUFFER, error);
  curl_easy_setopt(curl.get(), CURLOPT_CONNECTTIMEOUT, 30L);
  // A stalled transfer (under 1 byte/s for a minute) fails rather than hangs the run.
  curl_easy_setopt(curl.get(), CURLOPT_LOW_SPEED_LIMIT, 1L);
  curl_easy_setopt(curl.get(), CURLOPT_LOW_SPEED_TIME, 60L);
  const CURLcode rc = curl_easy_perform(curl.get());
  const bool flushed = std::fflush(file) == 0 && ::fsync(fileno(file)) == 0;
  std::fclose(file);
  if (rc != CURLE_OK || !flushed) {
    fs::remove(partial, ec);
    throw ember::RunError("webdataset: cannot download shard " + source + ": " +
                          (rc != CURLE_OK ? std::string(error[0] ? error : curl_easy_strerror(rc)) : "writing " + partial.string() + " failed"));
  }
  fs::rename(partial, target, ec);
  if (ec) throw ember::RunError("webdataset: cannot move " + partial.string() + " to " + target.string() + ": " + ec.message());
}

}  // namespace

fs::path ShardCache::fetch(const std::string& url) {
  const std::string base = url.substr(url.find_last_of('/') + 1);
  const fs::path target = dir_ / (std::to_string(std::hash<std::string>{}(url)) + "-" + (base.empty() ? "shard.tar" : base));
  {
    std::lock_guard lock(mutex_);
    if (auto it = entries_.find(target.string()); it != entries_.end()) {
      it->second.last_use = ++clock_;
      return target;
    }
  }
  if (!fs::exists(target)) download(url, dir_, target);
  remember(target);
  return target;
}

fs::path ShardCache::decompressed(const std::string& source) {
  // Every sample read asks for the copy: once it is made or found, a lookup answers, without the
  // stat calls naming it takes (and a shard rewritten mid-run keeps this run's copy).
  {
    std::lock_guard lock(mutex_);
    if (auto known = copies_.find(source); known != copies_.end())
      if (auto it = entries_.find(known->second.string()); it != entries_.end()) {
        it->second.last_use = ++clock_;
        return known->second;
      }
  }
  // "a.tar.gz" -> "a.tar", "a.tgz" -> "a.tar": the copy is named as the tar it is.
  std::string base = is_remote(source) ? source.substr(source.find_last_of('/') + 1) : fs::path(source).filename().string();
  for (const char* suffix : {".gz", ".tgz", ".bz2", ".tbz2", ".xz", ".txz", ".zst", ".tzst", ".lz4", ".lzma"})
    if (base.size() > std::strlen(suffix) && base.compare(base.size() - std::strlen(suffix), std::string::npos, suffix) == 0) {
      base.resize(base.size() - std::strlen(suffix));
      break;
    }
  if (base.size() < 4 || base.compare(base.size() - 4, 4, ".tar") != 0) base += ".tar";
  // A URL's copy is named by the URL; a local shard's by its path, then its size and modification
  // time, so that a rewritten shard gets a new copy and the old one (same path part) can go.
  std::string owner = std::to_string(std::hash<std::string>{}("decompressed:" + source)) + "-";
  std::string name = owner + base;
  if (!is_remote(source)) {
    std::error_code ec;
    const fs::path absolute = fs::absolute(source, ec);
    const auto size = fs::file_size(source, ec);
    const auto mtime = fs::last_write_time(source, ec).time_since_epoch().count();
    owner = std::to_string(std::hash<std::string>{}("decompressed:" + absolute.string())) + "-";
    name = owner + std::to_string(std::hash<std::string>{}(std::to_string(size) + ":" + std::to_string(mtime))) + "-" + base;
  }
  const fs::path target = dir_ / name;
  {
    std::lock_guard lock(mutex_);
    if (auto it = entries_.find(target.string()); it != entries_.end()) {
      it->second.last_use = ++clock_;
      return target;
    }
  }
  if (!fs::exists(target)) {
    const fs::path input = is_remote(source) ? fetch(source) : fs::path(source);
    std::error_code ec;
    fs::create_directories(dir_, ec);
    if (ec) throw ember::RunError("webdataset: cannot create the shard cache " + dir_.string() + ": " + ec.message() + " (set data.cache_dir)");
    // A temporary name per process and thread, as for downloads: never taken for a whole copy.
    const fs::path partial = target.string() + ".partial." + std::to_string(::getpid()) + "." +
                             std::to_string(std::hash<std::thread::id>{}(std::this_thread::get_id()));
    try {
      decompress_shard(input.string(), partial.string(), source);
    } catch (...) {
      fs::remove(partial, ec);
      throw;
    }
    fs::rename(partial, target, ec);
    if (ec) throw ember::RunError("webdataset: cannot move " + partial.string() + " to " + target.string() + ": " + ec.message());
    // The compressed download is not read again: only the copy stays.
    if (is_remote(source)) {
      forget(input);
      fs::remove(input, ec);
    } else {
      // Copies of earlier versions of this shard (it was rewritten since) are stale: deleted.
      std::vector<fs::path> stale;
      for (const auto& e : fs::directory_iterator(dir_, ec)) {
        const std::string other = e.path().filename().string();
        if (other != name && other.rfind(owner, 0) == 0 && other.find(".partial.") == std::string::npos) stale.push_back(e.path());
      }
      for (const auto& old : stale) {
        forget(old);
        fs::remove(old, ec);
      }
    }
  }
  remember(target);
  std::lock_guard lock(mutex_);
  copies_[source] = target;
  return target;
}

void ShardCache::remember(const fs::path& target) {
  std::error_code ec;
  const auto bytes = static_cast<int64_t>(fs::file_size(target, ec));
  std::lock_guard lock(mutex_);
  auto [it, added] = entries_.try_emplace(target.string());
  if (added) total_ += ec ? 0 : bytes, it->second.bytes = ec ? 0 : bytes;
  it->second.last_use = ++clock_;
  // Over the limit: the least recently used copies go, never the one just fetched.
  while (limit_ > 0 && total_ > limit_ && entries_.size() > 1) {
    auto oldest = entries_.end();
    for (auto e = entries_.begin(); e != entries_.end(); ++e)
      if (e->first != target.string() && (oldest == entries_.end() || e->second.last_use < oldest->second.last_use)) oldest = e;
    fs::remove(oldest->first, ec);
    total_ -= oldest->second.bytes;
    entries_.erase(oldest);
  }
}

void ShardCache::forget(const fs::path& copy) {
  std::lock_guard lock(mutex_);
  if (auto it = entries_.find(copy.string()); it != entries_.end()) {
    total_ -= it->second.bytes;
    entries_.erase(it);
  }
}


}  // namespace ember_webdataset
