// The webdataset data plugin (docs/images.md, "Sharded data"): shards written by the webdataset
// package's ShardWriter are read with its samples in its order; the epoch's order (shards shuffled
// by seed and epoch, a contiguous part per rank) is the same sequence on 1, 2 and 3 ranks; a
// mid-epoch resume sees exactly the batches the uninterrupted run saw; images train exactly as
// image_folder trains on the same files; http(s) shards are downloaded once into the cache; and bad
// shards are one line naming them.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "support.h"

using namespace ember::test;
namespace fs = std::filesystem;

#ifdef EMBER_TEST_PYTHON
namespace {

// 17 samples in shards of 7, 7 and 3; "npy" = [10 id, 10 id + 1, 10 id + 2, 10 id + 3], "cls" = id % 3.
nlohmann::json write_arrays(const TempDir& dir, int n = 17, int maxcount = 7) {
  auto r = run_process({EMBER_TEST_PYTHON, "-W", "ignore", (source_dir() / "tests/reference/webdataset_shards.py").string(), "arrays", "sh",
                        std::to_string(n), std::to_string(maxcount)},
                       dir.path(), {}, 300);
  EXPECT_EQ(r.exit_code, 0) << "scripts/setup.sh installs webdataset into the LibTorch venv\n" << r.err;
  return nlohmann::json::parse(r.out);
}

constexpr const char* kArraysToml = R"([trainer]
accelerator = "cpu"
max_epochs = 2
enable_progress_bar = false
enable_model_summary = false
num_sanity_val_steps = 0
[model]
name = "mlp"
input_size = 4
hidden = [8]
num_classes = 3
[data]
name = "webdataset"
train = ["sh/train-{000000..000002}.tar"]
fields = ["npy", "cls"]
batch_size = 4
[optimizer]
name = "sgd"
lr = 0.001
)";

struct Step {
  int64_t epoch = 0, step = 0;
  std::string sum;
  std::vector<int64_t> ids;
};

// position_probe's on_train_batch_end lines with sample values: the batch's ids (array[0] / 10).
std::vector<Step> steps(const fs::path& p) {
  std::vector<Step> out;
  std::ifstream in(p);
  for (std::string line; std::getline(in, line);) {
    std::istringstream l(line);
    std::string hook, bar;
    Step s;
    int64_t batch_idx, size;
    l >> hook >> s.epoch >> s.step >> batch_idx >> size >> s.sum >> bar;
    if (hook != "on_train_batch_end") continue;
    for (double v; l >> v;) s.ids.push_back(static_cast<int64_t>(v) / 10);
    out.push_back(s);
  }
  return out;
}

std::vector<std::string> probe(std::vector<std::string> args, const std::string& path = "position.txt") {
  args.insert(args.end(), {"--plugin-path", test_plugin_dir("good").string(), "--plugins", "position_probe", "--set",
                           "position_probe.sample_values=true", "--set", "position_probe.path=\"" + path + "\""});
  return args;
}

// The ids of `epoch` in a run's order (batch after batch).
std::vector<int64_t> epoch_ids(const std::vector<Step>& s, int64_t epoch) {
  std::vector<int64_t> out;
  for (const auto& x : s)
    if (x.epoch == epoch) out.insert(out.end(), x.ids.begin(), x.ids.end());
  return out;
}

}  // namespace

