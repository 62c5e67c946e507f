// webdataset: samples stored in WebDataset's tar shards (files of one sample share a key:
// 000001.jpg + 000001.cls), as webdataset's ShardWriter, MosaicML-style pipelines and `engine data
// pack` write them. Shards are local files, brace ranges, globs, HTTP(S) URLs (downloaded once
// into data.cache_dir) or JSON shard lists, plain or compressed tars (gzip, xz, zstd...: decompressed
// once into data.cache_dir, as random access needs). Each shard's tar headers are indexed (libarchive), so
// any sample can be read at random: the engine's loader then orders every epoch shard by shard
// (ember::ISampleGroups: the shards permuted by seed and epoch, the samples of data.shuffle_groups
// shards shuffled together, each rank one contiguous part), which makes the order the same on any
// number of ranks and a mid-epoch resume exact. Fields (data.fields, webdataset's to_tuple) are
// decoded by extension: JPEG / PNG through Ember::image with torchvision's ImageNet transforms,
// .cls / .cls2 / .index / .label as integer classes, .npy as tensors.
#include <ember/data.h>
#include <ember/error.h>
#include <ember/plugin.h>
#include <ember/predict.h>
#include <ember/sample_groups.h>
#include <ember/support/image_transforms.h>
#include <ember/support/npy.h>
#include <ember/trainer.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "shard_index.h"
#include "shard_source.h"

namespace fs = std::filesystem;
using namespace ember_webdataset;

namespace {

constexpr EmberConfigKey kKeys[] = {
    ember::key::StringList("train", nullptr, "Training shards: .tar files, brace ranges (\"shards/train-{000000..000099}.tar\"), globs, http(s):// URLs, or a .json shard list ({\"shardlist\": [{\"url\": ..., \"nsamples\": N}]})."),
    ember::key::StringList("val", "[]", "Validation shards (as train); empty = no validation split."),
    ember::key::StringList("test", "[]", "Test shards (as train); empty = no test split."),
    ember::key::StringList("fields", "[\"jpg;jpeg;png\", \"cls\"]", "The batch's tensors, in order (webdataset's to_tuple): each the member with the first of its ;-separated extensions: jpg/jpeg/png = an image (the transform keys below), cls/cls2/index/label = an integer class, npy = a NumPy array (the same shape in every sample)."),
    ember::key::String("cache_dir", "\"\"", "Where http(s) shards are downloaded to and compressed shards decompressed to (once; reused by later runs); empty = $EMBER_CACHE/webdataset, else ~/.cache/ember/webdataset."),
    ember::key::Float("cache_limit_gb", "0.0", "Keep at most this many GB of downloaded and decompressed shards: the least recently used go (and are fetched again when needed); 0 = keep every shard.").at_least(0.0),
    ember::key::String("incomplete_samples", "\"stop\"", "A sample without one of the fields: stop (one line naming the shard and key) or skip (left out, counted in the log).").choices("stop|skip"),
    EMBER_IMAGE_TRANSFORM_KEYS,
};

enum class FieldKind { image, label, array };

struct Field {
  FieldSpec spec;
  FieldKind kind = FieldKind::image;
};

// One shard of a split: where it is, where its samples start in the split, and its index (built at
// setup, or on first use for a remote shard whose shard list gave its count).
struct Shard {
  ShardLocation location;
  int64_t first = 0, count = 0;
  std::once_flag indexed;
  std::exception_ptr error;
  std::mutex fetch;  // one download (or decompression) of a shard at a time
  std::string compression;  // found when indexed: then its samples are read from a decompressed copy
  std::vector<IndexedSample> samples;
};

class WebDataset final : public ember::IDataModule, public ember::ISampleGroups, public ember::ITrainerAware, public ember::IPredictionNames {
 public:
  WebDataset(ember::IHost& host, const ember::IConfig& cfg)
      : host_(host),
        section_(cfg.section()),
        transform_(cfg),
        skip_incomplete_(cfg.get_string("incomplete_samples") == "skip"),
        cache_limit_bytes_(static_cast<int64_t>(cfg.get_float("cache_limit_gb") * 1e9)) {
    const std::array<const char*, 3> keys = {"train", "val", "test"};
    for (size_t s = 0; s < 3; ++s) {
      lists_[s] = cfg.get_string_list(keys[s]);
      wheres_[s] = cfg.where(keys[s]);
    }
    for (const auto& text : cfg.get_string_list("fields")) {
      fields_.push_back(parse_field(text, cfg.where("fields")));
      specs_.push_back(fields_.back().spec);
    }
    if (fields_.empty()) throw ember::ConfigError(cfg.where("fields") + ": " + section_ + ".fields is empty: name the batch's tensors, e.g. [\"jpg;png\", \"cls\"]");
    const std::string dir = cfg.get_string("cache_dir");
    if (!dir.empty()) {
      cache_dir_ = dir;
    } else if (const char* cache = std::getenv("EMBER_CACHE"); cache != nullptr && *cache) {
      cache_dir_ = fs::path(cache) / "webdataset";
    } else {
      const char* home = std::getenv("HOME");
      cache_dir_ = fs::path(home != nullptr ? home : ".") / ".cache" / "ember" / "webdataset";
    }
    cache_ = std::make_unique<ShardCache>(cache_dir_, cache_limit_bytes_);
  }

