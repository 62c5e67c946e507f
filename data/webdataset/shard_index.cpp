#include "shard_index.h"

#include <ember/error.h>

#include <archive.h>
#include <archive_entry.h>
#include <zlib.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <vector>

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

// libarchive's error text and filter name, which may be null (a failed bid sets no text): a null
// char* appended to a message would crash the reader.
const char* error_text(archive* a) {
  const char* e = archive_error_string(a);
  return e != nullptr ? e : "libarchive gave no reason";
}
const char* filter_text(archive* a) {
  const char* f = archive_filter_name(a, 0);
  return f != nullptr ? f : "unknown filter";
}

struct Members {
  std::string key;
  std::vector<std::pair<std::string, MemberSpan>> by_extension;
};

}  // namespace

ShardIndex index_shard(const std::string& path, const std::string& name, const std::vector<FieldSpec>& fields, bool skip_incomplete) {
  std::unique_ptr<archive, int (*)(archive*)> a(archive_read_new(), archive_read_free);
  archive_read_support_format_tar(a.get());
  archive_read_support_filter_all(a.get());  // to name a compressed shard rather than call it "not a tar"
  // (A compressed shard cut short within its first block fails here too: "truncated gzip input".)
  if (archive_read_open_filename(a.get(), path.c_str(), 1 << 16) != ARCHIVE_OK)
    throw ember::RunError("webdataset: shard " + name + " is not a readable tar file (" + error_text(a.get()) +
                          "): write shards with webdataset's ShardWriter or `engine data pack`");
  ShardIndex out;
  // The filter is known once the file is open (libarchive bids on its first bytes).
  if (archive_filter_code(a.get(), 0) != ARCHIVE_FILTER_NONE) {
    out.compression = filter_text(a.get());
    return out;
  }
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
    throw ember::RunError("webdataset: shard " + name + " is not a readable tar file (" + error_text(a.get()) +
                          "): write shards with webdataset's ShardWriter or `engine data pack`");
  close_sample();
  return out;
}

namespace {

ember::RunError cut_short(const std::string& name, const std::string& filter, const std::string& why) {
  return ember::RunError("webdataset: shard " + name + " is corrupt or cut short (" + filter + ": " + why + ")");
}

ember::RunError write_failed(const std::string& target) {
  return ember::RunError("webdataset: writing " + target + " failed (" + std::strerror(errno) + "): is data.cache_dir's disk full?");
}

}  // namespace

void decompress_shard(const std::string& path, const std::string& target, const std::string& name) {
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> out(std::fopen(target.c_str(), "wb"), std::fclose);
  if (!out) throw ember::RunError("webdataset: cannot write " + target + " to decompress shard " + name + ": " + std::strerror(errno) + " (set data.cache_dir to a writable folder)");
  std::vector<char> buffer(1 << 20);
  auto write = [&](size_t n) {
    if (std::fwrite(buffer.data(), 1, n, out.get()) != n) throw write_failed(target);
  };
  std::unique_ptr<archive, int (*)(archive*)> a(archive_read_new(), archive_read_free);
  archive_read_support_filter_all(a.get());
  archive_read_support_format_raw(a.get());  // the decompressed stream as it is, whatever it holds
  archive_entry* entry = nullptr;
  if (archive_read_open_filename(a.get(), path.c_str(), 1 << 16) != ARCHIVE_OK || archive_read_next_header(a.get(), &entry) != ARCHIVE_OK)
    throw ember::RunError("webdataset: cannot decompress shard " + name + " (" + error_text(a.get()) + ")");
  if (archive_filter_code(a.get(), 0) == ARCHIVE_FILTER_GZIP) {
    // zlib rather than libarchive for gzip: libarchive skips the trailer's CRC-32 and length, and
    // a corrupt shard must not train on wrong bytes. Concatenated members are read as gzip does.
    a.reset();
    gzFile gz = gzopen(path.c_str(), "rb");
    if (gz == nullptr) throw ember::RunError("webdataset: cannot open shard " + name + ": " + std::strerror(errno));
    std::unique_ptr<gzFile_s, int (*)(gzFile)> closer(gz, gzclose);
    while (true) {
      const int n = gzread(gz, buffer.data(), static_cast<unsigned>(buffer.size()));
      int code = Z_OK;
      if (n < 0) throw cut_short(name, "gzip", gzerror(gz, &code));
      if (n == 0) {
        // gzread ends quietly where the file ends; Z_BUF_ERROR says it ended inside a stream.
        gzerror(gz, &code);
        if (code == Z_BUF_ERROR) throw cut_short(name, "gzip", "the file ends inside the compressed stream");
        break;
      }
      write(static_cast<size_t>(n));
    }
  } else {
    while (true) {
      const la_ssize_t n = archive_read_data(a.get(), buffer.data(), buffer.size());
      if (n < 0) throw cut_short(name, filter_text(a.get()), error_text(a.get()));
      if (n == 0) break;
      write(static_cast<size_t>(n));
    }
  }
  if (std::fflush(out.get()) != 0 || ::fsync(fileno(out.get())) != 0) throw write_failed(target);
}

}  // namespace ember_webdataset
