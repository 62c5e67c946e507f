// Checkpoint integrity: every payload record carries a CRC32C in the file's manifest, checked on
// every load, so bit flips in a checkpoint's tensor data (or its pickle) end the run with one
// line instead of training on from damaged weights. Format 1 files (no manifest) still load.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <cstring>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>

#include <ember/support/checkpoint_read.h>

#include "checkpoint/checkpoint_io.h"
#include "checkpoint/nested_archive.h"
#include "checkpoint/sharded_checkpoint.h"
#include "support.h"

using namespace ember::test;
namespace fs = std::filesystem;

namespace {

const char* kMlp = R"(
[trainer]
max_epochs = 1
enable_progress_bar = false
enable_model_summary = false
[model]
name = "mlp"
input_size = 16
hidden = [32]
[data]
name = "synthetic"
shape = [16]
num_train = 64
num_val = 16
batch_size = 16
[optimizer]
name = "adam"
)";

struct Record {
  std::string name;
  size_t offset = 0, size = 0;
};

// Where each payload record's bytes lie in the file.
std::vector<Record> payload_records(const fs::path& file) {
  caffe2::serialize::PyTorchStreamReader reader(file.string());
  std::vector<Record> out;
  for (const auto& name : reader.getAllRecords())
    if (name == "data.pkl" || name.rfind("data/", 0) == 0) out.push_back({name, reader.getRecordOffset(name), reader.getRecordSize(name)});
  return out;
}

void flip_bit(const fs::path& file, size_t offset, int bit) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ (1 << bit));
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

// "" when the file loads; the error otherwise.
std::string load_error(const fs::path& file) {
  try {
    ember::engine::load_checkpoint_file(file);
    return "";
  } catch (const std::exception& e) {
    return e.what();
  }
}

c10::impl::GenericDict small_checkpoint(int64_t format_version, bool weights_only) {
  c10::impl::GenericDict ck(c10::StringType::get(), c10::AnyType::get());
  ck.insert("format", std::string(ember::engine::kCheckpointFormat));
  ck.insert("format_version", format_version);
  ck.insert("weights_only", weights_only);
  c10::Dict<std::string, at::Tensor> sd;
  sd.insert("w", at::arange(12, at::kFloat).reshape({3, 4}));
  ck.insert("state_dict", sd);
  return ck;
}

}  // namespace

TEST(Crc32c, KnownValueAndHardwareMatchesBoost) {
  const std::string check = "123456789";
  EXPECT_EQ(ember::engine::crc32c(check.data(), check.size()), 0xE3069283u);
  EXPECT_EQ(ember::engine::crc32c_portable(check.data(), check.size()), 0xE3069283u);
  std::mt19937 rng(7);
  std::vector<unsigned char> buf(1 << 20);
  for (auto& b : buf) b = static_cast<unsigned char>(rng());
  for (size_t offset = 0; offset < 8; ++offset)
    for (size_t len : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{9}, size_t{63}, size_t{1000}, buf.size() - 8})
      EXPECT_EQ(ember::engine::crc32c(buf.data() + offset, len), ember::engine::crc32c_portable(buf.data() + offset, len))
          << "offset " << offset << " length " << len;
}

// `engine checkpoint verify` checks a record in chunks: the CRC of the pieces, extended one after
// another, is the CRC of the whole, on both the SSE4.2 and the Boost paths.
TEST(Crc32c, ExtendingOverChunksGivesTheWholeRecordsValue) {
  std::mt19937 rng(11);
  std::vector<unsigned char> buf(100003);
  for (auto& b : buf) b = static_cast<unsigned char>(rng());
  const uint32_t whole = ember::engine::crc32c(buf.data(), buf.size());
  for (size_t chunk : {size_t{1}, size_t{5}, size_t{8}, size_t{4096}, size_t{65536}, buf.size()}) {
    uint32_t fast = 0, portable = 0;
    for (size_t at = 0; at < buf.size(); at += chunk) {
      const size_t n = std::min(chunk, buf.size() - at);
      fast = ember::engine::crc32c_extend(fast, buf.data() + at, n);
      portable = ember::engine::crc32c_portable_extend(portable, buf.data() + at, n);
    }
    EXPECT_EQ(fast, whole) << "chunk " << chunk;
    EXPECT_EQ(portable, whole) << "chunk " << chunk;
  }
  EXPECT_EQ(ember::engine::crc32c_extend(whole, buf.data(), 0), whole);
}

