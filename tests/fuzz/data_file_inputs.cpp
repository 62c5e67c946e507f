#include "data_file_inputs.h"

#include <ATen/ATen.h>

#include <ember/error.h>
#include <ember/support/image_decode.h>
#include <ember/support/npy.h>
#include <ember/support/table_file.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <vector>

#include "fuzz_inputs.h"
#include "scratch_folder.h"
#include "shard_index.h"

namespace ember::fuzz {
namespace {

namespace fs = std::filesystem;

const ScratchFolder& scratch() {
  static const ScratchFolder folder("data-files");
  return folder;
}

void touch(const at::Tensor& t) {
  if (t.numel() > 0) t.contiguous().view(at::kByte).sum();
}

void npy_one(std::string_view bytes, const std::string& name) {
  touch(ember::support::read_npy(bytes.data(), bytes.size(), name));
  // In place, as tensor_files reads a mapped file: the bytes at a 64-byte aligned address.
  const at::Tensor buffer = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  if (!bytes.empty()) std::memcpy(buffer.data_ptr(), bytes.data(), bytes.size());
  touch(ember::support::read_npy(static_cast<const char*>(buffer.const_data_ptr()), bytes.size(), name, [buffer] {}));
}

void image_one(std::string_view bytes) {
  const std::string data(bytes), path = (scratch().path() / "image").string();
  const auto info = ember::image::probe_image(data, path);
  for (int denominator : {1, 2}) {
    const at::Tensor pixels = ember::image::decode_image(data, path, denominator);
    const int64_t d = info.jpeg ? denominator : 1;
    const int64_t h = (info.height + d - 1) / d, w = (info.width + d - 1) / d;
    if (pixels.dim() != 3 || pixels.size(0) != h || pixels.size(1) != w || pixels.size(2) != 3)
      throw Finding("decoded " + std::string(c10::str(pixels.sizes())) + " where the header said " + std::to_string(info.height) + " x " +
                    std::to_string(info.width) + " (denominator " + std::to_string(denominator) + ")");
    touch(pixels);
  }
}

void table_one(std::string_view bytes, const char* name) {
  const fs::path path = scratch().write(name, bytes);
  // The label a list column, as a multilabel text_classification reads it (JSONL arrays joined).
  std::vector<std::string> labels;
  for (const auto& record : ember::support::read_table(path, {{"text", "text_column"}, {"label", "label_column", ";"}})) {
    if (record.values.size() != 2) throw Finding("a record with " + std::to_string(record.values.size()) + " values for 2 columns");
    if (record.line < 1) throw Finding("a record on line " + std::to_string(record.line));
    for (auto& l : ember::support::split_list(record.values[1], ";")) labels.push_back(std::move(l));
  }
  // The classes the labels define: every label among them once, and never more than 4 per
  // distinct label (integers as ids only when dense).
  const auto classes = ember::support::label_classes(labels);
  const std::set<std::string> distinct(labels.begin(), labels.end()), unique(classes.begin(), classes.end());
  if (unique.size() != classes.size()) throw Finding("label_classes gave a class twice");
  if (classes.size() > 4 * distinct.size()) throw Finding(std::to_string(classes.size()) + " classes for " + std::to_string(distinct.size()) + " labels");
  for (const auto& l : distinct)
    if (!unique.count(l)) throw Finding("label '" + l + "' is not among its classes");
}

void shard_one(std::string_view bytes, bool decompressed = false) {
  const fs::path path = scratch().write(decompressed ? "shard.decompressed.tar" : "shard.tar", bytes);
  const std::vector<ember_webdataset::FieldSpec> fields = {{{"npy"}, "npy"}, {{"cls"}, "cls"}};
  const auto index = ember_webdataset::index_shard(path.string(), path.string(), fields, /*skip_incomplete=*/true);
  // A compressed shard is decompressed as the plugin does it (into its cache), then indexed; a
  // compressed one inside is refused there, so one level is enough here.
  if (!index.compression.empty()) {
    if (!index.samples.empty()) throw Finding("a " + index.compression + " shard indexed with samples");
    if (decompressed) return;
    const fs::path copy = scratch().path() / "shard.copy.tar";
    ember_webdataset::decompress_shard(path.string(), copy.string(), path.string());
    std::ifstream in(copy, std::ios::binary);
    const std::string inside((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    shard_one(inside, /*decompressed=*/true);
    return;
  }
  for (const auto& sample : index.samples) {
    if (sample.fields.size() != fields.size()) throw Finding("sample '" + sample.key + "' indexed with another number of fields");
    for (const auto& m : sample.fields) {
      if (m.offset < 0 || m.size < 0 || static_cast<uint64_t>(m.offset) + static_cast<uint64_t>(m.size) > bytes.size())
        throw Finding("sample '" + sample.key + "' member ." + m.extension + " at [" + std::to_string(m.offset) + ", +" + std::to_string(m.size) +
                      ") lies outside the shard's " + std::to_string(bytes.size()) + " bytes");
      if (m.extension == "npy") npy_one(bytes.substr(static_cast<size_t>(m.offset), static_cast<size_t>(m.size)), path.string() + ":" + sample.key);
    }
  }
}

}  // namespace

bool data_file_one(std::string_view input, std::string* error) {
  return scratch().judge_by_first_byte(
      input, error, [](std::string_view in) { npy_one(in, (scratch().path() / "array.npy").string()); }, [](std::string_view in) { image_one(in); },
      [](std::string_view in) { table_one(in, "table.csv"); }, [](std::string_view in) { table_one(in, "table.jsonl"); },
      [](std::string_view in) { shard_one(in); });
}

}  // namespace ember::fuzz
