#include "app/data_pack.h"

#include <ember/error.h>
#include <ember/support/image_decode.h>
#include <ember/support/image_list.h>

#include <archive.h>
#include <archive_entry.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <vector>

#include "config/run_config.h"

namespace fs = std::filesystem;

namespace ember::engine {

namespace {

// One shard being written: a pax tar (plain ustar headers unless a name needs more) under a
// temporary name, renamed once closed, so an interrupted pack never leaves a complete-looking shard.
class ShardFile {
 public:
  ShardFile(fs::path path) : path_(std::move(path)), partial_(path_.string() + ".partial"), a_(archive_write_new(), archive_write_free) {
    archive_write_set_format_pax_restricted(a_.get());
    if (archive_write_open_filename(a_.get(), partial_.c_str()) != ARCHIVE_OK)
      throw RunError("engine data pack: cannot write " + partial_.string() + ": " + error_text());
  }
  void add(const std::string& name, const std::string& bytes) {
    std::unique_ptr<archive_entry, void (*)(archive_entry*)> e(archive_entry_new(), archive_entry_free);
    archive_entry_set_pathname(e.get(), name.c_str());
    archive_entry_set_size(e.get(), static_cast<la_int64_t>(bytes.size()));
    archive_entry_set_filetype(e.get(), AE_IFREG);
    archive_entry_set_perm(e.get(), 0444);
    archive_entry_set_mtime(e.get(), 0, 0);  // the same input packs to the same bytes
    if (archive_write_header(a_.get(), e.get()) != ARCHIVE_OK ||
        archive_write_data(a_.get(), bytes.data(), bytes.size()) != static_cast<la_ssize_t>(bytes.size()))
      throw RunError("engine data pack: writing " + partial_.string() + " failed: " + error_text());
    bytes_ += static_cast<int64_t>(bytes.size()) + 1024;  // the data and about a header's worth
  }
  // libarchive's text may be null (then appending it would crash).
  std::string error_text() const {
    const char* e = archive_error_string(a_.get());
    return e != nullptr ? e : "libarchive gave no reason (is the disk full?)";
  }
  void close() {
    if (archive_write_close(a_.get()) != ARCHIVE_OK)
      throw RunError("engine data pack: writing " + partial_.string() + " failed: " + error_text());
    std::error_code ec;
    fs::rename(partial_, path_, ec);
    if (ec) throw RunError("engine data pack: cannot move " + partial_.string() + " to " + path_.string() + ": " + ec.message());
  }
  int64_t bytes() const { return bytes_; }

 private:
  fs::path path_, partial_;
  std::unique_ptr<archive, int (*)(archive*)> a_;
  int64_t bytes_ = 0;
};

std::string zero_padded(int64_t n, size_t width) {
  std::string s = std::to_string(n);
  return s.size() < width ? std::string(width - s.size(), '0') + s : s;
}

}  // namespace

int pack_images(const std::string& source, const std::string& out_dir, const PackOptions& o, std::ostream& out) {
  if (o.max_count < 1) throw UsageError("engine data pack: --max-count " + std::to_string(o.max_count) + ": give 1 or more samples per shard");
  if (!(o.max_mb > 0)) throw UsageError("engine data pack: --max-mb must be more than 0");
  if (!fs::exists(source)) throw UsageError("engine data pack: " + source + " does not exist: give an image folder (<root>/<class>/*.jpg|png) or a .csv/.jsonl list");
  std::vector<std::string> classes;
  auto images = ember::image::list_images(source, classes, "SOURCE");
  if (images.empty()) throw RunError("engine data pack: no .jpg, .jpeg or .png file in " + source);
  const std::string prefix = !o.prefix.empty() ? o.prefix : fs::path(source).filename().replace_extension().string();
  fs::create_directories(out_dir);
  for (const auto& e : fs::directory_iterator(out_dir))
    if (e.path().filename().string().rfind(prefix + "-", 0) == 0 || e.path().filename() == prefix + ".json")
      throw UsageError("engine data pack: " + out_dir + " already holds " + e.path().filename().string() +
                       ": pack into an empty folder, or choose another --prefix");
  if (o.shuffle) {  // Fisher-Yates on a seeded mt19937_64: the same order on every machine
    std::mt19937_64 rng(o.seed);
    for (size_t i = images.size(); i > 1; --i) std::swap(images[i - 1], images[static_cast<size_t>(rng() % i)]);
  }
  const size_t width = std::max<size_t>(6, std::to_string(images.size()).size());
  nlohmann::json shardlist = nlohmann::json::array();
  std::unique_ptr<ShardFile> shard;
  int64_t in_shard = 0, total_bytes = 0;
  std::string shard_name;
  auto finish = [&] {
    if (!shard) return;
    shard->close();
    total_bytes += shard->bytes();
    shardlist.push_back({{"url", shard_name}, {"nsamples", in_shard}});
    shard.reset();
  };
  const auto max_bytes = static_cast<int64_t>(o.max_mb * 1024 * 1024);
  for (size_t i = 0; i < images.size(); ++i) {
    const auto& image = images[i];
    const std::string bytes = ember::image::read_file(image.path);
    const auto info = ember::image::probe_image(bytes, image.path);  // a file that is not an image stops here, named
    if (shard && (in_shard >= o.max_count || shard->bytes() + static_cast<int64_t>(bytes.size()) > max_bytes)) finish();
    if (!shard) {
      shard_name = prefix + "-" + zero_padded(static_cast<int64_t>(shardlist.size()), 6) + ".tar";
      shard = std::make_unique<ShardFile>(fs::path(out_dir) / shard_name);
      in_shard = 0;
    }
    const std::string key = zero_padded(static_cast<int64_t>(i), width);
    shard->add(key + (info.jpeg ? ".jpg" : ".png"), bytes);
    shard->add(key + ".cls", std::to_string(image.label));
    ++in_shard;
  }
  finish();
  // The shard list last (written whole, then renamed): its presence says the shards are complete.
  const nlohmann::json list = {{"__kind__", "wids-shard-index-v1"}, {"wids_version", 1}, {"name", prefix}, {"shardlist", shardlist}, {"classes", classes}};
  const fs::path json = fs::path(out_dir) / (prefix + ".json"), tmp = json.string() + ".partial";
  {
    std::ofstream f(tmp);
    f << list.dump(1) << '\n';
    if (!f.flush()) throw RunError("engine data pack: cannot write " + tmp.string());
  }
  fs::rename(tmp, json);
  char size[32];
  std::snprintf(size, sizeof size, "%.1f", static_cast<double>(total_bytes) / (1024.0 * 1024.0));
  out << "packed " << images.size() << " images of " << classes.size() << " classes into " << shardlist.size() << " shards (" << size
      << " MB) in " << out_dir << "; " << json.string() << " lists them\n";
  return 0;
}

}  // namespace ember::engine
