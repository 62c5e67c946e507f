#include <ember/support/image_list.h>

#include <ember/error.h>
#include <ember/support/table_file.h>

#include <algorithm>
#include <cctype>
#include <unordered_map>

namespace fs = std::filesystem;

namespace ember::image {

bool image_extension(const fs::path& p) {
  std::string ext = p.extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return ext == ".jpg" || ext == ".jpeg" || ext == ".png";
}

namespace {

// torchvision's make_dataset: for each class in order, its folder walked (sorted directories,
// sorted file names) for files with an image extension.
std::vector<LabelledImage> from_folder(const fs::path& root, std::vector<std::string>& classes, const std::string& key, const std::string& section) {
  if (!fs::is_directory(root))
    throw ember::RunError("image_folder: " + key + " " + root.string() + " is not a folder or a .csv/.jsonl list: give a folder of one "
                          "sub-folder per class, or a list of path and label");
  if (classes.empty()) {
    for (const auto& e : fs::directory_iterator(root))
      if (e.is_directory()) classes.push_back(e.path().filename().string());
    std::sort(classes.begin(), classes.end());  // torchvision: sorted(entry.name ...)
    if (classes.empty()) throw ember::RunError("image_folder: " + root.string() + " has no class sub-folders: put each class's images in <root>/<class>/");
  } else {
    for (const auto& e : fs::directory_iterator(root))
      if (e.is_directory() && std::find(classes.begin(), classes.end(), e.path().filename().string()) == classes.end())
        throw ember::RunError("image_folder: " + e.path().string() + " is a class that the training images do not have: every split "
                              "needs the training classes (the training root's sorted sub-folders, or [" + section + "] classes)");
  }
  std::vector<LabelledImage> out;
  for (size_t c = 0; c < classes.size(); ++c) {
    const fs::path dir = root / classes[c];
    if (!fs::is_directory(dir)) continue;
    std::vector<std::string> dirs = {dir.string()};
    for (const auto& e : fs::recursive_directory_iterator(dir, fs::directory_options::follow_directory_symlink))
      if (e.is_directory()) dirs.push_back(e.path().string());
    std::sort(dirs.begin(), dirs.end());
    for (const auto& d : dirs) {
      std::vector<std::string> files;
      for (const auto& e : fs::directory_iterator(d))
        if (e.is_regular_file() && image_extension(e.path())) files.push_back(e.path().filename().string());
      std::sort(files.begin(), files.end());
      for (const auto& f : files) out.push_back({(fs::path(d) / f).string(), static_cast<int64_t>(c)});
    }
  }
  return out;
}

// A list of path and label in its order; paths relative to the list's folder. The training list
// defines the classes (ember::support::label_classes): when every label is an integer they are
// the class indices (classes "0".."max"), otherwise the sorted names, as torchvision sorts class
// folders.
std::vector<LabelledImage> from_list(const fs::path& list, std::vector<std::string>& classes, const std::string& key, const ImageListOptions& o) {
  const auto records = ember::support::read_table(
      list, {{o.path_column, o.section + ".path_column"}, {o.label_column, o.section + ".label_column", o.label_separator}});
  if (records.empty()) throw ember::RunError("image_folder: " + key + " " + list.string() + " lists no images");
  std::vector<std::vector<std::string>> names;
  for (const auto& r : records) names.push_back(ember::support::split_list(r.values[1], o.label_separator));
  const bool define = classes.empty();
  if (define) {
    std::vector<std::string> all;
    for (const auto& n : names) all.insert(all.end(), n.begin(), n.end());
    classes = ember::support::label_classes(all);
    if (classes.empty()) throw ember::RunError("image_folder: " + key + " " + list.string() + " names no label in its column " + o.label_column);
  }
  std::unordered_map<std::string, int64_t> label_of;
  for (size_t c = 0; c < classes.size(); ++c) label_of.emplace(classes[c], static_cast<int64_t>(c));
  std::vector<LabelledImage> out;
  const fs::path base = list.parent_path();
  for (size_t k = 0; k < records.size(); ++k) {
    const auto& r = records[k];
    LabelledImage image;
    const fs::path path = fs::path(r.values[0]).is_absolute() ? fs::path(r.values[0]) : base / r.values[0];
    image.path = path.string();
    for (const auto& name : names[k]) {
      const auto it = label_of.find(name);
      if (it == label_of.end())
        throw ember::RunError(list.string() + ":" + std::to_string(r.line) + ": label '" + name +
                              "' is not a class of the training list (every split uses the training list's classes, or [" + o.section + "] classes)");
      image.labels.push_back(it->second);
    }
    if (o.label_separator.empty()) {
      image.label = image.labels.front();
      image.labels.clear();
    } else {
      image.label = -1;
    }
    out.push_back(std::move(image));
  }
  return out;
}

}  // namespace

std::vector<LabelledImage> list_images(const fs::path& root, std::vector<std::string>& classes, const std::string& key, const ImageListOptions& options) {
  if (ember::support::is_table_file(root)) return from_list(root, classes, key, options);
  if (!options.label_separator.empty())
    throw ember::RunError("image_folder: " + key + " " + root.string() + " is a folder, where each image has one class: multilabel images need a "
                          ".csv or .jsonl list of path and labels");
  return from_folder(root, classes, key, options.section);
}

}  // namespace ember::image
