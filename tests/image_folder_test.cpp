// The image_folder data plugin and the resnet model (docs/data.md, README "Your own images"):
// decoding equals Pillow's pixels, the class order and samples equal torchvision's ImageFolder's,
// unreadable files are named, torchvision's resnet18 weights give torchvision's outputs, and
// Fashion-MNIST written as PNG files trains as the idx files do.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <ember/error.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include <nlohmann/json.hpp>

#include "checkpoint_support.h"
#include <ember/support/image_decode.h>
#include <ember/support/table_file.h>
#include "support.h"

using namespace ember::test;
namespace fs = std::filesystem;

namespace {

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The rows of predictions.csv: the first column (the sample id) and the rest split on commas.
std::vector<std::vector<std::string>> csv_rows(const fs::path& p) {
  std::ifstream in(p);
  std::vector<std::vector<std::string>> rows;
  for (std::string line; std::getline(in, line);) {
    std::vector<std::string> cells;
    std::istringstream l(line);
    for (std::string c; std::getline(l, c, ',');) cells.push_back(c);
    rows.push_back(cells);
  }
  return rows;
}

fs::path find_file(const fs::path& root, const std::string& name) {
  for (const auto& e : fs::recursive_directory_iterator(root))
    if (e.path().filename() == name) return e.path();
  return {};
}

std::string printed(const std::string& out, const std::string& name) {
  std::smatch m;
  if (!std::regex_search(out, m, std::regex("(^|\\n)" + name + "\\s+(\\S+)"))) return "missing";
  return m[2].str();
}

}  // namespace

#ifdef EMBER_TEST_PYTHON
// Every kind of file Pillow writes, decoded to the RGB pixels PIL's convert("RGB") gives: PNG
// exactly (gray replicated, alpha dropped, palettes expanded), JPEG within one level (Pillow bundles
// its own libjpeg-turbo; both decode with the same integer IDCT). A JPEG decoded at 1/2 size has
// libjpeg's rounded-up size.
TEST(ImageFolder, DecodesLikePillow) {
  TempDir dir("image_folder");
  auto r = run_process({EMBER_TEST_PYTHON, "-W", "ignore", (source_dir() / "tests/reference/image_folder.py").string(), "decode", "dec"}, dir.path(), {}, 300);
  ASSERT_EQ(r.exit_code, 0) << "scripts/setup.sh installs Pillow and torchvision into the LibTorch venv\n" << r.err;
  const auto sizes = nlohmann::json::parse(slurp(dir / "dec/decode.json"));
  ASSERT_GE(sizes.size(), 8u);
  for (const auto& [name, hw] : sizes.items()) {
    const std::string path = (dir / "dec" / name).string();
    const std::string bytes = ember::image::read_file(path);
    const auto info = ember::image::probe_image(bytes, path);
    EXPECT_EQ(info.height, hw[0].get<int64_t>()) << name;
    EXPECT_EQ(info.width, hw[1].get<int64_t>()) << name;
    const at::Tensor got = ember::image::decode_image(bytes, path);
    const std::string want_bytes = slurp(dir / "dec" / (name + ".rgb"));
    const at::Tensor want = at::from_blob(const_cast<char*>(want_bytes.data()), {hw[0].get<int64_t>(), hw[1].get<int64_t>(), 3}, at::kByte).clone();
    ASSERT_EQ(got.sizes(), want.sizes()) << name;
    const int64_t diff = (got.to(at::kInt) - want.to(at::kInt)).abs().max().item<int64_t>();
    if (info.jpeg) EXPECT_LE(diff, 1) << name;
    else EXPECT_EQ(diff, 0) << name;
    if (info.jpeg) {
      const at::Tensor half = ember::image::decode_image(bytes, path, 2);
      EXPECT_EQ(half.size(0), (info.height + 1) / 2) << name;
      EXPECT_EQ(half.size(1), (info.width + 1) / 2) << name;
    }
  }
}

