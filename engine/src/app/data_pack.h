// `engine data pack SOURCE OUT_DIR`: an image folder (torchvision's layout) or a CSV / JSONL list of
// path and label packed into WebDataset tar shards that the webdataset data plugin, webdataset's
// own reader and wids read: <key>.jpg|png (the file's bytes, not re-encoded) and <key>.cls (the class
// index), samples shuffled by a seed, shards cut by count and size, and OUT_DIR/<prefix>.json, the
// shard list (wids' format, with the sample counts and the class names).
#pragma once
#include <cstdint>
#include <ostream>
#include <string>

namespace ember::engine {

struct PackOptions {
  int64_t max_count = 10000;  // samples per shard (webdataset's ShardWriter maxcount)
  double max_mb = 1024;       // bytes per shard, in MB (its maxsize)
  bool shuffle = true;
  uint64_t seed = 0;
  std::string prefix;  // file names; empty = the source's name
};

// Returns the exit code; throws UsageError / RunError with the path for bad input.
int pack_images(const std::string& source, const std::string& out_dir, const PackOptions& options, std::ostream& out);

}  // namespace ember::engine
