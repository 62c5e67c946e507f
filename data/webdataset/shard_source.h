// Where shards come from: the [data] train / val / test lists expanded into shard locations
// (WebDataset's brace ranges "shard-{000000..000009}.tar" and alternatives "{a,b}", shell globs,
// HTTP(S) URLs, and wids-style JSON shard lists {"shardlist": [{"url": ..., "nsamples": N}]}), and
// remote shards brought into a local cache (libcurl) so that their samples can be read at random.
#pragma once
#include <cstdint>
#include <filesystem>
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

// The local copy of a remote shard in `cache_dir` (named by a hash of the URL and its file name),
// downloaded once (to a temporary name, renamed when complete, so an interrupted download never
// looks finished); a local source is returned as it is. Throws ember::RunError with the URL and
// the HTTP status or libcurl's error.
std::filesystem::path local_copy(const std::string& source, const std::filesystem::path& cache_dir);

}  // namespace ember_webdataset
