// Checkpoints written in the background (checkpoint.async = true, ITrainerAsyncCheckpoints): the
// same files and weights as synchronous saves, resumable exactly; a write that fails stops the run
// on every rank; SIGKILL while a write is in flight leaves the previous checkpoint whole and the
// restarted run ends exactly where an uninterrupted one does; under sharded each rank writes its
// part in the background.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "checkpoint/background_write.h"
#include "checkpoint/checkpoint_io.h"
#include "checkpoint_support.h"
#include "support.h"

using namespace ember::test;
namespace fs = std::filesystem;

namespace {
// 6 batches per epoch; Adam, dropout-free CNN, deterministic: two runs of the same steps are equal
// bit for bit. `hidden` sets the size of the state (the kill test wants writes that take a while).
std::string cnn_run(int hidden, bool monitor) {
  return std::string(R"(
[trainer]
deterministic = true
num_sanity_val_steps = 0
enable_progress_bar = false
enable_model_summary = false
max_epochs = -1
[checkpoint]
)") + (monitor ? "monitor = \"val_loss\"\nsave_top_k = 2\n" : "") + "every_n_train_steps = 2\n" + small_cnn_toml(hidden);
}

std::set<std::string> files_in(const fs::path& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

const std::vector<std::string> kAsync = {"--set", "checkpoint.async=true"};

std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}
}  // namespace

// Top-k by val_loss (files leave the top 2 and are deleted) and last.ckpt every 2 steps: the
// asynchronous run (single_device: the live tensors copied once) leaves exactly the files of the
// synchronous one, with the same weights and
// bookkeeping, no temporary file behind; a run stopped at step 8 and resumed from its
// asynchronous last.ckpt ends with the weights of the uninterrupted run.
TEST(AsyncCheckpoint, SameFilesAndWeightsAsSynchronousSavesAndResumesExactly) {
  TempDir sync_dir("async_ckpt"), async_dir("async_ckpt"), split("async_ckpt");
  for (const auto* d : {&sync_dir, &async_dir, &split}) write_file(*d / "run.toml", cnn_run(16, /*monitor=*/true));
  const std::vector<std::string> run = {"run.toml", "--set", "trainer.max_steps=15"};
  run_engine_ok(sync_dir, run);
  const auto async_run = run_engine_ok(async_dir, with(with(run, kAsync), {"--verbose"}));
  // single_device hands over its live tensors (IDeviceModelState): each is copied once.
  EXPECT_NE(async_run.err.find("copied for a background write in"), std::string::npos) << async_run.err;
  EXPECT_NE(async_run.err.find("(from the model's own tensors)"), std::string::npos) << async_run.err;
  const fs::path sync_ckpts = sync_dir / "runs/run/version_0/checkpoints", async_ckpts = async_dir / "runs/run/version_0/checkpoints";
  const auto names = files_in(sync_ckpts);
  EXPECT_EQ(names.size(), 3u) << "2 top-k files and last.ckpt";
  EXPECT_EQ(files_in(async_ckpts), names) << "no temporary file left, and the files that left the top k were deleted";
  for (const auto& n : names) {
    expect_identical_weights(sync_ckpts / n, async_ckpts / n);
    auto a = ember::engine::load_checkpoint_file(sync_ckpts / n), b = ember::engine::load_checkpoint_file(async_ckpts / n);
    EXPECT_EQ(a.at("global_step").toInt(), b.at("global_step").toInt()) << n;
    const auto topk = [](const c10::impl::GenericDict& ck) {
      return ck.at("callbacks").toGenericDict().at("checkpoint").toGenericDict().at("best_model_path").toStringRef();
    };
    EXPECT_EQ(fs::path(topk(a)).filename(), fs::path(topk(b)).filename()) << n;
  }
  run_engine_ok(split, with({"run.toml", "--set", "trainer.max_steps=8"}, kAsync));
  auto resumed = run_engine_ok(split, with({"run.toml", "--set", "trainer.max_steps=15", "--resume", "last"}, kAsync));
  EXPECT_NE(resumed.err.find("(batch 2 of the epoch)"), std::string::npos) << resumed.err;
  expect_identical_weights(last_checkpoint(sync_dir), last_checkpoint(split));
}