  void setup(const ember::DataSetup& setup) override {
    seed_ = setup.seed;
    for (size_t s = 0; s < 3; ++s) {
      if (lists_[s].empty()) continue;
      // The training list's class names (a shard list from `engine data pack`) name predictions.
      const auto locations = expand_shards(lists_[s], wheres_[s], s == 0 ? &classes_ : nullptr);
      for (const auto& location : locations) {
        auto shard = std::make_unique<Shard>();
        shard->location = location;
        splits_[s].push_back(std::move(shard));
      }
      // Shards without a known count are indexed now (in parallel: a header walk each, a download
      // first for a remote one); the others when a batch first needs them.
      auto& shards = splits_[s];
      at::parallel_for(0, static_cast<int64_t>(shards.size()), 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i)
          if (shards[static_cast<size_t>(i)]->location.samples < 0) ensure_indexed(*shards[static_cast<size_t>(i)]);
      });
      int64_t first = 0;
      for (auto& shard : shards) {
        if (shard->error) std::rethrow_exception(shard->error);
        shard->first = first;
        shard->count = shard->location.samples >= 0 ? shard->location.samples : static_cast<int64_t>(shard->samples.size());
        first += shard->count;
      }
      sizes_[s] = first;
    }
    if (sizes_[0] == 0) throw ember::RunError("webdataset: the training shards (" + wheres_[0] + ") hold no complete sample");
    host_.log(ember::LogLevel::info, "webdataset: " + std::to_string(splits_[0].size()) + " train shards (" + std::to_string(sizes_[0]) +
                                         " samples), " + std::to_string(splits_[1].size()) + " val (" + std::to_string(sizes_[1]) + "), " +
                                         std::to_string(splits_[2].size()) + " test (" + std::to_string(sizes_[2]) + ")" +
                                         (incomplete_ > 0 ? ", " + std::to_string(incomplete_) + " incomplete samples skipped (first: " + first_incomplete_ + ")" : "") +
                                         (decompressed_ > 0 ? "; " + std::to_string(decompressed_.load()) + " compressed shards read from decompressed copies in " + cache_dir_.string() : "") +
                                         (any_remote() ? "; http(s) shards cached in " + cache_dir_.string() +
                                                             (cache_limit_bytes_ > 0 ? " (at most " + c10::str(static_cast<double>(cache_limit_bytes_) / 1e9) + " GB)" : "")
                                                       : ""));
  }

  int64_t size(ember::Split split) const override { return sizes_[static_cast<size_t>(split)]; }

  // The first sample sets each field's shape and dtype; the others are decoded on the intra-op
  // threads straight into the batch's tensors (no stacking pass after).
  ember::Batch get_batch(ember::Split split, const int64_t* indices, int64_t count) const override {
    const bool train = split == ember::Split::train;
    const int64_t epoch = trainer_ != nullptr ? trainer_->current_epoch() : 0;
    ember::Batch batch;
    batch.size = count;
    if (count == 0) return batch;
    std::vector<at::Tensor> first = decode_sample(split, indices[0], train, epoch);
    for (const auto& t : first) {
      std::vector<int64_t> shape = {count};
      shape.insert(shape.end(), t.sizes().begin(), t.sizes().end());
      batch.tensors.push_back(at::empty(shape, t.options()));
      batch.tensors.back()[0].copy_(t);
    }
    at::parallel_for(1, count, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const auto sample = decode_sample(split, indices[i], train, epoch);
        for (size_t f = 0; f < fields_.size(); ++f) {
          if (sample[f].sizes() != first[f].sizes() || sample[f].scalar_type() != first[f].scalar_type())
            throw ember::RunError("webdataset: " + sample_id(split, indices[i]) + ": field ." + fields_[f].spec.text + " has shape " +
                                  c10::str(sample[f].sizes()) + " (" + c10::toString(sample[f].scalar_type()) + "), another sample of the batch " +
                                  c10::str(first[f].sizes()) + " (" + c10::toString(first[f].scalar_type()) + "): every sample's array must have one shape and dtype");
          batch.tensors[f][i].copy_(sample[f]);
        }
      }
    });
    return batch;
  }

  int64_t sample_group(ember::Split split, int64_t index) const override { return shard_of(split, index); }

  void* query_interface(const char* iid) override {
    if (std::strcmp(iid, ember::kSampleGroupsIid) == 0) return static_cast<ember::ISampleGroups*>(this);
    if (std::strcmp(iid, ember::kTrainerAwareIid) == 0) return static_cast<ember::ITrainerAware*>(this);
    if (std::strcmp(iid, ember::kPredictionNamesIid) == 0) return static_cast<ember::IPredictionNames*>(this);
    return nullptr;
  }
  void attach_trainer(ember::ITrainer* trainer) override { trainer_ = trainer; }
  std::vector<std::string> class_names() const override { return classes_; }
  // Predictions name each sample by its shard and key.
  std::string sample_id(ember::Split split, int64_t index) const override {
    auto [shard, sample] = locate(split, index);
    return shard->location.source + ":" + sample->key;
  }

 private:
  static Field parse_field(const std::string& text, const std::string& where) {
    Field field;
    field.spec.text = text;
    size_t start = 0;
    while (start <= text.size()) {
      const size_t semi = text.find(';', start);
      std::string ext = text.substr(start, semi == std::string::npos ? std::string::npos : semi - start);
      std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
      if (!ext.empty() && ext[0] == '.') ext.erase(0, 1);
      if (!ext.empty()) field.spec.extensions.push_back(ext);
      if (semi == std::string::npos) break;
      start = semi + 1;
    }
    if (field.spec.extensions.empty()) throw ember::ConfigError(where + ": the field '" + text + "' names no extension");
    auto kind_of = [&](const std::string& ext) -> FieldKind {
      if (ext == "jpg" || ext == "jpeg" || ext == "png") return FieldKind::image;
      if (ext == "cls" || ext == "cls2" || ext == "index" || ext == "label") return FieldKind::label;
      if (ext == "npy") return FieldKind::array;
      throw ember::ConfigError(where + ": the field extension '" + ext + "' has no decoder: use jpg, jpeg, png (images), cls, cls2, index, label (integer classes) or npy (arrays)");
    };
    field.kind = kind_of(field.spec.extensions[0]);
    for (const auto& ext : field.spec.extensions)
      if (kind_of(ext) != field.kind)
        throw ember::ConfigError(where + ": the field '" + text + "' mixes kinds (images, classes, arrays): one kind per field");
    return field;
  }

  void ensure_indexed(Shard& shard) const {
    std::call_once(shard.indexed, [&] {
      try {
        auto index = index_shard(local_file(shard).string(), shard.location.source, specs_, skip_incomplete_);
        // A compressed shard cannot be read at its members' offsets: it is decompressed once into
        // the cache, and its copy indexed and read instead.
        if (!index.compression.empty()) {
          shard.compression = index.compression;
          index = index_shard(local_file(shard).string(), shard.location.source, specs_, skip_incomplete_);
          if (!index.compression.empty())
            throw ember::RunError("webdataset: shard " + shard.location.source + " is compressed twice (" + shard.compression + ", then " +
                                  index.compression + "): write it as a tar compressed once, or not at all");
          ++decompressed_;
        }
        if (shard.location.samples >= 0 && static_cast<int64_t>(index.samples.size()) != shard.location.samples)
          throw ember::RunError("webdataset: shard " + shard.location.source + " holds " + std::to_string(index.samples.size()) +
                                " complete samples, its shard list says " + std::to_string(shard.location.samples) + ": fix the list's \"nsamples\"");
        shard.samples = std::move(index.samples);
        std::lock_guard lock(count_mutex_);
        if (index.incomplete > 0 && incomplete_ == 0) first_incomplete_ = index.first_incomplete;
        incomplete_ += index.incomplete;
      } catch (...) {
        shard.error = std::current_exception();
      }
    });
    if (shard.error) std::rethrow_exception(shard.error);
  }

  bool any_remote() const {
    for (const auto& split : splits_)
      for (const auto& shard : split)
        if (is_remote(shard->location.source)) return true;
    return false;
  }



  int64_t shard_of(ember::Split split, int64_t index) const {
    const auto& shards = splits_[static_cast<size_t>(split)];
    if (index < 0 || index >= sizes_[static_cast<size_t>(split)]) throw ember::RunError("webdataset: sample index out of range (an engine bug)");
    const auto it = std::upper_bound(shards.begin(), shards.end(), index, [](int64_t i, const std::unique_ptr<Shard>& s) { return i < s->first; });
    return static_cast<int64_t>(it - shards.begin()) - 1;
  }

  std::pair<Shard*, const IndexedSample*> locate(ember::Split split, int64_t index) const {
    Shard& shard = *splits_[static_cast<size_t>(split)][static_cast<size_t>(shard_of(split, index))];
    ensure_indexed(shard);
    return {&shard, &shard.samples[static_cast<size_t>(index - shard.first)]};
  }

  // The shard's tar file: the path as listed, the cache's copy of a URL (fetched when missing), or
  // the cache's decompressed copy of a compressed shard (made when missing).
  fs::path local_file(Shard& shard) const {
    if (shard.compression.empty() && !is_remote(shard.location.source)) return shard.location.source;
    std::lock_guard lock(shard.fetch);
    return shard.compression.empty() ? cache_->fetch(shard.location.source) : cache_->decompressed(shard.location.source);
  }

  // The bytes [offset, offset + size) of the shard's file. A cached copy deleted meanwhile (by
  // the cache limit of another process sharing the folder) is fetched again, once.
  std::string read_span(Shard& shard, int64_t offset, int64_t size, const std::string& name) const {
    std::string bytes(static_cast<size_t>(size), '\0');
    fs::path path = local_file(shard);
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0 && errno == ENOENT && (is_remote(shard.location.source) || !shard.compression.empty())) {
      cache_->forget(path);
      path = local_file(shard);
      fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    }
    if (fd < 0) throw ember::RunError("webdataset: cannot open shard " + path.string() + " to read " + name + ": " + std::strerror(errno));
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::pread(fd, bytes.data() + done, bytes.size() - done, static_cast<off_t>(offset + static_cast<int64_t>(done)));
      if (n <= 0) {
        ::close(fd);
        throw ember::RunError("webdataset: " + name + " is cut short in " + path.string() + " (the shard changed since it was indexed?)");
      }
      done += static_cast<size_t>(n);
    }
    ::close(fd);
    return bytes;
  }

  // Every field of one sample, decoded. A sample's members lie next to each other in the tar, so
  // they are read with one pread of their span.
  std::vector<at::Tensor> decode_sample(ember::Split split, int64_t index, bool train, int64_t epoch) const {
    auto [shard, sample] = locate(split, index);
    int64_t begin = sample->fields[0].offset, end = begin;
    for (const auto& m : sample->fields) begin = std::min(begin, m.offset), end = std::max(end, m.offset + m.size);
    int64_t wanted = 0;
    for (const auto& m : sample->fields) wanted += m.size;
    const std::string name = shard->location.source + ":" + sample->key;
    // Unless members the fields do not use (a large .json, a video) lie between them: then each apart.
    const bool one_read = end - begin <= wanted + 65536;
    const std::string span = one_read ? read_span(*shard, begin, end - begin, name) : std::string();
    std::vector<at::Tensor> out;
    for (size_t f = 0; f < fields_.size(); ++f) {
      const MemberSpan& m = sample->fields[f];
      const std::string member = name + "." + m.extension;
      out.push_back(decode(one_read ? span.substr(static_cast<size_t>(m.offset - begin), static_cast<size_t>(m.size)) : read_span(*shard, m.offset, m.size, member),
                           member, f, train, index, epoch));
    }
    return out;
  }

  at::Tensor decode(const std::string& bytes, const std::string& name, size_t f, bool train, int64_t index, int64_t epoch) const {
    switch (fields_[f].kind) {
      case FieldKind::image: return transform_(bytes, name, train, seed_, index, epoch);
      case FieldKind::label: {
        // webdataset writes an integer as its decimal text.
        size_t begin = bytes.find_first_not_of(" \t\r\n"), end = bytes.find_last_not_of(" \t\r\n");
        const std::string text = begin == std::string::npos ? "" : bytes.substr(begin, end - begin + 1);
        char* stop = nullptr;
        const long long value = text.empty() ? 0 : std::strtoll(text.c_str(), &stop, 10);
        if (text.empty() || stop == nullptr || *stop != '\0')
          throw ember::RunError("webdataset: " + name + " holds '" + text.substr(0, 40) + "', not an integer class");
        return at::scalar_tensor(static_cast<int64_t>(value), at::kLong);
      }
      case FieldKind::array: return ember::support::read_npy(bytes.data(), bytes.size(), "webdataset: " + name);
    }
    return {};
  }

  ember::IHost& host_;
  std::string section_;
  ember::image::ImageTransform transform_;
  bool skip_incomplete_;
  std::vector<Field> fields_;
  std::vector<FieldSpec> specs_;  // the fields' extensions, what the shard index needs
  int64_t cache_limit_bytes_;
  fs::path cache_dir_;
  mutable std::atomic<int64_t> decompressed_{0};  // compressed shards indexed (their copies made or found)
  std::unique_ptr<ShardCache> cache_;
  std::array<std::vector<std::string>, 3> lists_;
  std::array<std::string, 3> wheres_;
  std::array<std::vector<std::unique_ptr<Shard>>, 3> splits_;
  std::array<int64_t, 3> sizes_{};
  uint64_t seed_ = 0;
  std::vector<std::string> classes_;
  mutable std::mutex count_mutex_;
  mutable int64_t incomplete_ = 0;
  mutable std::string first_incomplete_;
  ember::ITrainer* trainer_ = nullptr;
};

ember::IDataModule* make(ember::IHost& host, const ember::IConfig& cfg) { return new WebDataset(host, cfg); }

}  // namespace

EMBER_PLUGIN(ember::IDataModule, "webdataset", "0.1.0", "Apache-2.0",
             "Samples in WebDataset tar shards (local, globs, brace ranges, http(s) URLs, JSON shard lists), read at random from "
             "an index of each shard, ordered shard by shard; images through Ember::image, classes, .npy arrays.",
             EMBER_CONFIG_KEYS(kKeys), make)
