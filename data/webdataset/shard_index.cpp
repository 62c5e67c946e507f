#include "shard_index.h"

#include <ember/error.h>

#include <archive.h>
#include <archive_entry.h>

#include <algorithm>
#include <memory>

namespace ember_webdataset {

bool split_member_name(const std::string& name, std::string* key, std::string* extension) {
  const size_t slash = name.rfind('/');
  const size_t start = slash == std::string::npos ? 0 : slash + 1;
  const size_t dot = name.find('.', start);
  if (dot == std::string::npos || dot == start) return false;
  *key = name.substr(0, dot);
  *extension = name.substr(dot + 1);
  std::transform(extension->begin(), extension->end(), extension->begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return true;
}

namespace {

struct Members {
  std::string key;
  std::vector<std::pair<std::string, MemberSpan>> by_extension;
};

}  // namespace

ShardIndex index_shard(const std::string& path, const std::string& name, const std::vector<FieldSpec>& fields, bool skip_incomplete) {
  std::unique_ptr<archive, int (*)(archive*)> a(archive_read_new(), archive_read_free);
  archive_read_support_format_tar(a.get());
  archive_read_support_filter_all(a.get());  // to name a compressed shard rather than call it "not a tar"
  if (archive_read_open_filename(a.get(), path.c_str(), 1 << 16) != ARCHIVE_OK)
    throw ember::RunError("webdataset: shard " + name + " is not a readable tar file (" + archive_error_string(a.get()) +
                          "): write shards with webdataset's ShardWriter or `engine data pack`");
  ShardIndex out;
  Members current;
  auto close_sample = [&] {
    if (current.key.empty()) return;
    IndexedSample sample{current.key, {}};
    for (const auto& field : fields) {
      const MemberSpan* found = nullptr;
      for (const auto& ext : field.extensions)
        for (const auto& [e, span] : current.by_extension)
          if (!found && e == ext) found = &span;
      if (found == nullptr) {
        if (!skip_incomplete)
          throw ember::RunError("webdataset: shard " + name + ": sample '" + current.key + "' has no ." + field.text +
                                " member (fields come from data.fields; set data.incomplete_samples = \"skip\" to leave such samples out)");
        if (out.incomplete++ == 0) out.first_incomplete = name + ":" + current.key;
        sample.fields.clear();
        break;
      }
      sample.fields.push_back(*found);
    }
    if (sample.fields.size() == fields.size()) out.samples.push_back(std::move(sample));
    current = Members{};
  };
  archive_entry* entry = nullptr;
  int rc;
  while ((rc = archive_read_next_header(a.get(), &entry)) == ARCHIVE_OK) {
    if (archive_filter_code(a.get(), 0) != ARCHIVE_FILTER_NONE)
      throw ember::RunError("webdataset: shard " + name + " is compressed (" + archive_filter_name(a.get(), 0) +
                            "): samples are read at random, which needs an uncompressed tar (decompress it, e.g. gunzip)");
    if (archive_entry_filetype(entry) != AE_IFREG) continue;
    const std::string member = archive_entry_pathname(entry);
    std::string key, extension;
    // WebDataset leaves out members without an extension and "__...__" metadata alike.
    if (!split_member_name(member, &key, &extension) || member.rfind("__", 0) == 0) continue;
    if (key != current.key) close_sample();
    current.key = key;
    // The data starts where libarchive stopped reading: right after this member's headers.
    current.by_extension.push_back({extension, {archive_filter_bytes(a.get(), 0), archive_entry_size(entry), extension}});
  }
  if (rc != ARCHIVE_EOF)
    throw ember::RunError("webdataset: shard " + name + " is not a readable tar file (" + archive_error_string(a.get()) +
                          "): write shards with webdataset's ShardWriter or `engine data pack`");
  close_sample();
  return out;
}

}  // namespace ember_webdataset