// Unshuffled, one rank reads the samples in the order webdataset's own reader yields them, each
// sample whole (the batch sums equal the sums of the arrays Python wrote).
TEST(WebDataset, ReadsShardWritersSamplesInItsOrder) {
  TempDir dir("webdataset");
  const auto ref = write_arrays(dir);
  ASSERT_EQ(ref["counts"], nlohmann::json({7, 7, 3}));
  write_file(dir / "run.toml", kArraysToml);
  auto r = run_engine_ok(dir, probe({"run.toml", "--set", "data.shuffle=false", "--set", "trainer.max_epochs=1"}));
  EXPECT_NE(r.err.find("webdataset: 3 train shards (17 samples)"), std::string::npos) << r.err;
  const auto s = steps(dir / "position.txt");
  ASSERT_EQ(s.size(), 5u);
  std::vector<int64_t> ids = epoch_ids(s, 0);
  EXPECT_EQ(ids, ref["ids"].get<std::vector<int64_t>>());
  size_t at = 0;
  for (const auto& step : s) {
    double sum = 0;
    for (size_t k = 0; k < step.ids.size(); ++k) sum += ref["sums"][at++].get<double>();
    EXPECT_EQ(std::stod(step.sum), sum) << "step " << step.step;
  }
}

// Shuffled (shards permuted by seed and epoch, two shards' samples shuffled together): every epoch
// holds every sample once, in another order each epoch; the ranks' contiguous parts joined in rank
// order are the 1-rank sequence on 2 and 3 ranks (the last rank's tail padded with the start, as
// DistributedSampler pads); and a window's samples come from two shards at most.
TEST(WebDataset, TheEpochsSequenceIsTheSameOnOneTwoAndThreeRanks) {
  TempDir dir("webdataset");
  write_arrays(dir);
  write_file(dir / "run.toml", kArraysToml);
  run_engine_ok(dir, probe({"run.toml", "--set", "data.shuffle_groups=2", "--set", "data.batch_size=3"}, "one.txt"));
  const auto one = steps(dir / "one.txt");
  std::vector<std::vector<int64_t>> single = {epoch_ids(one, 0), epoch_ids(one, 1)};
  for (const auto& e : single) {
    ASSERT_EQ(e.size(), 17u);
    EXPECT_EQ(std::set<int64_t>(e.begin(), e.end()).size(), 17u);
    // Between a shard's first and last sample lie samples of two shards at most (its window).
    for (int64_t shard = 0; shard < 3; ++shard) {
      size_t first = e.size(), last = 0;
      for (size_t k = 0; k < e.size(); ++k)
        if (e[k] / 7 == shard) first = std::min(first, k), last = k;
      std::set<int64_t> seen;
      for (size_t k = first; k <= last; ++k) seen.insert(e[k] / 7);
      EXPECT_LE(seen.size(), 2u) << "shard " << shard;
    }
  }
  EXPECT_NE(single[0], single[1]) << "each epoch its own order";
  for (int world : {2, 3}) {
    const std::string tag = "w" + std::to_string(world);
    auto args = probe({"--plugins", "ddp", "run.toml", "--set", "data.shuffle_groups=2", "--set", "data.batch_size=3", "--set",
                       "ddp.timeout=30.0", "--set", "trainer.devices=" + std::to_string(world)},
                      tag + "-{rank}.txt");
    run_engine_ok(dir, args);
    for (int64_t epoch : {0, 1}) {
      std::vector<int64_t> joined;
      for (int rank = 0; rank < world; ++rank) {
        const auto part = epoch_ids(steps(dir / (tag + "-" + std::to_string(rank) + ".txt")), epoch);
        EXPECT_EQ(part.size(), (17u + world - 1) / world) << tag << " rank " << rank;
        joined.insert(joined.end(), part.begin(), part.end());
      }
      ASSERT_GE(joined.size(), 17u);
      EXPECT_EQ(std::vector<int64_t>(joined.begin(), joined.begin() + 17), single[static_cast<size_t>(epoch)]) << tag << " epoch " << epoch;
      for (size_t k = 17; k < joined.size(); ++k) EXPECT_EQ(joined[k], single[static_cast<size_t>(epoch)][k - 17]) << "padding repeats the start";
    }
  }
}

