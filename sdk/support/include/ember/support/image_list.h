// Which images a split holds, as torchvision's ImageFolder finds them: a folder of one sub-folder
// per class (<root>/<class>/**/*.{jpg,jpeg,png}; classes in sorted order, files in sorted walk
// order), or a CSV / JSON Lines list of path and label (Ember::table_file). Part of Ember::image:
// the image_folder data plugin and `engine data pack` list images with it.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace ember::image {

struct LabelledImage {
  std::string path;
  int64_t label = 0;            // the class (single-label)
  std::vector<int64_t> labels;  // multi-label lists: every class the image has (maybe none); `label` is then -1
};

struct ImageListOptions {
  std::string path_column = "path", label_column = "label";  // lists: the columns to read
  std::string section = "data";                               // lists: the config section naming them, for messages
  // Non-empty: multi-label. A list's label field holds any number of classes separated by it (a
  // JSONL field may also be an array of them); a folder layout is refused (a folder is one class).
  std::string label_separator = {};
};

// True for .jpg, .jpeg and .png in any case.
bool image_extension(const std::filesystem::path& path);

// The images of `root` (a folder or a .csv / .jsonl list). With `classes` empty the root defines
// them (the sorted sub-folders; for a list, ember::support::label_classes of its labels: 0..max
// for dense integers, else sorted names) and they are stored there; otherwise every class must be one of them (a later split of
// the same classes, or the classes a config lists; multi-label: the classes of every label field). `key` names the setting in
// messages ("root", "val_root"). Throws
// ember::RunError naming the folder, file or list line.
std::vector<LabelledImage> list_images(const std::filesystem::path& root, std::vector<std::string>& classes, const std::string& key,
                                       const ImageListOptions& options = {});

}  // namespace ember::image
