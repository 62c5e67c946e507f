// Where shards come from: the [data] train / val / test lists expanded into shard locations
// (WebDataset's brace ranges "shard-{000000..000009}.tar" and alternatives "{a,b}", shell globs,
// HTTP(S) URLs, and wids-style JSON shard lists {"shardlist": [{"url": ..., "nsamples": N}]}), and
// remote shards brought into a local cache (libcurl) so that their samples can be read at random.
#pragma once
#include <cstdint>
#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace ember_webdataset {

struct ShardLocation {
  std::string source;    // a local path or an http(s):// URL
  int64_t samples = -1;  // from a JSON shard list; -1 = unknown until indexed
};

// "a-{00..02}.tar" -> a-00.tar, a-01.tar, a-02.tar; "{x,y}.tar" -> x.tar, y.tar (nested and
// repeated braces expand left to right). Throws ember::ConfigError(`where`) for an unclosed brace.
std::vector<std::string> expand_braces(const std::string& pattern, const std::string& where);

// Every entry of a configured list expanded, in order: braces, then globs for local paths (sorted
// matches; none is an error), JSON shard lists read. Relative paths are taken from the working
// directory, those inside a JSON list from the list's folder. A JSON list's "classes" (the class
// names `engine data pack` writes) go to `classes` when it is empty.
std::vector<ShardLocation> expand_shards(const std::vector<std::string>& entries, const std::string& where, std::vector<std::string>* classes);

bool is_remote(const std::string& source);

// Remote shards' local copies in a folder (named by a hash of the URL and its file name), each
// downloaded once (to a temporary name, renamed when complete, so an interrupted download never
// looks finished). With a byte limit, the least recently used copies this process made or found
// are deleted once the folder's copies exceed it (the one just fetched stays); a copy deleted
// under a reader is fetched again. Thread-safe.
class ShardCache {
 public:
  ShardCache(std::filesystem::path dir, int64_t limit_bytes) : dir_(std::move(dir)), limit_(limit_bytes) {}
  // The local copy of `url`, downloaded when missing. Throws ember::RunError with the URL and the
  // HTTP status or libcurl's error.
  std::filesystem::path fetch(const std::string& url);
  // An uncompressed copy of the compressed shard `source` (a local path, or a URL: downloaded
  // first, and that download deleted once decompressed), made once under a temporary name and
  // kept, counted and evicted like a download. A local shard's copy is named by its path, size and
  // modification time, so a rewritten shard is decompressed again.
  std::filesystem::path decompressed(const std::string& source);
  // Forgets a copy that disappeared (deleted by another process sharing the folder).
  void forget(const std::filesystem::path& copy);

 private:
  // Counts the copy at `target` (a download or a decompressed shard) and deletes the least
  // recently used others while the copies exceed the limit.
  void remember(const std::filesystem::path& target);
  struct Entry {
    int64_t bytes = 0;
    uint64_t last_use = 0;
  };
  std::filesystem::path dir_;
  int64_t limit_;
  mutable std::mutex mutex_;
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::filesystem::path> copies_;  // a compressed shard -> its copy (valid while in entries_)
  int64_t total_ = 0;
  uint64_t clock_ = 0;
};

}  // namespace ember_webdataset