// The folder cannot be written (a path under a regular file): the background write fails, and
// the run stops at the next step with the reason and a non-zero exit, as a synchronous save does.
TEST(AsyncCheckpoint, AFailedBackgroundWriteStopsTheRun) {
  TempDir dir("async_ckpt");
  write_file(dir / "run.toml", cnn_run(16, /*monitor=*/false));
  const std::string bad = "checkpoint.dirpath=\"" + (dir / "run.toml" / "ckpts").string() + "\"";
  auto r = run_engine(with({"run.toml", "--set", "trainer.max_steps=30", "--set", bad}, kAsync), dir.path());
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("cannot write checkpoint " + (dir / "run.toml" / "ckpts").string()), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("Not a directory"), std::string::npos) << r.err;
}

// The same under 2 ddp ranks: rank 0 writes, and both ranks stop with it at the same step.
TEST(AsyncCheckpoint, AFailedBackgroundWriteStopsEveryRank) {
  EMBER_SKIP_WITHOUT_MPI();
  TempDir dir("async_ckpt");
  write_file(dir / "run.toml", cnn_run(16, /*monitor=*/false));
  const std::string bad = "checkpoint.dirpath=\"" + (dir / "run.toml" / "ckpts").string() + "\"";
  auto r = run_engine(with({"run.toml", "--plugins", "ddp", "--set", "ddp.timeout=20.0", "--set", "trainer.devices=2", "--set",
                            "trainer.accelerator=\"cpu\"", "--set", "data.batch_size=16", "--set", "trainer.max_steps=30", "--set", bad},
                           kAsync),
                      dir.path(), {}, 120);
  EXPECT_FALSE(r.timed_out) << "a rank was left waiting";
  EXPECT_NE(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("cannot write checkpoint"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("rank 0 could not write checkpoint"), std::string::npos) << "rank 1 says why it stops: " << r.err;
}

// SIGKILL right after a save was handed to the background writer (the chaos test plugin kills at
// the start of the next step's batch), 20 times at 20 different steps: each time the previous
// checkpoint loads (checksums), and the job started again (as torchrun's agent does, with a
// restart count) resumes from the last checkpoint that was complete and ends with exactly the
// weights of an uninterrupted run. A kill that leaves the previous step in last.ckpt, or a temporary
// file, landed while the write was in flight: most of them must (the test fails otherwise).
TEST(AsyncCheckpoint, KilledDuringBackgroundWritesResumesExactly20Times) {
  TempDir reference("async_ckpt");
  write_file(reference / "run.toml", cnn_run(1024, /*monitor=*/false));
  const std::vector<std::string> common = {"run.toml", "--set", "trainer.max_steps=24", "--set", "checkpoint.every_n_train_steps=1"};
  run_engine_ok(reference, common);
  int mid_write = 0, partial_files = 0;
  for (int step = 2; step < 22; ++step) {
    SCOPED_TRACE("killed at step " + std::to_string(step));
    TempDir dir("async_ckpt");
    write_file(dir / "run.toml", cnn_run(1024, /*monitor=*/false));
    const auto cmd = with(with({"--plugin-path", test_plugin_dir("good").string(), "--plugins", "chaos", "--set", "chaos.rank=0", "--set",
                                "chaos.step=" + std::to_string(step)},
                               common),
                          kAsync);
    auto killed = run_engine(cmd, dir.path(), {{"TORCHELASTIC_RESTART_COUNT", "0"}});
    ASSERT_NE(killed.exit_code, 0) << "the first attempt was to be killed";
    const fs::path folder = dir / "runs/run/version_0/checkpoints";
    bool temporary = false;
    for (const auto& n : files_in(folder)) temporary = temporary || n.find(".tmp.") != std::string::npos;
    // The newest complete checkpoint loads (checksums): the step before, or this one when its
    // write was done. The step before, or a temporary file, means the kill landed while this
    // step's write was in flight.
    const int64_t saved = ember::engine::load_checkpoint_file(folder / "last.ckpt").at("global_step").toInt();
    EXPECT_TRUE(saved == step || saved == step - 1) << saved;
    mid_write += temporary || saved == step - 1 ? 1 : 0;
    partial_files += temporary ? 1 : 0;
    auto again = run_engine(cmd, dir.path(), {{"TORCHELASTIC_RESTART_COUNT", "1"}});
    ASSERT_EQ(again.exit_code, 0) << again.err;
    EXPECT_NE(again.err.find("resumed from"), std::string::npos) << again.err;
    expect_identical_weights(last_checkpoint(reference), last_checkpoint(dir));
  }
  std::printf("[ async ] %d of 20 kills landed while a checkpoint was being written (%d left a partial file)\n", mid_write, partial_files);
  EXPECT_GE(mid_write, 10) << "the kills should land while the write is in flight";
}

// sharded with state_dict_type = "sharded": every rank writes its part in the background, rank 0
// commits the directory once all are on disk. Stopped at step 8 and resumed: the weights of the
// uninterrupted synchronous run.
TEST(AsyncCheckpoint, ShardedRanksWriteTheirPartsInTheBackground) {
  EMBER_SKIP_WITHOUT_MPI();
  TempDir full("async_ckpt"), split("async_ckpt");
  for (const auto* d : {&full, &split}) write_file(*d / "run.toml", cnn_run(16, /*monitor=*/false));
  const std::vector<std::string> sharded = {"run.toml", "--plugins", "sharded", "--set", "sharded.timeout=30.0", "--set", "sharded.stage=3",
                                            "--set", "sharded.state_dict_type=\"sharded\"", "--set", "trainer.devices=2", "--set",
                                            "trainer.accelerator=\"cpu\"", "--set", "data.batch_size=16"};
  run_engine_ok(full, with(sharded, {"--set", "trainer.max_steps=15"}));
  auto first = run_engine_ok(split, with(with(with(sharded, {"--set", "trainer.max_steps=8"}), kAsync), {"--verbose"}));
  // The parts sharded_state copied to the host go to the writer as they are (no second copy).
  EXPECT_NE(first.err.find(" KiB of the part as the strategy copied it, not copied again)"), std::string::npos) << first.err;
  const fs::path saved = last_checkpoint(split);
  ASSERT_TRUE(fs::is_directory(saved)) << saved;
  for (const char* f : {"meta.ckpt", "rank0.ckpt", "rank1.ckpt"}) EXPECT_TRUE(fs::is_regular_file(saved / f)) << f;
  EXPECT_FALSE(fs::exists(saved.parent_path() / ".last.ckpt.partial"));
  auto resumed = run_engine_ok(split, with(with(sharded, {"--set", "trainer.max_steps=15", "--resume", "last"}), kAsync));
  EXPECT_NE(resumed.err.find("resumed from"), std::string::npos) << resumed.err;
  EXPECT_EQ(max_weight_difference(last_checkpoint(full), last_checkpoint(split)), 0.0);
}

// sharded with the default whole-model checkpoint: the whole model full_model_state gathered onto
// rank 0's host goes to the writer as it is (no second copy), and the file holds the weights of
// the synchronous save.
TEST(AsyncCheckpoint, ShardedWholeModelGoesToTheWriterWithoutASecondCopy) {
  EMBER_SKIP_WITHOUT_MPI();
  TempDir sync_dir("async_ckpt"), async_dir("async_ckpt");
  for (const auto* d : {&sync_dir, &async_dir}) write_file(*d / "run.toml", cnn_run(16, /*monitor=*/false));
  const std::vector<std::string> sharded = {"run.toml", "--plugins", "sharded", "--set", "sharded.timeout=30.0", "--set", "sharded.stage=3",
                                            "--set", "trainer.devices=2", "--set", "trainer.accelerator=\"cpu\"", "--set", "data.batch_size=16",
                                            "--set", "trainer.max_steps=6"};
  run_engine_ok(sync_dir, sharded);
  auto async_run = run_engine_ok(async_dir, with(with(sharded, kAsync), {"--verbose"}));
  EXPECT_NE(async_run.err.find(" KiB of the model as the strategy copied it, not copied again)"), std::string::npos) << async_run.err;
  ASSERT_TRUE(fs::is_regular_file(last_checkpoint(async_dir))) << last_checkpoint(async_dir);
  expect_identical_weights(last_checkpoint(sync_dir), last_checkpoint(async_dir));
}

// take_host_snapshot takes a host tensor only where nothing else could change it afterwards: the
// tensor, its storage and every dictionary on the way held by the handed-over value alone. All the
// rest is copied, as host_snapshot copies everything.
TEST(AsyncCheckpoint, TakeHostSnapshotTakesOnlyWhatNothingElseHolds) {
  using Dict = c10::impl::GenericDict;
  auto dict = [] { return Dict(c10::StringType::get(), c10::AnyType::get()); };
  const at::Tensor kept_outside = at::ones({4});
  const at::Tensor base = at::ones({8});
  float blob[4] = {1, 2, 3, 4};
  Dict held_dict = dict();
  held_dict.insert("t", at::ones({4}));
  const void* sole = nullptr;
  const void* inner_sole = nullptr;
  // As a strategy's sharded_state returns it: the dictionaries built inside, returned as an IValue.
  auto make_part = [&]() -> c10::IValue {
    Dict part = dict(), inner = dict();
    inner.insert("sole", at::full({16}, 2.0));
    part.insert("inner", inner);
    part.insert("sole", at::full({32}, 3.0));
    part.insert("shared", kept_outside);                           // also referenced here
    part.insert("view", base.slice(0, 0, 4));                      // its storage is base's too
    part.insert("blob", at::from_blob(blob, {4}, at::kFloat));     // memory the storage does not own
    part.insert("held_dict", held_dict);                           // the dictionary is held here
    part.insert("list", c10::List<at::Tensor>({at::ones({2})}));  // lists are always copied
    sole = part.at("sole").toTensor().data_ptr();
    inner_sole = inner.at("sole").toTensor().data_ptr();
    return part;
  };
  int64_t taken = 0;
  const auto out = ember::engine::take_host_snapshot(make_part(), &taken).toGenericDict();
  EXPECT_EQ(out.at("sole").toTensor().data_ptr(), sole);
  EXPECT_EQ(out.at("inner").toGenericDict().at("sole").toTensor().data_ptr(), inner_sole);
  EXPECT_EQ(taken, (32 + 16) * 4);
  EXPECT_NE(out.at("shared").toTensor().data_ptr(), kept_outside.data_ptr());
  EXPECT_NE(out.at("view").toTensor().data_ptr(), base.data_ptr());
  EXPECT_NE(out.at("blob").toTensor().data_ptr(), static_cast<void*>(blob));
  EXPECT_NE(out.at("held_dict").toGenericDict().at("t").toTensor().data_ptr(), held_dict.at("t").toTensor().data_ptr());
  EXPECT_TRUE(at::equal(out.at("blob").toTensor(), at::tensor({1.0f, 2.0f, 3.0f, 4.0f})));
  EXPECT_TRUE(at::equal(out.at("view").toTensor(), at::ones({4})));
  EXPECT_EQ(out.at("list").toTensorList().size(), 1u);
  // A value the caller still holds elsewhere is copied whole.
  Dict still_held = dict();
  still_held.insert("t", at::ones({4}));
  taken = 0;
  const auto copied = ember::engine::take_host_snapshot(c10::IValue(still_held), &taken).toGenericDict();
  EXPECT_EQ(taken, 0);
  EXPECT_NE(copied.at("t").toTensor().data_ptr(), still_held.at("t").toTensor().data_ptr());
}