// A checkpoint saved mid-epoch resumes at the next batch of the same epoch order: the resumed run
// sees exactly the batches (ids and sums) the uninterrupted run saw after that step.
TEST(WebDataset, ResumesMidEpochExactly) {
  TempDir dir("webdataset");
  write_arrays(dir);
  write_file(dir / "run.toml", kArraysToml);
  const std::vector<std::string> common = {"run.toml", "--set", "trainer.max_epochs=3", "--set", "checkpoint.every_n_train_steps=7",
                                           "--set", "checkpoint.save_top_k=-1", "--set", "data.num_workers=2"};
  run_engine_ok(dir, probe(common, "full.txt"));
  const auto ckpt = dir / "runs/run/version_0/checkpoints/epoch=1-step=7.ckpt";
  ASSERT_TRUE(fs::exists(ckpt));
  auto args = probe(common, "resumed.txt");
  args.insert(args.end(), {"--resume", ckpt.string()});
  run_engine_ok(dir, args);
  const auto full = steps(dir / "full.txt"), resumed = steps(dir / "resumed.txt");
  ASSERT_EQ(full.size(), 15u);
  ASSERT_EQ(resumed.size(), 8u);
  for (size_t k = 0; k < resumed.size(); ++k) {
    EXPECT_EQ(resumed[k].step, full[k + 7].step);
    EXPECT_EQ(resumed[k].ids, full[k + 7].ids) << "step " << resumed[k].step;
    EXPECT_EQ(resumed[k].sum, full[k + 7].sum) << "step " << resumed[k].step;
  }
}