TEST(CheckpointIntegrity, BitFlipsAnywhereInThePayloadAreDetected) {
  TempDir dir("integrity");
  write_file(dir / "run.toml", kMlp);
  auto r = run_engine({"run.toml"}, dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const fs::path good = dir / "runs/run/version_0/checkpoints/last.ckpt";
  ASSERT_EQ(load_error(good), "");
  const auto records = payload_records(good);
  ASSERT_GE(records.size(), 6u);  // 4 weights, optimizer, rng state, data.pkl
  int tried = 0, detected = 0;
  std::mt19937 rng(13);
  for (const auto& rec : records) {
    ASSERT_GT(rec.size, 0u) << rec.name;
    // First byte, last byte, and a few in between, each with another bit.
    std::vector<size_t> places = {0, rec.size - 1, rec.size / 2};
    for (int i = 0; i < 3; ++i) places.push_back(std::uniform_int_distribution<size_t>(0, rec.size - 1)(rng));
    for (size_t place : places) {
      const fs::path bad = dir / "bad.ckpt";
      fs::copy_file(good, bad, fs::copy_options::overwrite_existing);
      flip_bit(bad, rec.offset + place, tried % 8);
      ++tried;
      const std::string err = load_error(bad);
      const bool ok = err.find("checkpoint " + bad.string() + " is damaged: record '" + rec.name + "'") != std::string::npos &&
                      err.find("fails its CRC32C check") != std::string::npos && err.find('\n') == std::string::npos;
      EXPECT_TRUE(ok) << rec.name << " byte " << place << ": " << (err.empty() ? "accepted" : err);
      detected += ok ? 1 : 0;
    }
  }
  std::cout << "corrupted checkpoints tried / detected: " << tried << " / " << detected << "\n";
  RecordProperty("corrupted_tried", tried);
  RecordProperty("corrupted_detected", detected);
  EXPECT_EQ(detected, tried);
}

TEST(CheckpointIntegrity, DamagedManifestOrTruncatedFileIsRefused) {
  TempDir dir("integrity");
  const fs::path good = dir / "good.ckpt";
  ember::engine::save_checkpoint_file(good, small_checkpoint(ember::engine::kCheckpointFormatVersion, false));
  ASSERT_EQ(load_error(good), "");
  size_t manifest_offset = 0, manifest_size = 0;
  {
    caffe2::serialize::PyTorchStreamReader reader(good.string());
    manifest_offset = reader.getRecordOffset(ember::engine::kManifestRecord);
    manifest_size = reader.getRecordSize(ember::engine::kManifestRecord);
  }
  // Every byte of the manifest, one bit each: the manifest's own checksum catches what the
  // record checks would not (its weights_only or format_version line).
  size_t detected = 0;
  for (size_t i = 0; i < manifest_size; ++i) {
    const fs::path bad = dir / "bad.ckpt";
    fs::copy_file(good, bad, fs::copy_options::overwrite_existing);
    flip_bit(bad, manifest_offset + i, static_cast<int>(i % 7));
    const std::string err = load_error(bad);
    const bool ok = err.find("bad.ckpt is") != std::string::npos;
    EXPECT_TRUE(ok) << "manifest byte " << i << ": " << (err.empty() ? "accepted" : err);
    detected += ok ? 1 : 0;
  }
  std::cout << "checkpoints with a damaged manifest tried / detected: " << manifest_size << " / " << detected << "\n";
  // Cut short: the zip directory at the end is gone.
  const auto bytes = read_file(good);
  write_file(dir / "short.ckpt", bytes.substr(0, bytes.size() / 2));
  EXPECT_NE(load_error(dir / "short.ckpt").find("short.ckpt is corrupt or not a checkpoint"), std::string::npos);
}

TEST(CheckpointIntegrity, ResumeFromADamagedFileEndsWithOneLine) {
  TempDir dir("integrity");
  write_file(dir / "run.toml", kMlp);
  ASSERT_EQ(run_engine({"run.toml"}, dir.path()).exit_code, 0);
  const fs::path last = dir / "runs/run/version_0/checkpoints/last.ckpt";
  const auto records = payload_records(last);
  const auto weight = std::find_if(records.begin(), records.end(), [](const Record& r) { return r.name == "data/0"; });
  ASSERT_NE(weight, records.end());
  flip_bit(last, weight->offset + weight->size / 2, 3);
  const auto damaged = read_file(last);
  auto r = run_engine({"run.toml", "--set", "trainer.max_epochs=2", "--resume", "last"}, dir.path());
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("run failed: checkpoint runs/run/version_0/checkpoints/last.ckpt is damaged: record 'data/0'"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("resumed from"), std::string::npos) << r.err;
  EXPECT_EQ(read_file(last), damaged);  // left as it was, for inspection
}

// `engine checkpoint verify`: every record against the manifest, read in 8 MB chunks (the 12 MB
// tensor spans two), a damaged record named in one line with exit 1, and each file of a sharded
// directory checked, a bad or missing part named.
TEST(CheckpointIntegrity, VerifyCommandNamesTheDamagedRecordOrPart) {
  TempDir dir("integrity");
  auto ck = small_checkpoint(ember::engine::kCheckpointFormatVersion, false);
  c10::Dict<std::string, at::Tensor> sd;
  sd.insert("w", at::arange(12, at::kFloat).reshape({3, 4}));
  sd.insert("big", at::rand({3 << 20}));
  ck.insert_or_assign("state_dict", sd);
  const fs::path good = dir / "good.ckpt";
  ember::engine::save_checkpoint_file(good, ck);
  const auto ok = run_engine({"checkpoint", "verify", good.string()}, dir.path());
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_NE(ok.out.find(good.string() + ": good: "), std::string::npos) << ok.out;
  EXPECT_NE(ok.out.find("every CRC32C matches its manifest and the pickle reads (format 2)"), std::string::npos) << ok.out;
  auto one_line_error = [&](const fs::path& file, const std::vector<std::string>& texts) {
    const auto r = run_engine({"checkpoint", "verify", file.string()}, dir.path());
    EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
    for (const auto& text : texts) EXPECT_NE(r.err.find(text), std::string::npos) << text << " is missing from: " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    return r;
  };
  Record big, pkl;
  for (const auto& r : payload_records(good)) {
    if (r.size > big.size) big = r;
    if (r.name == "data.pkl") pkl = r;
  }
  ASSERT_GT(big.size, size_t{9} << 20);
  for (const auto& [rec, at] : {std::pair<Record, size_t>{big, size_t{9} << 20}, {pkl, pkl.size / 2}}) {
    const fs::path bad = dir / "bad.ckpt";
    fs::copy_file(good, bad, fs::copy_options::overwrite_existing);
    flip_bit(bad, rec.offset + at, 5);
    one_line_error(bad, {"engine checkpoint verify: checkpoint " + bad.string() + " is damaged: record '" + rec.name + "'",
                         "fails its CRC32C check"});
  }
  const auto bytes = read_file(good);
  write_file(dir / "short.ckpt", bytes.substr(0, bytes.size() / 2));
  one_line_error(dir / "short.ckpt", {"short.ckpt is corrupt or not a checkpoint"});
  const auto v1 = torch::jit::pickle_save(small_checkpoint(1, false));
  ember::engine::atomic_write(dir / "v1.ckpt", v1.data(), v1.size());
  one_line_error(dir / "v1.ckpt", {"v1.ckpt has no checksums to check", "engine validate --ckpt"});
  one_line_error(dir / "missing.ckpt", {"missing.ckpt does not exist"});

  // A sharded directory of two parts, written as ranks write them.
  const fs::path shard = dir / "sharded.ckpt";
  auto meta = small_checkpoint(ember::engine::kCheckpointFormatVersion, false);
  (void)meta.erase("state_dict");
  c10::impl::GenericDict layout(c10::StringType::get(), c10::AnyType::get());
  layout.insert("world_size", int64_t{2});
  layout.insert("strategy", std::string("sharded"));
  meta.insert("sharded", layout);
  ember::engine::ShardedWrite how;
  how.max_over_ranks = [](double v) { return v; };
  ember::engine::prepare_sharded_checkpoint(shard, how);
  for (int64_t rank = 0; rank < 2; ++rank) ember::engine::write_sharded_part(shard, rank, at::full({1000}, static_cast<double>(rank)), meta);
  ember::engine::commit_sharded_checkpoint(shard, "", how);
  const auto whole = run_engine({"checkpoint", "verify", shard.string()}, dir.path());
  EXPECT_EQ(whole.exit_code, 0) << whole.err;
  for (const char* text : {"meta.ckpt: good: ", "rank0.ckpt: good: ", "rank1.ckpt: good: ", "sharded.ckpt: good: all 3 files"})
    EXPECT_NE(whole.out.find(text), std::string::npos) << text << " is missing from: " << whole.out;
  const fs::path part1 = shard / "rank1.ckpt";
  const auto part1_bytes = read_file(part1);
  const auto part_records = payload_records(part1);
  flip_bit(part1, part_records.front().offset, 1);
  const auto r = one_line_error(shard, {"1 of the 3 files of " + shard.string() + " are bad (listed above); the first: checkpoint " +
                                            part1.string() + " is damaged: record '" + part_records.front().name + "'"});
  EXPECT_NE(r.out.find(part1.string() + ": BAD: checkpoint "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rank0.ckpt: good: "), std::string::npos) << r.out;
  fs::remove(part1);
  one_line_error(shard, {"the first: sharded checkpoint " + shard.string() + " lacks rank1.ckpt (an incomplete copy?)"});
  write_file(part1, part1_bytes);
  EXPECT_EQ(run_engine({"checkpoint", "verify", shard.string()}, dir.path()).exit_code, 0);
}

// The optimizer's state is a torch::save archive inside the checkpoint, read by torch::load: its
// pickles' claims are checked when the checkpoint is loaded, so a crafted one (its checksums made
// right) ends a resume with one line instead of LibTorch's unpickler reserving a 32 GB memo.
TEST(CheckpointIntegrity, OptimizerStateClaimsAreCheckedBeforeTorchLoad) {
  TempDir dir("integrity");
  write_file(dir / "run.toml", kMlp);
  ASSERT_EQ(run_engine({"run.toml"}, dir.path()).exit_code, 0);
  const fs::path last = dir / "runs/run/version_0/checkpoints/last.ckpt";
  auto ck = ember::engine::load_checkpoint_file(last);
  const at::Tensor saved = ck.at("optimizer").toTensor().contiguous();
  const std::string real(static_cast<const char*>(saved.data_ptr()), static_cast<size_t>(saved.numel()));
  EXPECT_TRUE(ember::engine::check_nested_archive(real));
  // The same archive with one record replaced by `bad`.
  auto with_record = [&](const std::string& replaced, const std::string& bad) {
    std::string out;
    std::istringstream in(real);
    caffe2::serialize::PyTorchStreamReader reader(&in);
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* p, size_t n) {
      out.append(static_cast<const char*>(p), n);
      return n;
    });
    bool found = false;
    for (const auto& name : reader.getAllRecords()) {
      if (name == "version" || name.rfind(".data/", 0) == 0) continue;  // the writer adds its own
      if (name == replaced) {
        writer.writeRecord(name, bad.data(), bad.size());
        found = true;
        continue;
      }
      const auto [data, size] = reader.getRecord(name);
      writer.writeRecord(name, data.get(), size);
    }
    writer.writeEndOfFile();
    EXPECT_TRUE(found) << replaced;
    return out;
  };
  // A moment tensor's storage cut to 4 bytes: torch::load would size it by the pickle's claim and
  // read past the record; the check unpickles it with the record's size.
  EXPECT_THROW(
      {
        try {
          ember::engine::check_nested_archive(with_record("data/0", std::string(4, '\0')));
        } catch (const std::invalid_argument& e) {
          const std::string what = e.what();
          EXPECT_EQ(what.rfind("record data.pkl is not valid: tensor ", 0), 0u) << what;
          EXPECT_NE(what.find("offset 0) does not fit its storage of 4 bytes"), std::string::npos) << what;
          throw;
        }
      },
      std::invalid_argument);
  // Its data.pkl replaced: PROTO 2, NONE, LONG_BINPUT 2^31 - 1, STOP.
  const std::string crafted = with_record("data.pkl", std::string("\x80\x02Nr\xff\xff\xff\x7f.", 9));
  at::Tensor blob = at::empty({static_cast<int64_t>(crafted.size())}, at::kByte);
  std::memcpy(blob.data_ptr(), crafted.data(), crafted.size());
  ck.insert_or_assign("optimizer", blob);
  // `engine checkpoint verify` finds in the file what a resume would refuse: the real archive
  // passes, then each crafted one is named by its record in one line.
  const auto verified = run_engine({"checkpoint", "verify", last.string()}, dir.path());
  EXPECT_EQ(verified.exit_code, 0) << verified.err;
  EXPECT_NE(verified.out.find("the pickle reads, with the torch::save archive within (format 2)"), std::string::npos) << verified.out;
  auto verify_refuses = [&](const std::string& archive, const std::string& why) {
    at::Tensor t = at::empty({static_cast<int64_t>(archive.size())}, at::kByte);
    std::memcpy(t.data_ptr(), archive.data(), archive.size());
    ck.insert_or_assign("optimizer", t);
    ember::engine::save_checkpoint_file(last, ck);  // a new manifest: the checksums are right
    const auto v = run_engine({"checkpoint", "verify", last.string()}, dir.path());
    EXPECT_EQ(v.exit_code, 1) << v.out << v.err;
    EXPECT_NE(v.err.find("last.ckpt is not a valid checkpoint: its record 'data/"), std::string::npos) << v.err;
    EXPECT_NE(v.err.find("' holds a torch::save archive whose " + why), std::string::npos) << v.err;
    EXPECT_EQ(std::count(v.err.begin(), v.err.end(), '\n'), 1) << v.err;
  };
  // torch::load compiles the archive's TorchScript and runs a class's __setstate__ while it loads:
  // each line must be one of the attribute declarations torch::save writes.
  std::string source_record, source;
  {
    std::istringstream in(real);
    caffe2::serialize::PyTorchStreamReader reader(&in);
    for (const auto& name : reader.getAllRecords())
      if (source_record.empty() && name.rfind("code/__torch__/", 0) == 0 && name.ends_with(".py")) source_record = name;
    ASSERT_FALSE(source_record.empty());
    const auto [data, size] = reader.getRecord(source_record);
    source.assign(static_cast<const char*>(data.get()), size);
  }
  auto refused_with = [&](const std::string& archive) -> std::string {
    try {
      ember::engine::check_nested_archive(archive);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "(passed)";
  };
  // A __setstate__ that loops forever (a crafted one hung torch.jit.load until killed).
  const std::string looping = with_record(source_record, source +
                                                             "  def __getstate__(self) -> int:\n    return 0\n"
                                                             "  def __setstate__(self, state: int) -> None:\n    while True:\n      pass\n");
  const std::string at_def = "record " + source_record + " is not valid: its line " +
                             std::to_string(std::count(source.begin(), source.end(), '\n') + 1) + " (`  def __getstate__(self) -> int:`)";
  EXPECT_EQ(refused_with(looping).rfind(at_def + ": it is not an attribute declaration (`name : TYPE`); torch::load would compile it", 0), 0u)
      << refused_with(looping);
  // A type nested 100,000 deep (its compilation overflowed the stack of torch.jit.load: a segfault).
  std::string deep = source + "  extra : ";
  for (int i = 0; i < 100000; ++i) deep += "List[";
  deep += "int" + std::string(100000, ']') + "\n";
  EXPECT_NE(refused_with(with_record(source_record, deep)).find("its type nests deeper than 8"), std::string::npos);
  for (const std::string& line : {"  x : Tuple[float, (float)]", "import os", "  __parameters__ = [os.system]", "class Module(Module): pass",
                                  "  __annotations__[\"a\\\"b\"] = int", "    x : int", "  x = 1"})
    EXPECT_NE(refused_with(with_record(source_record, source + line + "\n")).find(" is not valid: its line "), std::string::npos) << line;
  verify_refuses(with_record("data/0", std::string(4, '\0')), "record data.pkl is not valid: tensor ");
  verify_refuses(with_record("data.pkl", std::string("\x80\x02Nr\xff\xff\xff\x7f.", 9)),
                 "record data.pkl is not valid: its pickle's memo index 2147483647");
  ember::engine::save_checkpoint_file(last, ck);  // a new manifest: the checksums are right
  const auto r = run_engine({"run.toml", "--set", "trainer.max_epochs=2", "--resume", "last"}, dir.path());
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("checkpoint runs/run/version_0/checkpoints/last.ckpt is not a valid checkpoint: its entry 'optimizer' holds a "
                       "torch::save archive whose record data.pkl is not valid: its pickle's memo index 2147483647"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("Exception raised from"), std::string::npos) << r.err;  // no LibTorch backtrace
  // A sharded part's optimizer serialization (sharded, offload) is checked when the part is read.
  const fs::path shard = dir / "sharded.ckpt";
  ember::engine::ShardedWrite how;
  how.max_over_ranks = [](double v) { return v; };
  ember::engine::prepare_sharded_checkpoint(shard, how);
  c10::impl::GenericDict part(c10::StringType::get(), c10::AnyType::get());
  part.insert("optimizer", blob);
  ember::engine::write_sharded_part(shard, 0, part, small_checkpoint(ember::engine::kCheckpointFormatVersion, false));
  ember::engine::commit_sharded_checkpoint(shard, "", how);
  try {
    ember::engine::read_sharded_part(shard, 0);
    ADD_FAILURE() << "a part with a crafted optimizer archive was read";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("rank0.ckpt is not a valid checkpoint: its entry 'part/optimizer' holds a torch::save archive "
                                         "whose record data.pkl is not valid: its pickle's memo index 2147483647"),
              std::string::npos)
        << e.what();
  }
  // Byte tensors that are no archive (quantized weights, a random-state blob) are left alone.
  EXPECT_FALSE(ember::engine::check_nested_archive("PK\x03\x04 but not an archive"));
}

TEST(CheckpointFile, Format1FilesStillLoad) {
  TempDir dir("integrity");
  // What engines before format 2 wrote: torch::jit::pickle_save of the dict, no manifest.
  const auto bytes = torch::jit::pickle_save(small_checkpoint(1, true));
  ember::engine::atomic_write(dir / "v1.ckpt", bytes.data(), bytes.size());
  auto ck = ember::engine::load_checkpoint_file(dir / "v1.ckpt");
  EXPECT_EQ(ck.at("format_version").toInt(), 1);
  EXPECT_TRUE(at::equal(ck.at("state_dict").toGenericDict().at("w").toTensor(), at::arange(12, at::kFloat).reshape({3, 4})));
  auto probe = ember::engine::probe_checkpoint_file(dir / "v1.ckpt");
  EXPECT_TRUE(probe.ember);
  EXPECT_TRUE(probe.weights_only);
  // A format 2 dict without the manifest was altered by something else: refused.
  const auto stripped = torch::jit::pickle_save(small_checkpoint(2, false));
  ember::engine::atomic_write(dir / "stripped.ckpt", stripped.data(), stripped.size());
  EXPECT_NE(load_error(dir / "stripped.ckpt").find("lacks its manifest"), std::string::npos);
}

TEST(CheckpointFile, ProbeReadsTheManifestOnly) {
  TempDir dir("integrity");
  ember::engine::save_checkpoint_file(dir / "w.ckpt", small_checkpoint(ember::engine::kCheckpointFormatVersion, true));
  ember::engine::save_checkpoint_file(dir / "full.ckpt", small_checkpoint(ember::engine::kCheckpointFormatVersion, false));
  write_file(dir / "junk.ckpt", "not a checkpoint");
  auto w = ember::engine::probe_checkpoint_file(dir / "w.ckpt");
  EXPECT_TRUE(w.ember && w.weights_only);
  auto full = ember::engine::probe_checkpoint_file(dir / "full.ckpt");
  EXPECT_TRUE(full.ember && !full.weights_only);
  auto junk = ember::engine::probe_checkpoint_file(dir / "junk.ckpt");
  EXPECT_FALSE(junk.ember);
  EXPECT_FALSE(junk.why.empty());
  EXPECT_FALSE(ember::engine::probe_checkpoint_file(dir / "missing.ckpt").ember);
}

TEST(CheckpointFile, ContainerTypesSurviveTheUntaggedPickle) {
  // The file is pickled without LibTorch's type tags (so torch.load takes it), yet C++ readers get
  // back the static types they saved: plugins call toDoubleList, toTensorVector, toTypedDict.
  TempDir dir("integrity");
  auto ck = small_checkpoint(ember::engine::kCheckpointFormatVersion, false);
  c10::impl::GenericDict state(c10::StringType::get(), c10::AnyType::get());
  state.insert("floats", c10::List<double>({0.5, 0.25}));
  state.insert("ints", c10::List<int64_t>({3, 4}));
  state.insert("tensors", c10::List<at::Tensor>({at::ones({2}), at::zeros({1})}));
  state.insert("no_tensors", c10::List<at::Tensor>());
  state.insert("bools", c10::List<bool>({true}));
  state.insert("nested", c10::List<c10::List<int64_t>>({c10::List<int64_t>({1}), c10::List<int64_t>()}));
  c10::Dict<std::string, double> scores_in;
  scores_in.insert("a.ckpt", 0.5);
  state.insert("scores", scores_in);
  state.insert("none", c10::IValue());
  ck.insert("callbacks", state);
  ember::engine::save_checkpoint_file(dir / "typed.ckpt", ck);
  auto back = ember::engine::load_checkpoint_file(dir / "typed.ckpt");
  auto s = back.at("callbacks").toGenericDict();
  EXPECT_EQ(s.at("floats").toDoubleVector(), (std::vector<double>{0.5, 0.25}));
  EXPECT_EQ(s.at("ints").toIntVector(), (std::vector<int64_t>{3, 4}));
  ASSERT_TRUE(s.at("tensors").isTensorList());
  EXPECT_TRUE(at::equal(s.at("tensors").toTensorVector().at(0), at::ones({2})));
  EXPECT_TRUE(s.at("no_tensors").isTensorList());
  EXPECT_TRUE(s.at("bools").isBoolList());
  EXPECT_EQ(*s.at("nested").type(), *c10::ListType::create(c10::ListType::ofInts()));
  auto scores = c10::impl::toTypedDict<std::string, double>(s.at("scores").toGenericDict());
  EXPECT_DOUBLE_EQ(scores.at("a.ckpt"), 0.5);
  EXPECT_TRUE(s.at("none").isNone());
  auto sd = c10::impl::toTypedDict<std::string, at::Tensor>(back.at("state_dict").toGenericDict());
  EXPECT_EQ(sd.size(), 1u);
}

// A pickle whose checksums are right but whose sizes lie (found by the fuzz test under
// AddressSanitizer: a LONG_BINPUT memo index made LibTorch's unpickler reserve 25.6 GB) is refused
// in one line before the unpickler sees it: a huge memo index, and a string longer than the pickle.
TEST(CheckpointIntegrity, PickleSizeClaimsAreCheckedBeforeUnpickling) {
  TempDir dir("integrity");
  const fs::path good = dir / "good.ckpt";
  ember::engine::save_checkpoint_file(good, small_checkpoint(ember::engine::kCheckpointFormatVersion, false));
  const std::string bytes = read_file(good);
  Record pkl;
  for (const auto& r : payload_records(good))
    if (r.name == "data.pkl") pkl = r;
  ASSERT_GT(pkl.size, 0u);
  // The key "format" (BINUNICODE: 'X', 4-byte length 6, the text) becomes LONG_BINPUT ('r') of
  // index 2^31 - 1, then a BINUNICODE of 2^31 - 1 bytes.
  const auto text = bytes.find("format", pkl.offset);
  ASSERT_LT(text, pkl.offset + pkl.size);
  const size_t at = text - 5;
  ASSERT_EQ(bytes.substr(at, 5), std::string("X\x06\x00\x00\x00", 5)) << "not BINUNICODE: the pickler changed";
  // Protocol 4's BINUNICODE8 / BINBYTES8 (8-byte lengths) overwrite the opcode, its length and
  // the first bytes of the text in place (libFuzzer found a 2^58-byte claim).
  const std::string len4("\xff\xff\xff\x7f", 4), len8("\xff\xff\xff\xff\xff\xff\xff\x3f", 8);
  struct Case {
    char op;
    std::string length, what;
  };
  for (const auto& [op, length, what] : {Case{'r', len4, "memo index 2147483647"}, Case{'X', len4, "claims 2147483647 bytes"},
                                         Case{'\x8d', len8, "claims 4611686018427387903 bytes"},
                                         Case{'\x8e', len8, "claims 4611686018427387903 bytes"}}) {
    std::string bad = bytes;
    bad[at] = op;
    bad.replace(at + 1, length.size(), length);
    const fs::path file = dir / "bad.ckpt";
    write_file(file, ember::engine::reseal_checkpoint_bytes(bad));
    const std::string err = load_error(file);
    EXPECT_NE(err.find("checkpoint " + file.string() + " is not a valid checkpoint: its pickle's"), std::string::npos) << err;
    EXPECT_NE(err.find(what), std::string::npos) << err;
    EXPECT_EQ(err.find('\n'), std::string::npos) << err;
    // Plugins read it through the same guards (the checkpoint callback's `best` lookup).
    std::string skeleton_err;
    try {
      ember::support::read_checkpoint_skeleton(file.string());
    } catch (const std::runtime_error& e) {
      skeleton_err = e.what();
    }
    EXPECT_NE(skeleton_err.find(file.string() + " is not a readable checkpoint: its pickle's"), std::string::npos) << skeleton_err;
    EXPECT_NE(skeleton_err.find(what), std::string::npos) << skeleton_err;
    EXPECT_EQ(skeleton_err.find('\n'), std::string::npos) << skeleton_err;
  }
  // The walk goes past opcodes LibTorch reads that its own pickler never writes (MARK, DICT
  // here): libFuzzer's LONG_BINPUT after a DICT claimed a 31 GB memo the walk never saw.
  std::string bad = bytes;
  bad.replace(at, 7, std::string("(dr\xa0\x86\x01\x00", 7));  // memo index 100000
  write_file(dir / "bad.ckpt", ember::engine::reseal_checkpoint_bytes(bad));
  const std::string err = load_error(dir / "bad.ckpt");
  EXPECT_NE(err.find("its pickle's memo index 100000 at byte"), std::string::npos) << err;
}

// read_checkpoint_skeleton (Ember::checkpoint_read): the entries of a checkpoint and its tensors'
// shapes and dtypes, without any tensor data: it reads a copy that holds data.pkl alone.
TEST(CheckpointIntegrity, SkeletonHasTheEntriesAndTensorShapesWithoutTheirData) {
  TempDir dir("integrity");
  const fs::path good = dir / "good.ckpt";
  auto ck = small_checkpoint(ember::engine::kCheckpointFormatVersion, false);
  ck.insert("global_step", int64_t{12});
  ember::engine::save_checkpoint_file(good, ck);
  const fs::path pickle_only = dir / "pickle_only.ckpt";
  {
    caffe2::serialize::PyTorchStreamReader reader(good.string());
    const auto [data, size] = reader.getRecord("data.pkl");
    std::ofstream out(pickle_only, std::ios::binary);
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* p, size_t n) -> size_t {
      out.write(static_cast<const char*>(p), static_cast<std::streamsize>(n));
      return n;
    });
    writer.writeRecord("data.pkl", data.get(), size);
    writer.writeEndOfFile();
  }
  for (const fs::path& file : {good, pickle_only}) {
    const c10::IValue root = ember::support::read_checkpoint_skeleton(file.string());
    ASSERT_TRUE(root.isGenericDict()) << file;
    const auto d = root.toGenericDict();
    EXPECT_EQ(d.at("global_step").toInt(), 12) << file;
    EXPECT_EQ(d.at("format").toStringRef(), ember::engine::kCheckpointFormat) << file;
    const at::Tensor w = d.at("state_dict").toGenericDict().at("w").toTensor();
    EXPECT_TRUE(w.is_meta()) << file;
    EXPECT_EQ(w.sizes(), at::IntArrayRef({3, 4})) << file;
    EXPECT_EQ(w.scalar_type(), at::kFloat) << file;
  }
  // Not a checkpoint at all, and no file: one line naming it.
  write_file(dir / "text.ckpt", "not a zip\n");
  for (const fs::path& file : {dir / "text.ckpt", dir / "missing.ckpt"}) {
    std::string err;
    try {
      ember::support::read_checkpoint_skeleton(file.string());
    } catch (const std::runtime_error& e) {
      err = e.what();
    }
    EXPECT_NE(err.find(file.string()), std::string::npos) << err;
    EXPECT_EQ(err.find('\n'), std::string::npos) << err;
  }
}

