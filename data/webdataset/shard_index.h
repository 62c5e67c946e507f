// The samples of one uncompressed tar shard in WebDataset's convention: files whose names share a
// key (the name up to the first dot of its last path component: "train/0001.jpg" and
// "train/0001.cls" are sample "train/0001", fields "jpg" and "cls") and follow one another form
// one sample. Only the headers are read (libarchive), so a shard is indexed without reading its
// data; a sample's fields are later read with pread at the offsets kept here.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace ember_webdataset {

// One batch tensor of the sample: the member with the first of `extensions` the sample has.
struct FieldSpec {
  std::vector<std::string> extensions;  // lower case, without the dot: {"jpg", "jpeg", "png"}
  std::string text;                     // as configured: "jpg;jpeg;png"
};

struct MemberSpan {
  int64_t offset = 0, size = 0;  // of the member's data in the tar file
  std::string extension;         // the one found
};

struct IndexedSample {
  std::string key;
  std::vector<MemberSpan> fields;  // one per FieldSpec
};

struct ShardIndex {
  // Set when the file is a compressed tar (libarchive's name of its filter: "gzip", "bzip2", "xz",
  // "zstd"...): nothing is indexed then; decompress_shard makes a copy that can be.
  std::string compression;
  std::vector<IndexedSample> samples;
  int64_t incomplete = 0;      // samples left out for a missing field (skip_incomplete)
  std::string first_incomplete;
};

// Indexes the tar file at `path`; `name` (the shard as listed) opens error messages. A sample
// without one of `fields` stops with an ember::RunError naming the shard, the key and the field,
// or (skip_incomplete) is left out and counted. A compressed tar is only named (`compression`): its
// members cannot be read at their offsets.
ShardIndex index_shard(const std::string& path, const std::string& name, const std::vector<FieldSpec>& fields, bool skip_incomplete);

// Writes the decompressed bytes of the file at `path` (any filter libarchive reads: gzip, bzip2,
// xz, zstd, lz4...) to `target`, flushed to disk. A corrupt or truncated stream throws an
// ember::RunError naming the shard as `name`; `target` may then hold part of the data.
void decompress_shard(const std::string& path, const std::string& target, const std::string& name);

// Splits a member name into WebDataset's key and extension ("a/b/0001.seg.png" -> "a/b/0001",
// "seg.png"); false when the last component has no dot.
bool split_member_name(const std::string& name, std::string* key, std::string* extension);

}  // namespace ember_webdataset