// The images of an image folder packed into shards (ShardWriter, torchvision's order) train exactly
// as image_folder trains on the folder: unshuffled, the same batches through the same decoder and
// transforms give the same loss at every step.
TEST(WebDataset, ImagesTrainExactlyLikeImageFolder) {
  TempDir dir("webdataset");
  auto r = run_process({EMBER_TEST_PYTHON, "-W", "ignore", (source_dir() / "tests/reference/image_folder.py").string(), "fmnist", "fm", "48", "0"},
                       dir.path(), {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = run_process({EMBER_TEST_PYTHON, "-W", "ignore", (source_dir() / "tests/reference/webdataset_shards.py").string(), "images", "fm/train", "img", "20"},
                  dir.path(), {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string common = R"([trainer]
accelerator = "cpu"
max_epochs = 1
enable_progress_bar = false
enable_model_summary = false
num_sanity_val_steps = 0
deterministic = true
[model]
name = "cnn"
in_channels = 3
image_size = 16
num_classes = 10
[optimizer]
name = "sgd"
lr = 0.01
[csv]
flush_logs_every_n_steps = 1
[data]
image_size = 16
batch_size = 8
shuffle = false
num_workers = 2
)";
  write_file(dir / "folder.toml", common + "name = \"image_folder\"\nroot = \"fm/train\"\n");
  write_file(dir / "shards.toml", common + "name = \"webdataset\"\ntrain = [\"img/img-*.tar\"]\nfields = [\"jpg;png\", \"cls\"]\n");
  // And packed by `engine data pack` in the folder's order, read through its shard list.
  auto pack = run_engine({"data", "pack", "fm/train", "packed", "--max-count", "20", "--no-shuffle"}, dir.path(), {}, 120);
  ASSERT_EQ(pack.exit_code, 0) << pack.err;
  EXPECT_NE(pack.out.find("packed 48 images of 10 classes into 3 shards"), std::string::npos) << pack.out;
  write_file(dir / "packed.toml", common + "name = \"webdataset\"\ntrain = [\"packed/train.json\"]\n");
  auto losses = [&](const std::string& name) {
    std::map<std::string, std::string> out;
    for (const auto& row : read_csv(dir / ("runs/" + name + "/version_0/metrics.csv")))
      if (row.count("train_loss_step") && !row.at("train_loss_step").empty()) out[row.at("step")] = row.at("train_loss_step");
    return out;
  };
  for (const char* name : {"folder", "shards", "packed"}) run_engine_ok(dir, {std::string(name) + ".toml", "--set", "trainer.log_every_n_steps=1"});
  const auto folder = losses("folder");
  ASSERT_EQ(folder.size(), 6u);
  EXPECT_EQ(losses("shards"), folder);
  EXPECT_EQ(losses("packed"), folder);
}

// `engine data pack` shuffles by its seed: webdataset's own reader finds every image of the folder
// once with its class, in another order than the folder's; the same seed packs the same bytes; a
// folder that already holds shards of that name, or a file that is not an image, is one line.
TEST(WebDataset, PackWritesShardsWebdatasetReads) {
  TempDir dir("webdataset");
  auto r = run_process({EMBER_TEST_PYTHON, "-W", "ignore", (source_dir() / "tests/reference/image_folder.py").string(), "fmnist", "fm", "30", "0"},
                       dir.path(), {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* out : {"a", "b"}) {
    auto pack = run_engine({"data", "pack", "fm/train", out, "--max-count", "8", "--seed", "3"}, dir.path(), {}, 120);
    ASSERT_EQ(pack.exit_code, 0) << pack.err;
  }
  std::vector<std::string> argv = {EMBER_TEST_PYTHON, "-W", "ignore", (source_dir() / "tests/reference/webdataset_shards.py").string(), "check", "fm/train"};
  for (const char* s : {"a/train-000000.tar", "a/train-000001.tar", "a/train-000002.tar", "a/train-000003.tar"}) argv.push_back(s);
  r = run_process(argv, dir.path(), {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto check = nlohmann::json::parse(r.out);
  EXPECT_TRUE(check["same"].get<bool>()) << r.out;
  std::vector<int64_t> in_order(30);
  for (int64_t i = 0; i < 30; ++i) in_order[static_cast<size_t>(i)] = i;
  EXPECT_NE(check["order"].get<std::vector<int64_t>>(), in_order) << "shuffled";
  for (const char* s : {"train-000000.tar", "train-000003.tar", "train.json"}) EXPECT_EQ(read_file(dir / "a" / s), read_file(dir / "b" / s)) << s;
  EXPECT_FALSE(fs::exists(dir / "a/train-000004.tar"));
  auto again = run_engine({"data", "pack", "fm/train", "a"}, dir.path(), {}, 60);
  EXPECT_EQ(again.exit_code, 2);
  EXPECT_NE(again.err.find("engine data pack: a already holds train-"), std::string::npos) << again.err;
  write_file(dir / "fm/train/3/zz_broken.png", "not a png");
  auto broken = run_engine({"data", "pack", "fm/train", "c"}, dir.path(), {}, 60);
  EXPECT_NE(broken.exit_code, 0);
  EXPECT_NE(broken.err.find("fm/train/3/zz_broken.png: neither a JPEG nor a PNG file"), std::string::npos) << broken.err;
}

// http(s) shards: a JSON shard list of URLs served on loopback trains as the local files do; the
// shards land in data.cache_dir once, and a second run reads them from there with the server gone.
// An unreachable URL is one line naming it.
TEST(WebDataset, HttpShardsAreDownloadedOnceIntoTheCache) {
  TempDir dir("webdataset");
  const auto ref = write_arrays(dir);
  const int port = free_port();
  // The server's process group is ended however the test ends.
  struct Server {
    Running running;
    void stop() {
      if (running.pid <= 0) return;
      ::kill(-running.pid, SIGTERM);
      wait_process(running, 10);
      running.pid = -1;
    }
    ~Server() { stop(); }
  } server{start_process({EMBER_TEST_PYTHON, "-m", "http.server", std::to_string(port), "--bind", "127.0.0.1", "--directory", "sh"}, dir.path())};
  nlohmann::json list = {{"shardlist", nlohmann::json::array()}};
  for (size_t k = 0; k < ref["shards"].size(); ++k)
    list["shardlist"].push_back({{"url", "http://127.0.0.1:" + std::to_string(port) + "/" + ref["shards"][k].get<std::string>()},
                                 {"nsamples", ref["counts"][k]}});
  write_file(dir / "remote.json", list.dump());
  write_file(dir / "run.toml", kArraysToml);
  const std::vector<std::string> remote = {"run.toml", "--set", "data.train=[\"remote.json\"]", "--set", "data.cache_dir=\"cache\"",
                                           "--set", "data.shuffle=false", "--set", "trainer.max_epochs=1"};
  // The server needs a moment to listen: retry the first run a few times.
  ProcessResult first;
  for (int attempt = 0; attempt < 20; ++attempt) {
    first = run_engine(probe(remote, "remote.txt"), dir.path(), {}, 120);
    if (first.exit_code == 0 || first.err.find("Could not connect") == std::string::npos) break;
    fs::remove(dir / "remote.txt");
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  ASSERT_EQ(first.exit_code, 0) << first.err;
  int cached = 0;
  for (const auto& e : fs::directory_iterator(dir / "cache")) cached += e.path().extension() == ".tar";
  EXPECT_EQ(cached, 3);
  // A cache limit below one shard: only the shard in use stays; the second epoch fetches the
  // evicted ones again and reads the same samples.
  run_engine_ok(dir, probe({"run.toml", "--set", "data.train=[\"remote.json\"]", "--set", "data.cache_dir=\"small\"", "--set",
                            "data.cache_limit_gb=1e-9", "--set", "data.shuffle=false", "--set", "trainer.max_epochs=2"},
                           "small.txt"));
  const auto small = steps(dir / "small.txt");
  EXPECT_EQ(epoch_ids(small, 0), ref["ids"].get<std::vector<int64_t>>());
  EXPECT_EQ(epoch_ids(small, 1), ref["ids"].get<std::vector<int64_t>>());
  int kept = 0;
  for (const auto& e : fs::directory_iterator(dir / "small")) kept += e.path().extension() == ".tar";
  EXPECT_EQ(kept, 1);
  // A compressed shard on the server: downloaded, decompressed, and only the decompressed copy kept.
  ASSERT_EQ(run_process({EMBER_TEST_PYTHON, "-c", "import gzip; open('sh/train-000002.tar.gz', 'wb').write(gzip.compress(open('sh/train-000002.tar', 'rb').read()))"},
                        dir.path(), {}, 30).exit_code, 0);
  run_engine_ok(dir, probe({"run.toml", "--set", "data.train=[\"http://127.0.0.1:" + std::to_string(port) + "/train-000002.tar.gz\"]", "--set",
                            "data.cache_dir=\"gz\"", "--set", "data.shuffle=false", "--set", "trainer.max_epochs=1"},
                           "gz.txt"));
  EXPECT_EQ(epoch_ids(steps(dir / "gz.txt"), 0), (std::vector<int64_t>{14, 15, 16}));
  std::vector<std::string> gz_cache;
  for (const auto& e : fs::directory_iterator(dir / "gz")) gz_cache.push_back(e.path().filename().string());
  ASSERT_EQ(gz_cache.size(), 1u);
  EXPECT_TRUE(gz_cache[0].size() > 17 && gz_cache[0].substr(gz_cache[0].size() - 17) == "-train-000002.tar") << gz_cache[0];
  server.stop();
  EXPECT_EQ(epoch_ids(steps(dir / "remote.txt"), 0), ref["ids"].get<std::vector<int64_t>>());
  run_engine_ok(dir, probe(remote, "again.txt"));
  EXPECT_EQ(epoch_ids(steps(dir / "again.txt"), 0), ref["ids"].get<std::vector<int64_t>>());
  auto gone = run_engine({"run.toml", "--set", "data.train=[\"http://127.0.0.1:" + std::to_string(port) + "/missing-{0..1}.tar\"]", "--set",
                          "data.cache_dir=\"cache\""},
                         dir.path(), {}, 120);
  EXPECT_NE(gone.exit_code, 0);
  EXPECT_NE(gone.err.find("webdataset: cannot download shard http://127.0.0.1:" + std::to_string(port) + "/missing-0.tar"), std::string::npos) << gone.err;
  for (const auto& e : fs::directory_iterator(dir / "cache"))
    EXPECT_EQ(e.path().filename().string().find("missing"), std::string::npos) << "a failed download leaves nothing: " << e.path();
}

// Compressed shards (gzip, xz, bzip2: whatever Python's tarfile reads with "r|*") are decompressed
// once into the cache and read from there, in the same order with the same samples; a later run
// reuses the copies, a rewritten shard is decompressed again (its stale copy deleted), and a corrupt or cut-short shard is
// one line (gzip's CRC-32 checked) that leaves nothing in the cache.
TEST(WebDataset, CompressedShardsAreReadFromDecompressedCopies) {
  TempDir dir("webdataset");
  const auto ref = write_arrays(dir);
  ASSERT_EQ(run_process({EMBER_TEST_PYTHON, "-c",
                         "import bz2, gzip, io, lzma, os, tarfile\n"
                         "os.makedirs('z')\n"
                         "for k, (ext, pack) in enumerate((('gz', gzip.compress), ('xz', lzma.compress), ('bz2', bz2.compress))):\n"
                         "    open(f'z/train-00000{k}.tar.{ext}', 'wb').write(pack(open(f'sh/train-00000{k}.tar', 'rb').read()))\n"
                         "g = bytearray(gzip.compress(open('sh/train-000002.tar', 'rb').read()))\n"
                         "g[-6] ^= 0xff\n"  // the CRC-32 in the trailer: the data decompresses, the check fails
                         "open('z/crc.tar.gz', 'wb').write(bytes(g))\n"
                         "buf = io.BytesIO()\n"  // a shard large enough to be cut short past its first block
                         "with tarfile.open(fileobj=buf, mode='w') as t:\n"
                         "    data = os.urandom(1 << 20); info = tarfile.TarInfo('big.npy'); info.size = len(data); t.addfile(info, io.BytesIO(data))\n"
                         "g = gzip.compress(buf.getvalue())\n"
                         "open('z/cut.tar.gz', 'wb').write(g[:len(g) // 2])\n"},
                        dir.path(), {}, 60).exit_code,
            0);
  write_file(dir / "run.toml", kArraysToml);
  const std::vector<std::string> args = {"run.toml", "--set", "data.train=[\"z/train-000000.tar.gz\", \"z/train-000001.tar.xz\", \"z/train-000002.tar.bz2\"]",
                                         "--set", "data.cache_dir=\"cache\"", "--set", "data.shuffle=false", "--set", "trainer.max_epochs=1"};
  auto r = run_engine_ok(dir, probe(args));
  EXPECT_NE(r.err.find("webdataset: 3 train shards (17 samples), 0 val (0), 0 test (0); 3 compressed shards read from decompressed copies in cache"),
            std::string::npos) << r.err;
  EXPECT_EQ(epoch_ids(steps(dir / "position.txt"), 0), ref["ids"].get<std::vector<int64_t>>());
  auto copies = [&] {
    std::map<std::string, fs::file_time_type> out;
    for (const auto& e : fs::directory_iterator(dir / "cache")) out[e.path().filename().string()] = fs::last_write_time(e.path());
    return out;
  };
  const auto first = copies();
  ASSERT_EQ(first.size(), 3u);
  for (const auto& [name, time] : first) EXPECT_EQ(fs::path(name).extension(), ".tar") << name;
  // Each copy is the shard's own tar, byte for byte.
  for (int k = 0; k < 3; ++k) {
    const std::string tar = "train-00000" + std::to_string(k) + ".tar";
    bool found = false;
    for (const auto& [name, time] : first)
      if (name.size() > tar.size() && name.substr(name.size() - tar.size()) == tar) found = read_file(dir / "cache" / name) == read_file(dir / "sh" / tar);
    EXPECT_TRUE(found) << tar;
  }
  // A later run reads the same copies; a rewritten shard gets a new one, which replaces its old one.
  run_engine_ok(dir, probe(args, "again.txt"));
  EXPECT_EQ(copies(), first);
  EXPECT_EQ(epoch_ids(steps(dir / "again.txt"), 0), ref["ids"].get<std::vector<int64_t>>());
  fs::last_write_time(dir / "z/train-000000.tar.gz", fs::last_write_time(dir / "z/train-000000.tar.gz") + std::chrono::seconds(10));
  run_engine_ok(dir, probe(args, "rewritten.txt"));
  const auto rewritten = copies();
  ASSERT_EQ(rewritten.size(), 3u);
  int replaced = 0;
  for (const auto& [name, time] : rewritten) replaced += !first.count(name);
  EXPECT_EQ(replaced, 1) << "only shard 0's copy is new";
  EXPECT_EQ(epoch_ids(steps(dir / "rewritten.txt"), 0), ref["ids"].get<std::vector<int64_t>>());
  for (const auto& [shard, expected] : {std::pair<std::string, std::string>{"z/crc.tar.gz", "webdataset: shard z/crc.tar.gz is corrupt or cut short (gzip: "},
                                        {"z/cut.tar.gz", "webdataset: shard z/cut.tar.gz is corrupt or cut short (gzip: "}}) {
    auto bad = run_engine({"run.toml", "--set", "data.train=[\"" + shard + "\"]", "--set", "data.cache_dir=\"cache\"", "--set", "data.fields=[\"npy\"]"},
                          dir.path(), {}, 120);
    EXPECT_NE(bad.exit_code, 0) << shard;
    EXPECT_NE(bad.err.find(expected), std::string::npos) << bad.err;
    EXPECT_EQ(copies(), rewritten) << "a failed decompression leaves nothing in the cache";
  }
}

// Bad shards and settings: one line each, naming the shard (and the sample), or the key's file:line.
TEST(WebDataset, BadShardsAreOneLineNamingThem) {
  TempDir dir("webdataset");
  write_arrays(dir);
  write_file(dir / "run.toml", kArraysToml);
  auto fails = [&](std::vector<std::string> args, const std::string& expected) {
    args.insert(args.begin(), "run.toml");
    auto r = run_engine(args, dir.path(), {}, 120);
    EXPECT_NE(r.exit_code, 0) << expected;
    EXPECT_NE(r.err.find(expected), std::string::npos) << r.err;
    return r;
  };
  fails({"--set", "data.fields=[\"npy\", \"txt\"]"}, "the field extension 'txt' has no decoder");
  fails({"--set", "data.fields=[\"npy\", \"jpg\"]"}, "shard sh/train-000000.tar: sample '000000' has no .jpg member");
  fails({"--set", "data.train=[\"sh/*.tar\", \"odd.tar\"]"}, "shard odd.tar does not exist");
  fails({"--set", "data.train=[\"sh/train-{000000..000002.tar\"]"}, "has a '{' without its '}'");
  // A range that is a typo: one line, at once, not memory and time without end.
  fails({"--set", "data.train=[\"sh/train-{000000..99999999999}.tar\"]"},
        "shard range {000000..99999999999} names 100000000000 shards, more than 1000000: check its bounds");
  fails({"--set", "data.train=[\"sh/train-{0..99999999999999999999}.tar\"]"}, "has a bound of more than 18 digits");
  fails({"--set", "data.train=[\"{0..999}{0..999}{0..999}.tar\"]"}, "shard pattern expands to more than 1000000 shard names");
  write_file(dir / "not.tar", std::string(2000, 'x'));
  fails({"--set", "data.train=[\"not.tar\"]"}, "webdataset: shard not.tar is not a readable tar file");
  ASSERT_EQ(run_process({EMBER_TEST_PYTHON, "-c", "import gzip; open('twice.tar.gz', 'wb').write(gzip.compress(gzip.compress(open('sh/train-000002.tar', 'rb').read())))"},
                        dir.path(), {}, 30).exit_code, 0);
  fails({"--set", "data.train=[\"twice.tar.gz\"]", "--set", "data.cache_dir=\"cache\""},
        "webdataset: shard twice.tar.gz is compressed twice (gzip, then gzip): write it as a tar compressed once, or not at all");
  // A list that miscounts a shard is found when the shard is first read.
  write_file(dir / "wrong.json", R"({"shardlist": [{"url": "sh/train-000002.tar", "nsamples": 4}]})");
  fails({"--set", "data.train=[\"wrong.json\"]"}, "holds 3 complete samples, its shard list says 4");
  // Arrays of two shapes cannot be one batch tensor: the sample and both shapes are named.
  ASSERT_EQ(run_process({EMBER_TEST_PYTHON, "-c",
                         "import io, tarfile, numpy as np\n"
                         "with tarfile.open('shapes.tar', 'w') as out:\n"
                         "    for key, n in (('a', 4), ('b', 3)):\n"
                         "        for ext, data in (('cls', b'1'), ('npy', (lambda f: (np.save(f, np.zeros(n, np.float32)), f.getvalue())[1])(io.BytesIO()))):\n"
                         "            info = tarfile.TarInfo(key + '.' + ext); info.size = len(data); out.addfile(info, io.BytesIO(data))\n"},
                        dir.path(), {}, 30)
                .exit_code,
            0);
  fails({"--set", "data.train=[\"shapes.tar\"]", "--set", "data.shuffle=false"},
        "webdataset: shapes.tar:b: field .npy has shape [3] (Float), another sample of the batch [4] (Float)");
  // Samples without a field are left out and counted with incomplete_samples = "skip".
  // The second shard again without three of its .cls members.
  ASSERT_EQ(run_process({EMBER_TEST_PYTHON, "-c",
                         "import tarfile\n"
                         "with tarfile.open('sh/train-000001.tar') as src, tarfile.open('mixed.tar', 'w') as out:\n"
                         "    for m in src.getmembers():\n"
                         "        if m.name not in ('000007.cls', '000009.cls', '000013.cls'): out.addfile(m, src.extractfile(m))\n"},
                        dir.path(), {}, 30)
                .exit_code,
            0);
  auto r = run_engine({"run.toml", "--set", "data.incomplete_samples=\"skip\"", "--set", "data.train=[\"sh/train-000000.tar\", \"mixed.tar\"]", "--set", "trainer.max_epochs=1"}, dir.path(), {}, 120);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("(11 samples)"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("3 incomplete samples skipped"), std::string::npos) << r.err;
}
#endif

#ifdef EMBER_TEST_PYTHON
// configs/webdataset_resnet.toml trains as the README says, on the shards `engine data pack` wrote.
TEST(WebDataset, TheReadmeConfigTrainsOnPackedShards) {
  TempDir dir("webdataset");
  auto r = run_process({EMBER_TEST_PYTHON, "-W", "ignore", (source_dir() / "tests/reference/image_folder.py").string(), "resnet", "rn"}, dir.path(), {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* prefix : {"train", "val"})
    ASSERT_EQ(run_engine({"data", "pack", "rn/images", "shards", "--prefix", prefix}, dir.path(), {}, 60).exit_code, 0);
  run_engine_ok(dir, {(source_dir() / "configs/webdataset_resnet.toml").string(), "--set", "model.num_classes=3", "--set", "trainer.max_epochs=1",
                      "--set", "data.image_size=32", "--set", "trainer.enable_progress_bar=false"});
  bool validated = false;
  for (const auto& e : fs::recursive_directory_iterator(dir.path())) validated |= e.path().filename() == "val_confusion_matrix.csv";
  EXPECT_TRUE(validated) << "the val shards were validated on";
}
#endif