// A verified checkpoint's tensors use the file's bytes where they lie (one copy of the file in
// memory while it loads, not two), stay valid after the loader returns, and are the saved values.
TEST(CheckpointFile, LoadedTensorsShareTheFilesBytesInsteadOfACopy) {
  TempDir dir("integrity_shared");
  auto ck = small_checkpoint(ember::engine::kCheckpointFormatVersion, false);
  auto sd = ck.at("state_dict").toGenericDict();
  sd.insert("v", at::linspace(-1, 1, 1000, at::kDouble));
  ember::engine::save_checkpoint_file(dir / "shared.ckpt", ck);
  size_t offset_w = 0, offset_v = 0;
  {
    // Which record holds which tensor: the pickler numbers storages in the order it meets them.
    caffe2::serialize::PyTorchStreamReader reader((dir / "shared.ckpt").string());
    offset_w = reader.getRecordOffset("data/0");
    offset_v = reader.getRecordOffset("data/1");
  }
  auto loaded = ember::engine::load_checkpoint_file(dir / "shared.ckpt").at("state_dict").toGenericDict();
  const at::Tensor w = loaded.at("w").toTensor(), v = loaded.at("v").toTensor();
  const auto* pw = static_cast<const char*>(w.data_ptr()), *pv = static_cast<const char*>(v.data_ptr());
  EXPECT_EQ(pv - pw, static_cast<std::ptrdiff_t>(offset_v) - static_cast<std::ptrdiff_t>(offset_w))
      << "the tensors do not lie where their records lie in one buffer: the load copied them";
  EXPECT_TRUE(at::equal(w, at::arange(12, at::kFloat).reshape({3, 4})));
  EXPECT_TRUE(at::equal(v, at::linspace(-1, 1, 1000, at::kDouble)));
  // The bytes are checked before they are shared: a flipped bit in a tensor is still refused.
  flip_bit(dir / "shared.ckpt", offset_v + 100, 3);
  EXPECT_NE(load_error(dir / "shared.ckpt").find("fails its CRC32C check"), std::string::npos);
}