// torchvision's ImageFolder order: classes sorted by name (digits, upper case, then lower case),
// each class's folder walked in sorted order, upper-case extensions included, other files left
// out. Ember's order shows in predictions.csv of the training split (its ids are the paths).
TEST(ImageFolder, ClassOrderAndSamplesAreTorchvisions) {
  TempDir dir("image_folder");
  auto r = run_process({EMBER_TEST_PYTHON, "-W", "ignore", (source_dir() / "tests/reference/image_folder.py").string(), "layout", "lay"}, dir.path(), {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto tv = nlohmann::json::parse(r.out);
  write_file(dir / "run.toml", R"([trainer]
accelerator = "cpu"
max_steps = 1
enable_progress_bar = false
enable_model_summary = false
num_sanity_val_steps = 0
[model]
name = "cnn"
in_channels = 3
image_size = 8
num_classes = 6
[data]
name = "image_folder"
root = "lay"
image_size = 8
resize = 8
shuffle = false
predict_split = "train"
)");
  run_engine_ok(dir, {"run.toml"});
  run_engine_ok(dir, {"predict", "--ckpt", "last", "run.toml"});
  const fs::path csv = find_file(dir.path(), "predictions.csv");
  ASSERT_FALSE(csv.empty());
  const auto rows = csv_rows(csv);
  ASSERT_EQ(rows.size(), tv["samples"].size() + 1) << slurp(csv);
  for (size_t i = 0; i < tv["samples"].size(); ++i) EXPECT_EQ(rows[i + 1][0], tv["samples"][i][0].get<std::string>()) << i;
  // The header names the classes in torchvision's order (prob_<class> columns).
  std::string header;
  for (const auto& c : rows[0]) header += c + ",";
  size_t at = 0;
  for (const auto& c : tv["classes"]) {
    const size_t found = header.find(c.get<std::string>(), at);
    EXPECT_NE(found, std::string::npos) << c << " in " << header;
    at = found;
  }
}

// torchvision's resnet18 (random weights, batch-norm statistics set) saved with safetensors: Ember's
// resnet loads it by name and predicts torchvision's probabilities on the same PNGs (no resize:
// the pixels, ImageNet normalisation and the network are compared).
TEST(ImageFolder, Resnet18WithTorchvisionWeightsPredictsTorchvisionsProbabilities) {
  TempDir dir("image_folder");
  auto r = run_process({EMBER_TEST_PYTHON, "-W", "ignore", (source_dir() / "tests/reference/image_folder.py").string(), "resnet", "rn"}, dir.path(), {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  write_file(dir / "run.toml", R"([trainer]
accelerator = "cpu"
enable_progress_bar = false
enable_model_summary = false
[model]
name = "resnet"
num_classes = 3
weights = "rn/resnet18.safetensors"
[data]
name = "image_folder"
root = "rn/images"
image_size = 32
resize = 32
augment = false
predict_split = "train"
)");
  auto p = run_engine_ok(dir, {"predict", "run.toml"});
  const auto want = nlohmann::json::parse(slurp(dir / "rn/probs.json"));
  const auto rows = csv_rows(find_file(dir.path(), "predictions.csv"));
  ASSERT_EQ(rows.size(), 7u);
  double worst = 0;
  for (size_t i = 1; i < rows.size(); ++i) {
    const std::string& rel = rows[i][0];
    ASSERT_TRUE(want.contains(rel)) << rel;
    const auto& probs = want[rel];
    ASSERT_EQ(rows[i].size(), probs.size() + 2) << "id, predicted class, 3 probabilities";
    for (size_t c = 0; c < probs.size(); ++c) worst = std::max(worst, std::abs(std::stod(rows[i][c + 2]) - probs[c].get<double>()));
  }
  EXPECT_LT(worst, 1e-5);
}

// Fashion-MNIST written as PNG files (3,000 training images, the 10,000 test images) trains the
// same CNN to the accuracy the idx files give, within noise (the images are the same pixels;
// image_folder hands them as RGB).
TEST(ImageFolder, FashionMnistAsPngFilesTrainsLikeTheIdxFiles) {
  TempDir dir("image_folder");
  auto r = run_process({EMBER_TEST_PYTHON, "-W", "ignore", (source_dir() / "tests/reference/image_folder.py").string(), "fmnist", "fm", "3000", "10000"},
                       dir.path(), {}, 600);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string common = R"([trainer]
accelerator = "cpu"
max_epochs = 2
enable_progress_bar = false
enable_model_summary = false
num_sanity_val_steps = 0
test_after_fit = true
test_ckpt = "current"
[optimizer]
name = "adam"
lr = 0.002
)";
  write_file(dir / "folder.toml", common + R"([model]
name = "cnn"
in_channels = 3
[data]
name = "image_folder"
root = "fm/train"
test_root = "fm/test"
image_size = 28
resize = 28
augment = false
mean = [0.2860, 0.2860, 0.2860]
std = [0.3530, 0.3530, 0.3530]
batch_size = 64
eval_batch_size = 500
num_workers = 2
)");
  write_file(dir / "idx.toml", common + R"([model]
name = "cnn"
[data]
name = "fashion_mnist"
val_split = 0.0
limit_train_samples = 3000
batch_size = 64
eval_batch_size = 500
)");
  auto folder = run_engine_ok(dir, {"folder.toml"}, 600), idx = run_engine_ok(dir, {"idx.toml"}, 600);
  const double a = std::stod(printed(folder.out, "test_acc")), b = std::stod(printed(idx.out, "test_acc"));
  EXPECT_GT(a, 0.7) << folder.out;
  EXPECT_NEAR(a, b, 0.03) << "image_folder " << a << " vs idx files " << b;
}

// configs/image_folder_resnet.toml trains as the README says: on a folder of two classes.
TEST(ImageFolder, TheReadmeConfigTrainsOnAFolder) {
  TempDir dir("image_folder");
  auto r = run_process({EMBER_TEST_PYTHON, "-W", "ignore", (source_dir() / "tests/reference/image_folder.py").string(), "resnet", "rn"}, dir.path(), {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  run_engine_ok(dir, {(source_dir() / "configs/image_folder_resnet.toml").string(), "--set", "data.root=\"rn/images\"", "--set", "model.num_classes=3",
                      "--set", "trainer.max_epochs=1", "--set", "data.image_size=32", "--set", "data.val_split=0.5", "--set", "trainer.enable_progress_bar=false"});
  EXPECT_FALSE(find_file(dir.path(), "val_confusion_matrix.csv").empty());
}

// Unreadable files: a header that is not an image stops the run naming the file, or is skipped
// and counted; data that breaks after a good header (a truncated JPEG) names the file when it is
// decoded, as Pillow's "image file is truncated" would.
TEST(ImageFolder, BadImagesNameTheirPath) {
  TempDir dir("image_folder");
  auto r = run_process({EMBER_TEST_PYTHON, "-W", "ignore", (source_dir() / "tests/reference/image_folder.py").string(), "decode", "dec"}, dir.path(), {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  fs::create_directories(dir / "imgs/a");
  fs::create_directories(dir / "imgs/b");
  fs::copy_file(dir / "dec/rgb.png", dir / "imgs/a/good.png");
  fs::copy_file(dir / "dec/gray.jpg", dir / "imgs/b/good.jpg");
  write_file(dir / "imgs/a/not_an_image.png", "hello");
  const std::string jpeg = slurp(dir / "dec/rgb.jpg");
  write_file(dir / "imgs/b/cut.jpg", jpeg.substr(0, jpeg.size() * 6 / 10));
  // A good JPEG whose header goes on past the 64 KiB the probe reads first (a 150 kB ICC profile
  // in APP2 segments): read whole then, and accepted.
  auto icc = run_process({EMBER_TEST_PYTHON, "-c",
                          "import sys; from PIL import Image; Image.new('RGB', (8, 8), (200, 30, 40)).save(sys.argv[1], icc_profile=bytes(150000))",
                          (dir / "imgs/b/big_header.jpg").string()},
                         dir.path(), {}, 120);
  ASSERT_EQ(icc.exit_code, 0) << icc.err;
  ASSERT_GT(fs::file_size(dir / "imgs/b/big_header.jpg"), 150000u);
  write_file(dir / "run.toml", R"([trainer]
accelerator = "cpu"
max_epochs = 1
enable_progress_bar = false
enable_model_summary = false
num_sanity_val_steps = 0
[model]
name = "cnn"
in_channels = 3
image_size = 8
num_classes = 2
[data]
name = "image_folder"
root = "imgs"
image_size = 8
batch_size = 8
)");
  auto stop = run_engine({"run.toml"}, dir.path(), {}, 60);
  EXPECT_NE(stop.exit_code, 0);
  EXPECT_NE(stop.err.find("imgs/a/not_an_image.png: neither a JPEG nor a PNG file"), std::string::npos) << stop.err;
  auto skip = run_engine({"run.toml", "--set", "data.bad_images=\"skip\""}, dir.path(), {}, 60);
  EXPECT_NE(skip.err.find("1 unreadable files skipped (first: imgs/a/not_an_image.png)"), std::string::npos) << skip.err;
  EXPECT_NE(skip.exit_code, 0) << "the truncated JPEG's header is fine, its data is not";
  EXPECT_NE(skip.err.find("imgs/b/cut.jpg: corrupt JPEG data"), std::string::npos) << skip.err;
}
// An image whose header claims more than Pillow's limit (2 x Image.MAX_IMAGE_PIXELS = 178,956,970
// pixels) is refused at its header, as Pillow refuses it, before gigabytes are allocated for its
// pixels: a PNG of 20,000 x 10,000 and a JPEG of 65,000 x 65,000, each a few hundred bytes (a
// small image's file with the size in its header changed). One under the limit still probes.
TEST(ImageFolder, DecompressionBombsAreRefusedAtTheHeader) {
  TempDir dir("image_bombs");
  auto r = run_process({EMBER_TEST_PYTHON, "-c", R"(
import io, struct, sys, zlib
from PIL import Image
def png(w, h):
    buf = io.BytesIO(); Image.new("RGB", (4, 4)).save(buf, "PNG"); b = bytearray(buf.getvalue())
    ihdr = struct.pack(">II", w, h) + bytes(b[24:29])
    b[16:29] = ihdr; b[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return bytes(b)
def jpeg(w, h):
    buf = io.BytesIO(); Image.new("RGB", (8, 8)).save(buf, "JPEG"); b = bytearray(buf.getvalue())
    sof = b.find(b"\xff\xc0"); b[sof + 5:sof + 9] = struct.pack(">HH", h, w)
    return bytes(b)
out = sys.argv[1]
open(out + "/bomb.png", "wb").write(png(20000, 10000))
open(out + "/bomb.jpg", "wb").write(jpeg(65000, 65000))
open(out + "/large.png", "wb").write(png(13000, 13000))
)",
                        dir.path().string()},
                       dir.path(), {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const auto& [name, size] : std::vector<std::pair<std::string, std::string>>{{"bomb.png", "20000 x 10000"}, {"bomb.jpg", "65000 x 65000"}}) {
    const std::string path = (dir / name).string(), bytes = slurp(dir / name);
    const std::string want = path + ": " + size + " pixels, more than 178956970 (PIL refuses such an image too, as a decompression bomb; shrink it)";
    for (int step = 0; step < 2; ++step) {
      try {
        if (step == 0) ember::image::probe_image(bytes, path);
        else ember::image::decode_image(bytes, path);
        ADD_FAILURE() << name << " accepted (step " << step << ")";
      } catch (const ember::RunError& e) {
        EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
      }
    }
  }
  const auto large = ember::image::probe_image(slurp(dir / "large.png"), "large.png");
  EXPECT_EQ(large.width * large.height, 169000000);
}
// A list of path and label instead of a folder: a CSV with its own column names (paths relative
// to the list) and a JSONL with integer labels train exactly like the folder itself when they
// list its images in the same order; a label outside the training classes and a missing column
// are one line each, naming the file and line.
// The classes a training list's labels define (Ember::table_file's label_classes, shared with
// text_classification): dense integers are ids "0" .. the largest; sparse integers (codes) and
// integers written with a leading zero are names, the codes in numeric order, so a label of
// 999999999 is one class and not a billion; anything else is sorted names.
TEST(TableFile, LabelClassesAreIdsForDenseIntegersAndNamesOtherwise) {
  using ember::support::label_classes;
  using V = std::vector<std::string>;
  EXPECT_EQ(label_classes({"2", "10", "0", "2"}), (V{"0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10"}));
  EXPECT_EQ(label_classes({"1"}), (V{"0", "1"}));
  EXPECT_EQ(label_classes({"20417", "3", "999999999", "3"}), (V{"3", "20417", "999999999"}));
  EXPECT_EQ(label_classes({"007", "1"}), (V{"007", "1"}));
  EXPECT_EQ(label_classes({"dog", "cat", "10", "dog"}), (V{"10", "cat", "dog"}));
  EXPECT_EQ(label_classes({"1234567890", "1"}), (V{"1", "1234567890"})) << "ten digits: a name";
  EXPECT_TRUE(label_classes({}).empty());
}

// Multilabel images: `count` 16 x 16 PNGs, each colour channel lit (170) or not (40), each
// pixel's channels off by up to +-noise, listed with their colours in list.csv (a field
// "red;blue", "" for none) and list.jsonl (an array).
void write_colour_lists(const TempDir& dir, int count, int noise) {
  auto r = run_process({EMBER_TEST_PYTHON, "-c",
                        "import json, os, random, sys\n"
                        "count, noise = int(sys.argv[1]), int(sys.argv[2])\n"
                        "from PIL import Image\n"
                        "random.seed(1)\n"
                        "os.makedirs('img')\n"
                        "csv, jsonl = ['file,colours'], []\n"
                        "for i in range(count):\n"
                        "    on = [random.random() < 0.5 for _ in range(3)]\n"
                        "    im = Image.new('RGB', (16, 16))\n"
                        "    im.putdata([tuple((170 if b else 40) + random.randint(-noise, noise) for b in on) for _ in range(256)])\n"
                        "    im.save(f'img/{i:02d}.png')\n"
                        "    names = [n for n, b in zip(('red', 'green', 'blue'), on) if b]\n"
                        "    csv.append(f'img/{i:02d}.png,' + ';'.join(names))\n"
                        "    jsonl.append(json.dumps({'path': f'img/{i:02d}.png', 'label': names}))\n"
                        "open('list.csv', 'w').write('\\n'.join(csv) + '\\n')\n"
                        "open('list.jsonl', 'w').write('\\n'.join(jsonl) + '\\n')\n",
                        std::to_string(count), std::to_string(noise)},
                       dir.path(), {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.err;
}

// The run of those lists: `model` is the [model] table's keys, a quarter of the images validate
// with F1 and the per-class confusion matrices.
std::string colour_run(const std::string& model, int epochs, int batch_size) {
  return "[trainer]\naccelerator = \"cpu\"\ndeterministic = true\nmax_epochs = " + std::to_string(epochs) +
         "\nenable_progress_bar = false\nenable_model_summary = false\nnum_sanity_val_steps = 0\n[model]\n" + model +
         "num_classes = 3\ntask = \"multilabel\"\n"
         "[data]\nname = \"image_folder\"\nroot = \"list.csv\"\npath_column = \"file\"\nlabel_column = \"colours\"\nmultilabel = true\n"
         "image_size = 16\nbatch_size = " + std::to_string(batch_size) +
         "\nval_split = 0.25\n[metrics]\nnames = [\"f1\", \"confusion_matrix\"]\ntask = \"multilabel\"\nsplits = [\"val\"]\n";
}

// Multilabel lists (data.multilabel: a CSV field "red;blue" or a JSONL array; "" or [] for none)
// train resnet with task = "multilabel" (binary cross-entropy); the CSV and the JSONL list of the
// same labels train to the same weights, the per-class confusion matrices count every validation
// image, predictions are each class's probability, and mixed-up settings are one line.
TEST(ImageFolder, MultilabelListsTrainResnetWithBinaryCrossEntropy) {
  TempDir dir("image_folder");
  write_colour_lists(dir, 24, 0);
  write_file(dir / "run.toml", colour_run("name = \"resnet\"\nsmall_input = true\n", 2, 6));
  TempDir from_csv("image_folder"), from_jsonl("image_folder");
  for (const auto* d : {&from_csv, &from_jsonl}) fs::copy_file(dir / "run.toml", *d / "run.toml");
  auto c = run_engine_ok(from_csv, {"run.toml", "--set", "data.root=\"" + (dir / "list.csv").string() + "\""});
  EXPECT_NE(c.err.find("image_folder: 3 classes, 18 train, 6 val, 0 test images (multilabel)"), std::string::npos) << c.err;
  run_engine_ok(from_jsonl, {"run.toml", "--set", "data.root=\"" + (dir / "list.jsonl").string() + "\"", "--set", "data.path_column=\"path\"",
                             "--set", "data.label_column=\"label\""});
  EXPECT_EQ(max_weight_difference(last_checkpoint(from_csv), last_checkpoint(from_jsonl)), 0.0);
  const auto counts = read_label_counts(find_file(from_csv.path(), "val_confusion_matrix.csv"));
  ASSERT_EQ(counts.size(), 3u);
  for (const auto& [tn, fp, fn, tp] : counts) EXPECT_EQ(tn + fp + fn + tp, 6);
  auto p = run_engine_ok(from_csv, {"predict", "--ckpt", last_checkpoint(from_csv).string(), "run.toml", "--set",
                                    "data.root=\"" + (dir / "list.csv").string() + "\"", "--set", "data.predict_split=\"val\""});
  const auto rows = csv_rows(find_file(from_csv.path(), "predictions.csv"));
  ASSERT_EQ(rows.size(), 7u);
  EXPECT_EQ(rows[0], (std::vector<std::string>{"id", "out_blue", "out_green", "out_red"}));
  // Folders hold one class per image; single-label resnet on multilabel targets.
  auto folder = run_engine({"run.toml", "--set", "data.root=\"img\""}, dir.path(), {}, 60);
  EXPECT_NE(folder.exit_code, 0);
  EXPECT_NE(folder.err.find("image_folder: root img is a folder, where each image has one class: multilabel images need a .csv or .jsonl list"),
            std::string::npos) << folder.err;
  auto single = run_engine({"run.toml", "--set", "model.task=\"classification\""}, dir.path(), {}, 60);
  EXPECT_NE(single.exit_code, 0);
  EXPECT_NE(single.err.find("resnet: the targets [6, 3] are 0/1 per class (multilabel data): set [model] task = \"multilabel\""), std::string::npos)
      << single.err;
}

// cnn takes multilabel lists too (task = "multilabel"): it learns which colour channels are lit
// (val F1 over the three labels above 0.9 after a few epochs, every matrix counting every
// validation image), predicts each class's probability, and the settings that do not fit
// multilabel targets are one line each.
TEST(ImageFolder, MultilabelListsTrainCnnToTellEachColour) {
  TempDir dir("image_folder");
  write_colour_lists(dir, 64, 30);
  write_file(dir / "run.toml", colour_run("name = \"cnn\"\nin_channels = 3\nimage_size = 16\nhidden = 32\n", 6, 8));
  run_engine_ok(dir, {"run.toml"});
  const auto metrics = csv_rows(find_file(dir.path(), "metrics.csv"));
  ASSERT_GE(metrics.size(), 2u);
  const auto f1_at = std::find(metrics[0].begin(), metrics[0].end(), "val_f1") - metrics[0].begin();
  ASSERT_LT(static_cast<size_t>(f1_at), metrics[0].size()) << "no val_f1 column";
  std::vector<double> f1;
  for (size_t i = 1; i < metrics.size(); ++i)
    if (static_cast<size_t>(f1_at) < metrics[i].size() && !metrics[i][f1_at].empty()) f1.push_back(std::stod(metrics[i][f1_at]));
  ASSERT_EQ(f1.size(), 6u);
  EXPECT_GT(f1.back(), 0.9) << "cnn did not learn the colours: val F1 per epoch ends at " << f1.back();
  const auto counts = read_label_counts(find_file(dir.path(), "val_confusion_matrix.csv"));
  ASSERT_EQ(counts.size(), 3u);
  for (const auto& [tn, fp, fn, tp] : counts) EXPECT_EQ(tn + fp + fn + tp, 16);
  run_engine_ok(dir, {"predict", "--ckpt", last_checkpoint(dir).string(), "run.toml", "--set", "data.predict_split=\"val\""});
  const auto rows = csv_rows(find_file(dir.path(), "predictions.csv"));
  ASSERT_EQ(rows.size(), 17u);
  EXPECT_EQ(rows[0], (std::vector<std::string>{"id", "out_blue", "out_green", "out_red"}));
  for (size_t i = 1; i < rows.size(); ++i)
    for (size_t c = 1; c < rows[i].size(); ++c) {
      const double p = std::stod(rows[i][c]);
      EXPECT_TRUE(p >= 0.0 && p <= 1.0) << rows[i][c];
    }
  auto single = run_engine({"run.toml", "--set", "model.task=\"classification\""}, dir.path(), {}, 60);
  EXPECT_NE(single.exit_code, 0);
  EXPECT_NE(single.err.find("cnn: the targets [8, 3] are 0/1 per class (multilabel data): set [model] task = \"multilabel\""), std::string::npos)
      << single.err;
  auto smoothing = run_engine({"run.toml", "--set", "model.label_smoothing=0.1"}, dir.path(), {}, 60);
  EXPECT_NE(smoothing.exit_code, 0);
  EXPECT_NE(smoothing.err.find("model.label_smoothing = 0.1 smooths the single-label cross-entropy, and task = \"multilabel\" trains with binary "
                               "cross-entropy: remove the key"),
            std::string::npos)
      << smoothing.err;
}

// data.classes fixes the classes and their output order (a checkpoint's, a pretrained head's):
// the folder's images take the listed order, a checkpoint trained so is refused in one line by
// data in the sorted order and accepted with the same list, and a class folder outside the list,
// or a class listed twice, is one line.
TEST(ImageFolder, ClassesSetTheOutputOrderAndACheckpointKeepsIt) {
  TempDir dir("image_folder");
  auto r = run_process({EMBER_TEST_PYTHON, "-c",
                        "import os\n"
                        "from PIL import Image\n"
                        "for c, colour in (('a', (200, 20, 20)), ('b', (20, 20, 200))):\n"
                        "    os.makedirs(f'img/{c}')\n"
                        "    for i in range(4): Image.new('RGB', (16, 16), colour).save(f'img/{c}/{i}.png')\n"},
                       dir.path(), {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  write_file(dir / "run.toml", R"([trainer]
accelerator = "cpu"
max_epochs = 6
enable_progress_bar = false
enable_model_summary = false
num_sanity_val_steps = 0
[model]
name = "cnn"
in_channels = 3
image_size = 16
num_classes = 2
[data]
name = "image_folder"
root = "img"
classes = ["b", "a"]
image_size = 16
batch_size = 4
predict_split = "train"
)");
  run_engine_ok(dir, {"run.toml"});
  const fs::path ckpt = last_checkpoint(dir);
  run_engine_ok(dir, {"predict", "--ckpt", ckpt.string(), "run.toml"});
  const auto rows = csv_rows(find_file(dir.path(), "predictions.csv"));
  ASSERT_EQ(rows.size(), 9u);
  EXPECT_EQ(rows[0], (std::vector<std::string>{"id", "prediction", "prob_b", "prob_a"})) << "the listed order, not the sorted one";
  // The images come class by class in the listed order (b's four first, as torchvision walks its
  // classes), and each is predicted as its own folder's class.
  for (size_t i = 1; i < rows.size(); ++i) EXPECT_EQ(rows[i][1], i <= 4 ? "b" : "a") << i;
  auto sorted = run_engine({"predict", "--ckpt", ckpt.string(), "run.toml", "--set", "data.classes=[]"}, dir.path(), {}, 60);
  EXPECT_EQ(sorted.exit_code, 1);
  EXPECT_NE(sorted.err.find("was trained on 2 classes (b, a) and the image_folder data names 2 (a, b): output 0 is 'b' there and 'a' here"),
            std::string::npos)
      << sorted.err;
  fs::create_directories(dir / "img/c");
  fs::copy_file(dir / "img/a/0.png", dir / "img/c/0.png");
  auto outside = run_engine({"predict", "--ckpt", ckpt.string(), "run.toml"}, dir.path(), {}, 60);
  EXPECT_NE(outside.exit_code, 0);
  EXPECT_NE(outside.err.find("img/c is a class that the training images do not have: every split needs the training classes (the training "
                             "root's sorted sub-folders, or [data] classes)"),
            std::string::npos)
      << outside.err;
  auto twice = run_engine({"run.toml", "--set", "data.classes=[\"a\", \"b\", \"a\"]"}, dir.path(), {}, 60);
  EXPECT_EQ(twice.exit_code, 2);
  EXPECT_NE(twice.err.find("data.classes names \"a\" twice (outputs 0 and 2): list each class once, in output order"), std::string::npos)
      << twice.err;
}

TEST(ImageFolder, ListsOfPathAndLabelTrainLikeTheFolder) {
  TempDir dir("image_folder");
  auto r = run_process({EMBER_TEST_PYTHON, "-W", "ignore", (source_dir() / "tests/reference/image_folder.py").string(), "resnet", "rn"}, dir.path(), {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // The folder's images in torchvision's order (sorted classes, sorted files).
  std::vector<std::pair<std::string, int>> images;
  const std::vector<std::string> classes = {"a", "b", "c"};
  for (int c = 0; c < 3; ++c) {
    std::vector<std::string> files;
    for (const auto& e : fs::directory_iterator(dir / "rn/images" / classes[c])) files.push_back(e.path().filename().string());
    std::sort(files.begin(), files.end());
    for (const auto& f : files) images.emplace_back(classes[c] + "/" + f, c);
  }
  std::string csv = "id,file,kind\n", jsonl;
  for (size_t i = 0; i < images.size(); ++i) {
    csv += std::to_string(i) + "," + images[i].first + "," + classes[images[i].second] + "\n";
    jsonl += "{\"path\": \"images/" + images[i].first + "\", \"label\": " + std::to_string(images[i].second) + "}\n";
  }
  write_file(dir / "rn/images/list.csv", csv);
  write_file(dir / "rn/list.jsonl", jsonl);
  const std::vector<std::string> common = {"run.toml", "--set", "trainer.max_epochs=2"};
  write_file(dir / "run.toml", R"([trainer]
accelerator = "cpu"
deterministic = true
enable_progress_bar = false
enable_model_summary = false
num_sanity_val_steps = 0
[model]
name = "cnn"
in_channels = 3
image_size = 16
num_classes = 3
[data]
name = "image_folder"
image_size = 16
batch_size = 2
val_split = 0.5
)");
  TempDir folder("image_folder"), from_csv("image_folder"), from_jsonl("image_folder");
  for (const auto* d : {&folder, &from_csv, &from_jsonl}) fs::copy_file(dir / "run.toml", *d / "run.toml");
  auto with = [&](std::vector<std::string> extra) {
    auto a = common;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  run_engine_ok(folder, with({"--set", "data.root=\"" + (dir / "rn/images").string() + "\""}));
  auto c = run_engine_ok(from_csv, with({"--set", "data.root=\"" + (dir / "rn/images/list.csv").string() + "\"", "--set",
                                         "data.path_column=\"file\"", "--set", "data.label_column=\"kind\""}));
  EXPECT_NE(c.err.find("image_folder: 3 classes, 3 train, 3 val"), std::string::npos) << c.err;
  run_engine_ok(from_jsonl, with({"--set", "data.root=\"" + (dir / "rn/list.jsonl").string() + "\""}));
  for (const auto* d : {&from_csv, &from_jsonl})
    EXPECT_EQ(max_weight_difference(last_checkpoint(folder), last_checkpoint(*d)), 0.0) << d->path();

  write_file(dir / "rn/val.jsonl", "{\"path\": \"images/a/" + images[0].first.substr(2) + "\", \"label\": 7}\n");
  auto bad_label = run_engine({"run.toml", "--set", "data.root=\"rn/list.jsonl\"", "--set", "data.val_split=0.0", "--set",
                               "data.val_root=\"rn/val.jsonl\""},
                              dir.path(), {}, 60);
  EXPECT_EQ(bad_label.exit_code, 1) << bad_label.err;
  EXPECT_NE(bad_label.err.find("rn/val.jsonl:1: label '7' is not a class of the training list"), std::string::npos) << bad_label.err;
  auto bad_column = run_engine({"run.toml", "--set", "data.root=\"rn/images/list.csv\""}, dir.path(), {}, 60);
  EXPECT_EQ(bad_column.exit_code, 1) << bad_column.err;
  EXPECT_NE(bad_column.err.find("list.csv:1: no column \"path\" in the header: set data.path_column to one of its columns"), std::string::npos)
      << bad_column.err;
}
#endif
