// Checkpoints: top-k bookkeeping (unit and through real runs), file names, and atomic writes that
// never leave a half-written file behind, even when the writer is killed mid-write.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include <caffe2/serialize/inline_container.h>  // the test copies a checkpoint's records

#include "checkpoint/checkpoint_io.h"
#include "checkpoint_folder.h"
#include "checkpoint_support.h"
#include "filename_template.h"
#include "support.h"
#include "topk.h"

using namespace ember::test;
namespace fs = std::filesystem;
namespace ck = ember_checkpoint;

TEST(CheckpointTopK, KeepsTheKBestAndDropsTheKth) {
  ck::TopK topk(ck::Mode::min, 2);
  std::vector<std::string> dropped;
  int n = 0;
  for (double score : {0.5, 0.3, 0.4, 0.1, 0.2}) {
    ++n;
    if (!topk.should_save(score)) continue;
    auto added = topk.add(score, [&](const std::string&) { return "e" + std::to_string(n); });
    if (!added.dropped.empty()) dropped.push_back(added.dropped);
  }
  const auto& s = topk.state();
  ASSERT_EQ(s.best_k_models.size(), 2u);
  EXPECT_EQ(s.best_model_path, "e4");
  EXPECT_DOUBLE_EQ(*s.best_model_score, 0.1);
  EXPECT_EQ(s.kth_best_model_path, "e5");
  EXPECT_EQ(dropped, (std::vector<std::string>{"e1", "e3", "e2"}));
}

TEST(CheckpointTopK, NonFiniteNeverBecomesBest) {
  ck::TopK topk(ck::Mode::max, 3);
  topk.add(topk.score_of(std::nan("")), [](const std::string&) { return "nan"; });
  EXPECT_TRUE(topk.state().best_model_path.empty());
  topk.add(topk.score_of(0.7), [](const std::string&) { return "ok"; });
  EXPECT_EQ(topk.state().best_model_path, "ok");
}

TEST(CheckpointFilename, LightningTemplate) {
  ck::FilenameTemplate t("{epoch}-{val_loss:.2f}");
  auto lookup = [](const std::string& n) -> std::optional<double> {
    if (n == "epoch") return 3;
    if (n == "val_loss") return 0.2549;
    return std::nullopt;
  };
  EXPECT_EQ(t.format(lookup, true), "epoch=3-val_loss=0.25");
  EXPECT_EQ(t.format(lookup, false), "3-0.25");
  EXPECT_THROW(ck::FilenameTemplate("{epoch").names(), std::invalid_argument);
  EXPECT_THROW(ck::FilenameTemplate("{nope}").format(lookup, true), ck::UnknownName);
}

TEST(CheckpointRun, TopKFilesOnDiskFollowTheMonitoredMetric) {
  TempDir dir("ckpt");
  write_file(dir / "run.toml", R"(
[trainer]
max_epochs = 5
limit_train_batches = 2
num_sanity_val_steps = 0
enable_progress_bar = false
[model]
name = "mlp"
input_size = 8
hidden = [4]
[data]
name = "synthetic"
shape = [8]
num_train = 64
batch_size = 16
[hook_recorder]
scripted_values = [0.5, 0.3, 0.4, 0.1, 0.2]
[checkpoint]
monitor = "score"
save_top_k = 2
filename = "{epoch}-{score:.1f}"
)");
  for (const char* mode : {"min", "max"}) {
    auto r = run_engine({"run.toml", "--plugin-path", test_plugin_dir("good").string(), "--plugins", "hook_recorder",
                         "--set", std::string("checkpoint.mode=") + mode},
                        dir.path());
    ASSERT_EQ(r.exit_code, 0) << r.err;
  }
  auto files = [&](const char* version) {
    std::set<std::string> names;
    for (const auto& e : fs::directory_iterator(dir / "runs/run" / version / "checkpoints")) names.insert(e.path().filename());
    return names;
  };
  EXPECT_EQ(files("version_0"), (std::set<std::string>{"epoch=3-score=0.1.ckpt", "epoch=4-score=0.2.ckpt", "last.ckpt"}));
  EXPECT_EQ(files("version_1"), (std::set<std::string>{"epoch=0-score=0.5.ckpt", "epoch=2-score=0.4.ckpt", "last.ckpt"}));
  // The saved state names the best file, so `--resume best` finds it.
  auto last = ember::engine::load_checkpoint_file(dir / "runs/run/version_0/checkpoints/last.ckpt");
  auto state = last.at("callbacks").toGenericDict().at("checkpoint").toGenericDict();
  EXPECT_NE(state.at("best_model_path").toStringRef().find("epoch=3-score=0.1.ckpt"), std::string::npos);
}

// A tiny mlp on 32 synthetic samples for `epochs` epochs; `tail` adds settings (the [data]
// table is last open, then whatever tables `tail` starts).
std::string tiny_mlp_run(int epochs, const std::string& tail) { return tiny_mlp_toml(epochs, "num_train = 32\n" + tail); }

TEST(CheckpointRun, MissingMonitorIsAnErrorWithSuggestion) {
  TempDir dir("ckpt");
  write_file(dir / "run.toml", tiny_mlp_run(1, "[checkpoint]\nmonitor = \"val_los\"\n"));
  auto r = run_engine({"run.toml"}, dir.path());
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("did you mean 'val_loss'"), std::string::npos) << r.err;
}

// Lightning's rule: every_n_train_steps and an every_n_epochs the user gave are mutually
// exclusive (one line); every_n_train_steps alone turns saving by epoch off. A run's own
// config.toml (the resolved configuration, every key that has a value) trains again: it does not
// state the unset every_n_epochs, so it is no conflict.
TEST(CheckpointRun, StepAndEpochTriggersAndTheRunsOwnConfigTrainsAgain) {
  TempDir dir("ckpt");
  write_file(dir / "run.toml", tiny_mlp_run(2, "batch_size = 8\n[checkpoint]\nevery_n_train_steps = 3\nsave_top_k = -1\n"));
  auto both = run_engine({"run.toml", "--set", "checkpoint.every_n_epochs=1"}, dir.path());
  EXPECT_EQ(both.exit_code, 2) << both.err;
  EXPECT_NE(both.err.find("every_n_epochs = 1 and every_n_train_steps = 3 are mutually exclusive"), std::string::npos) << both.err;
  run_engine_ok(dir, {"run.toml"});
  // 8 steps: saves at steps 3 and 6 only (not at the epoch ends, steps 4 and 8), and last.ckpt.
  EXPECT_TRUE(std::filesystem::exists(dir / "runs/run/version_0/checkpoints/epoch=0-step=3.ckpt"));
  EXPECT_FALSE(std::filesystem::exists(dir / "runs/run/version_0/checkpoints/epoch=0-step=4.ckpt"));
  const std::string resolved = read_file(dir / "runs/run/version_0/config.toml");
  EXPECT_EQ(resolved.find("\nevery_n_epochs ="), std::string::npos) << resolved;
  auto again = run_engine({"runs/run/version_0/config.toml", "--set", "trainer.default_root_dir=\"again\""}, dir.path());
  EXPECT_EQ(again.exit_code, 0) << again.err;
}

// checkpoint.save_on_exception (Lightning's): training that fails with an error saves the state it
// had reached to on_exception.ckpt, and `--resume last` continues from it to the weights of a run
// that never failed. A failure inside an optimizer update or an accumulation window (weights,
// optimizer and position disagree there), or after nothing was trained since the last save,
// saves nothing, and the log says why; the run's own error is what it reports either way.
TEST(CheckpointRun, SaveOnExceptionKeepsTheStateAFailedRunReached) {
  auto with = [](std::vector<std::string> a, const std::vector<std::string>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  const std::vector<std::string> chaos = {"--plugin-path", test_plugin_dir("good").string(), "--plugins", "chaos",
                                          "--set",         "chaos.rank=0",                   "--set",     "chaos.action=\"throw\""};
  {
    TempDir dir("ckpt_exception");
    write_file(dir / "run.toml", tiny_mlp_run(2, "batch_size = 8\n[checkpoint]\nsave_on_exception = true\n"));
    // Fails at the start of step 6's batch (epoch 1, batch 2); last.ckpt holds epoch 0 (step 4).
    auto failed = run_engine(with({"run.toml", "--set", "chaos.step=6"}, chaos), dir.path());
    EXPECT_EQ(failed.exit_code, 1) << failed.err;
    EXPECT_NE(failed.err.find("chaos: thrown at step 6, batch 2 (on_train_batch_start)"), std::string::npos) << failed.err;
    const fs::path saved = fs::absolute(dir / "runs/run/version_0/checkpoints/on_exception.ckpt").lexically_normal();
    EXPECT_NE(failed.err.find("checkpoint: training failed at step 6; its state is in " + saved.string() + " (--resume last continues from it)"),
              std::string::npos)
        << failed.err;
    ASSERT_TRUE(fs::exists(saved));
    EXPECT_EQ(ember::engine::load_checkpoint_file(saved).at("global_step").toInt(), 6);
    auto resumed = run_engine_ok(dir, {"run.toml", "--resume", "last"});
    EXPECT_NE(resumed.err.find("at epoch 1, step 6 (batch 2 of the epoch)"), std::string::npos) << resumed.err;
    run_engine_ok(dir, {"run.toml"});  // version_1: the same two epochs without a failure
    expect_identical_weights(last_checkpoint(dir, 1), last_checkpoint(dir, 0));
  }
  struct Refused {
    std::vector<std::string> args;
    std::string why;
  };
  for (const Refused& c :
       {Refused{{"--set", "chaos.step=6", "--set", "chaos.hook=\"on_before_optimizer_step\""},
                "checkpoint: save_on_exception: the run failed inside an optimizer update or an accumulation window, where weights, optimizer "
                "and position disagree, so it is not saved: the last checkpoint stands"},
        // Batches 2 and 3 make step 2's window: the failure comes at its second batch.
        Refused{{"--set", "chaos.step=1", "--set", "chaos.batch=3", "--set", "trainer.accumulate_grad_batches=2"},
                "checkpoint: save_on_exception: the run failed inside an optimizer update or an accumulation window"},
        Refused{{"--set", "chaos.step=4"}, "checkpoint: nothing trained since the last checkpoint (step 4), so none is saved on exception"}}) {
    SCOPED_TRACE(c.args[1]);
    TempDir dir("ckpt_exception");
    write_file(dir / "run.toml", tiny_mlp_run(2, "batch_size = 8\n[checkpoint]\nsave_on_exception = true\n"));
    auto failed = run_engine(with(with({"run.toml"}, c.args), chaos), dir.path());
    EXPECT_EQ(failed.exit_code, 1) << failed.err;
    EXPECT_NE(failed.err.find("chaos: thrown at step"), std::string::npos) << failed.err;
    EXPECT_NE(failed.err.find(c.why), std::string::npos) << failed.err;
    EXPECT_FALSE(fs::exists(dir / "runs/run/version_0/checkpoints/on_exception.ckpt"));
  }
  // Off by default.
  TempDir dir("ckpt_exception");
  write_file(dir / "run.toml", tiny_mlp_run(2, "batch_size = 8\n"));
  auto failed = run_engine(with({"run.toml", "--set", "chaos.step=6"}, chaos), dir.path());
  EXPECT_EQ(failed.exit_code, 1) << failed.err;
  EXPECT_FALSE(fs::exists(dir / "runs/run/version_0/checkpoints/on_exception.ckpt"));
}

// The checkpoint files' names in a run's checkpoints folder, sorted.
std::vector<std::string> checkpoint_names(const TempDir& dir, const std::string& version) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir / "runs/run" / version / "checkpoints")) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  return names;
}

// Lightning's save_last = "link": last.ckpt is a relative link to the file the same save kept,
// not a second copy, and a save that keeps no file (every_n_epochs = 2 skips the top-k file at
// odd epochs) writes it in full. The link goes over a full last.ckpt and back, the top-k file it
// pointed at is deleted only after it points at the new one, `--resume last` follows it, and the
// resumed runs end with the weights of one straight run; synchronous and async = true alike.
TEST(CheckpointRun, SaveLastLinkPointsAtTheSavesFileAndResumesThroughIt) {
  for (const char* async : {"false", "true"}) {
    SCOPED_TRACE(std::string("async = ") + async);
    TempDir dir("ckpt_link");
    write_file(dir / "run.toml", tiny_mlp_run(2, "batch_size = 8\nnum_val = 16\n[checkpoint]\nsave_last = \"link\"\nevery_n_epochs = 2\nasync = " +
                                                   std::string(async) + "\n"));
    const fs::path folder = dir / "runs/run/version_0/checkpoints";
    const fs::path last = folder / "last.ckpt";
    run_engine_ok(dir, {"run.toml"});  // epoch 0 (step 4): last.ckpt in full; epoch 1 (step 8): its file and the link
    EXPECT_EQ(checkpoint_names(dir, "version_0"), (std::vector<std::string>{"epoch=1-step=8.ckpt", "last.ckpt"}));
    ASSERT_TRUE(fs::is_symlink(last));
    EXPECT_EQ(fs::read_symlink(last), "epoch=1-step=8.ckpt");  // relative: the folder can move
    // The file names itself and last.ckpt: a run resumed from it keeps writing last.ckpt, not last-v1.ckpt.
    auto state = ember::engine::load_checkpoint_file(last).at("callbacks").toGenericDict().at("checkpoint").toGenericDict();
    EXPECT_EQ(state.at("last_model_path").toStringRef(), fs::absolute(last).lexically_normal().string());

    run_engine_ok(dir, {"run.toml", "--resume", "last", "--set", "trainer.max_epochs=3"});  // epoch 2: no top-k file, last in full
    EXPECT_EQ(checkpoint_names(dir, "version_0"), (std::vector<std::string>{"epoch=1-step=8.ckpt", "last.ckpt"}));
    EXPECT_FALSE(fs::is_symlink(last));
    EXPECT_EQ(ember::engine::load_checkpoint_file(last).at("global_step").toInt(), 12);

    run_engine_ok(dir, {"run.toml", "--resume", "last", "--set", "trainer.max_epochs=4"});  // epoch 3: a link over the file
    EXPECT_EQ(checkpoint_names(dir, "version_0"), (std::vector<std::string>{"epoch=3-step=16.ckpt", "last.ckpt"}));
    ASSERT_TRUE(fs::is_symlink(last));
    EXPECT_EQ(fs::read_symlink(last), "epoch=3-step=16.ckpt");

    // One straight run of 4 epochs (save_last given as TOML's true: the key takes true, false or "link").
    run_engine_ok(dir, {"run.toml", "--set", "trainer.max_epochs=4", "--set", "checkpoint.save_last=true", "--set", "checkpoint.every_n_epochs=1"});
    EXPECT_FALSE(fs::is_symlink(last_checkpoint(dir, 1)));
    expect_identical_weights(last_checkpoint(dir, 1), last);
  }
  // Nothing to link to: one line, before training.
  TempDir dir("ckpt_link");
  write_file(dir / "run.toml", tiny_mlp_run(1, "batch_size = 8\n[checkpoint]\nsave_last = \"link\"\nsave_top_k = 0\n"));
  auto none = run_engine({"run.toml"}, dir.path());
  EXPECT_EQ(none.exit_code, 2) << none.err;
  EXPECT_NE(none.err.find("checkpoint.save_last (run.toml:"), std::string::npos) << none.err;
  EXPECT_NE(none.err.find("and save_top_k = 0 saves none; set save_last = true to write last.ckpt in full"), std::string::npos) << none.err;
}

// `--resume best` asks the newest checkpoint which file is best: only its pickle is read, never
// its tensors (a 90 GB checkpoint would need twice that in memory). A copy of a real checkpoint
// without any tensor record still answers.
TEST(CheckpointRun, TheBestFileIsFoundWithoutReadingTensorData) {
  TempDir dir("ckpt");
  write_file(dir / "run.toml", tiny_mlp_run(2, "batch_size = 8\nnum_val = 16\n[checkpoint]\nmonitor = \"val_loss\"\n"));
  run_engine_ok(dir, {"run.toml"});
  const fs::path last = dir / "runs/run/version_0/checkpoints/last.ckpt";
  std::string stripped;
  {
    caffe2::serialize::PyTorchStreamReader in(last.string());
    caffe2::serialize::PyTorchStreamWriter out([&](const void* data, size_t n) -> size_t {
      stripped.append(static_cast<const char*>(data), n);
      return n;
    });
    size_t dropped = 0;
    for (const auto& name : in.getAllRecords()) {
      if (name.rfind("data/", 0) == 0) ++dropped;
      if (name != "data.pkl") continue;
      auto [bytes, n] = in.getRecord(name);
      out.writeRecord(name, bytes.get(), n);
    }
    out.writeEndOfFile();
    ASSERT_GE(dropped, 4u);  // weights, biases, optimizer, rng
  }
  write_file(dir / "stripped.ckpt", stripped);
  EXPECT_ANY_THROW(ember::engine::load_checkpoint_file(dir / "stripped.ckpt"));
  const auto state = ck::read_plugin_state((dir / "stripped.ckpt").string());
  ASSERT_TRUE(state.has_value());
  const std::string best = state->toGenericDict().at("best_model_path").toStringRef();
  EXPECT_NE(best.find("runs/run/version_0/checkpoints/epoch="), std::string::npos) << best;
  EXPECT_TRUE(fs::exists(best)) << best;
  // Not a checkpoint at all: one line naming the file.
  write_file(dir / "junk.ckpt", "not a zip");
  try {
    ck::read_plugin_state((dir / "junk.ckpt").string());
    ADD_FAILURE() << "junk.ckpt was read";
  } catch (const ember::RunError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("junk.ckpt is not a readable checkpoint: "), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
}

// `engine checkpoint info`: what a checkpoint holds (position, model tensors, plugin states),
// read from its pickle alone, for a file, a weights-only file and a sharded directory; a missing
// or unreadable one is one line and exit code 1.
TEST(CheckpointRun, InfoSaysWhatACheckpointHolds) {
  TempDir dir("ckpt");
  write_file(dir / "run.toml", tiny_mlp_run(2, "batch_size = 8\nnum_val = 16\n[checkpoint]\nmonitor = \"val_loss\"\n"));
  run_engine_ok(dir, {"run.toml"});
  const fs::path last = dir / "runs/run/version_0/checkpoints/last.ckpt";
  const auto info = run_engine_ok(dir, {"checkpoint", "info", last.string()});
  for (const char* text : {"Ember checkpoint, format 2, ", "written by: ember_version ", "position: epoch 1, global_step 8 (epoch finished)",
                           "resumable: yes", "model: 4 tensors, ", "Float [4, 8]", "callbacks:\n  checkpoint\n    dirpath ", "\n    best_model_path ",
                           "plugin versions: ", "checksums: not checked here; `engine checkpoint verify "})
    EXPECT_NE(info.out.find(text), std::string::npos) << text << " is missing from:\n" << info.out;

  run_engine_ok(dir, {"run.toml", "--set", "checkpoint.save_weights_only=true"});
  const auto weights = run_engine_ok(dir, {"checkpoint", "info", last_checkpoint(dir, 1).string()});
  EXPECT_NE(weights.out.find("resumable: no, weights only"), std::string::npos) << weights.out;

  fs::create_directories(dir / "sharded");
  fs::copy_file(last, dir / "sharded/meta.ckpt");
  fs::copy_file(last, dir / "sharded/rank0.ckpt");
  const auto sharded = run_engine_ok(dir, {"checkpoint", "info", (dir / "sharded").string()});
  EXPECT_NE(sharded.out.find("in meta.ckpt and 1 part(s) (a sharded directory)"), std::string::npos) << sharded.out;

  write_file(dir / "junk.ckpt", "not a zip");
  for (const auto& [file, what] : {std::pair<fs::path, std::string>{dir / "junk.ckpt", "junk.ckpt is not a readable checkpoint: "},
                                   {dir / "missing.ckpt", "missing.ckpt does not exist"},
                                   {dir / "runs", "runs is a folder without meta.ckpt"}}) {
    const auto r = run_engine({"checkpoint", "info", file.string()}, dir.path());
    EXPECT_EQ(r.exit_code, 1) << r.err;
    EXPECT_NE(r.err.find(what), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_EQ(r.err.find("internal miniz error"), std::string::npos) << r.err;  // what is wrong, not miniz's advice
  }
}

// Lightning's save_on_train_epoch_end, unset: a save after every validation that runs in
// mid-epoch (val_check_interval < 1), at the epoch's end when validation runs there, and never
// at the end of an epoch without validation (check_val_every_n_epoch > 1: its val_loss would be
// the previous epoch's, a stale score in the top k). A save after a mid-epoch validation resumes
// exactly. The end of training is saved all the same (last.ckpt). true saves at every epoch end
// only; false with no validation to save after is an error.
TEST(CheckpointRun, SavesAfterEachValidationLikeLightning) {
  TempDir dir("ckpt_val");
  write_file(dir / "run.toml", tiny_mlp_run(2, "batch_size = 8\nnum_val = 16\n[checkpoint]\nmonitor = \"val_loss\"\nsave_top_k = -1\n"
                                               "filename = \"{epoch}-{step}\"\n"));
  const std::vector<std::string> every_half = {"run.toml", "--set", "trainer.val_check_interval=0.5"};
  run_engine_ok(dir, every_half);  // version_0: 4 batches an epoch, validation after batches 2 and 4
  EXPECT_EQ(checkpoint_names(dir, "version_0"),
            (std::vector<std::string>{"epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=1-step=6.ckpt", "epoch=1-step=8.ckpt",
                                      "last.ckpt"}));
  auto resume = every_half;
  resume.insert(resume.end(), {"--resume", (dir / "runs/run/version_0/checkpoints/epoch=0-step=2.ckpt").string()});
  run_engine_ok(dir, resume);  // version_1
  expect_identical_weights(dir / "runs/run/version_0/checkpoints/last.ckpt", dir / "runs/run/version_1/checkpoints/last.ckpt");
  EXPECT_EQ(checkpoint_names(dir, "version_1"),
            (std::vector<std::string>{"epoch=0-step=4.ckpt", "epoch=1-step=6.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"}));

  auto at_epoch_end = every_half;
  at_epoch_end.insert(at_epoch_end.end(), {"--set", "checkpoint.save_on_train_epoch_end=true"});
  run_engine_ok(dir, at_epoch_end);  // version_2
  EXPECT_EQ(checkpoint_names(dir, "version_2"), (std::vector<std::string>{"epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"}));

  run_engine_ok(dir, {"run.toml", "--set", "trainer.max_epochs=4", "--set", "trainer.check_val_every_n_epoch=2"});  // version_3
  EXPECT_EQ(checkpoint_names(dir, "version_3"), (std::vector<std::string>{"epoch=1-step=8.ckpt", "epoch=3-step=16.ckpt", "last.ckpt"}));

  // The last epoch (2) does not validate: its end is still saved, as last.ckpt only (its val_loss
  // would be epoch 1's).
  run_engine_ok(dir, {"run.toml", "--set", "trainer.max_epochs=3", "--set", "trainer.check_val_every_n_epoch=2"});  // version_4
  EXPECT_EQ(checkpoint_names(dir, "version_4"), (std::vector<std::string>{"epoch=1-step=8.ckpt", "last.ckpt"}));
  EXPECT_EQ(ember::engine::load_checkpoint_file(dir / "runs/run/version_4/checkpoints/last.ckpt").at("global_step").toInt(), 12);

  auto nothing = run_engine({"run.toml", "--set", "data.num_val=0", "--set", "checkpoint.monitor=\"\"", "--set",
                             "checkpoint.save_on_train_epoch_end=false"},
                            dir.path());
  EXPECT_EQ(nothing.exit_code, 2) << nothing.err;
  EXPECT_NE(nothing.err.find("checkpoint.save_on_train_epoch_end (--set checkpoint.save_on_train_epoch_end=false): false saves after "
                             "each validation, and this run has no validation"),
            std::string::npos)
      << nothing.err;
}

// enable_version_counter = false (Lightning): a name that is taken is overwritten instead of
// getting a -v1, -v2 ... suffix.
TEST(CheckpointRun, VersionCounterOffOverwritesTheSameName) {
  TempDir dir("ckpt_version");
  write_file(dir / "run.toml", tiny_mlp_run(3, "batch_size = 8\nnum_val = 16\n[checkpoint]\nsave_top_k = -1\nfilename = \"model\"\n"));
  run_engine_ok(dir, {"run.toml"});
  EXPECT_EQ(checkpoint_names(dir, "version_0"), (std::vector<std::string>{"last.ckpt", "model-v1.ckpt", "model-v2.ckpt", "model.ckpt"}));
  run_engine_ok(dir, {"run.toml", "--set", "checkpoint.enable_version_counter=false"});
  EXPECT_EQ(checkpoint_names(dir, "version_1"), (std::vector<std::string>{"last.ckpt", "model.ckpt"}));
  // The one model.ckpt holds the last epoch's weights.
  expect_identical_weights(dir / "runs/run/version_1/checkpoints/model.ckpt", dir / "runs/run/version_1/checkpoints/last.ckpt");
}

// Lightning's train_time_interval: a save every so much training time, right after an optimizer
// step, with the other triggers off. Each step sleeps 0.15 s (the sleeper test plugin), so with
// an interval of 0.5 s a save comes at the latest 4 steps after the previous one: at least 3 in 12
// steps, and never one per step. On 2 ranks rank 0's clock decides for both (no hang, the same
// files). Bad values and a second trigger are one line.
TEST(CheckpointRun, TrainTimeIntervalSavesByTrainingTime) {
  TempDir dir("ckpt_time");
  write_file(dir / "run.toml", tiny_mlp_run(3, "batch_size = 8\n[checkpoint]\ntrain_time_interval = \"00:00:00:0.5\"\nsave_top_k = -1\n"
                                               "[sleeper]\nseconds = [0.15]\n"));
  const std::vector<std::string> common = {"run.toml", "--plugin-path", test_plugin_dir("good").string(), "--plugins", "sleeper",
                                           "--set", "trainer.accelerator=\"cpu\""};
  auto steps_saved = [&](const std::string& version) {
    std::vector<int> steps;
    for (const auto& e : std::filesystem::directory_iterator(dir / "runs/run" / version / "checkpoints")) {
      const std::string n = e.path().filename().string();
      if (const auto at = n.find("step="); at != std::string::npos) steps.push_back(std::stoi(n.substr(at + 5)));
    }
    std::sort(steps.begin(), steps.end());
    return steps;
  };
  for (const char* devices : {"1", "2"}) {
    auto args = common;
    // 2 ranks: twice the samples, so each rank also takes 12 steps (4 an epoch).
    args.insert(args.end(), {"--set", std::string("trainer.devices=") + devices, "--set",
                             std::string("data.num_train=") + (devices[0] == '1' ? "32" : "64")});
    auto r = run_engine(args, dir.path());
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const auto steps = steps_saved(std::string("version_") + (devices[0] == '1' ? "0" : "1"));
    std::string list;
    for (int st : steps) list += std::to_string(st) + " ";
    EXPECT_GE(steps.size(), 3u) << devices << " device(s): saved at steps " << list;
    EXPECT_LT(steps.size(), 12u) << devices << " device(s): saved at steps " << list;
    for (size_t i = 0; i < steps.size(); ++i)
      EXPECT_LE(steps[i] - (i ? steps[i - 1] : 0), 4) << devices << " device(s): saved at steps " << list;
  }
  struct Case {
    std::string set, expect;
  } cases[] = {
      {"checkpoint.train_time_interval=\"00:30:00\"", "expected DD:HH:MM:SS (4 fields), got 3; write it as \"DD:HH:MM:SS\""},
      {"checkpoint.every_n_train_steps=2", "train_time_interval and every_n_train_steps are mutually exclusive"},
      {"checkpoint.every_n_epochs=1", "train_time_interval and every_n_epochs are mutually exclusive"},
  };
  for (const auto& c : cases) {
    auto args = common;
    args.insert(args.end(), {"--set", c.set});
    auto r = run_engine(args, dir.path());
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << c.expect << "\n" << r.err;
  }
}

TEST(CheckpointFile, AtomicWriteSurvivesAKilledWriter) {
  TempDir dir("ckpt");
  const auto path = dir / "model.ckpt";
  const std::string old_content(1 << 20, 'o');
  ember::engine::atomic_write(path, old_content.data(), old_content.size());
  const std::string new_content(256 << 20, 'n');
  for (int attempt = 0; attempt < 5; ++attempt) {
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ember::engine::atomic_write(path, new_content.data(), new_content.size());
      _exit(0);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5 + 15 * attempt));
    kill(pid, SIGKILL);
    int status = 0;
    waitpid(pid, &status, 0);
    auto now = read_file(path);
    // Either the old file or the complete new one: never a mixture or a truncated file.
    EXPECT_TRUE(now == old_content || now == new_content) << "size " << now.size();
    if (now == new_content) ember::engine::atomic_write(path, old_content.data(), old_content.size());
  }
}

// last.ckpt may be a link (checkpoint.save_last = "link"): a checkpoint written in full at its
// path replaces the link, whether its target is there or gone, and never writes through it into
// the file or directory it points at. Both kinds: a file, and a sharded directory.
TEST(CheckpointFile, WritesOverALinkNeverThroughIt) {
  namespace eng = ember::engine;
  TempDir dir("ckpt_link");
  eng::atomic_write(dir / "kept.ckpt", "kept", 4);
  fs::create_symlink("kept.ckpt", dir / "last.ckpt");
  fs::create_symlink("gone.ckpt", dir / "dangling.ckpt");
  for (const char* name : {"last.ckpt", "dangling.ckpt"}) {
    eng::atomic_write(dir / name, "new", 3);
    EXPECT_FALSE(fs::is_symlink(dir / name)) << name;
    EXPECT_EQ(read_file(dir / name), "new") << name;
  }
  EXPECT_EQ(read_file(dir / "kept.ckpt"), "kept");

  c10::impl::GenericDict meta(c10::StringType::get(), c10::AnyType::get());
  meta.insert("sharded", std::string("test"));
  const eng::ShardedWrite one_rank{0, 1, [](double v) { return v; }};
  eng::write_sharded_checkpoint(dir / "kept_dir.ckpt", c10::IValue(int64_t{1}), meta, one_rank);
  fs::create_symlink("kept_dir.ckpt", dir / "last_dir.ckpt");
  fs::create_symlink("gone_dir.ckpt", dir / "dangling_dir.ckpt");
  for (const char* name : {"last_dir.ckpt", "dangling_dir.ckpt"}) {
    eng::write_sharded_checkpoint(dir / name, c10::IValue(int64_t{2}), meta, one_rank);
    EXPECT_FALSE(fs::is_symlink(dir / name)) << name;
    EXPECT_EQ(eng::read_sharded_part(dir / name, 0).toInt(), 2) << name;
  }
  EXPECT_EQ(eng::read_sharded_part(dir / "kept_dir.ckpt", 0).toInt(), 1);
  EXPECT_TRUE(eng::is_sharded_checkpoint(dir / "kept_dir.ckpt"));
}

TEST(CheckpointFile, CorruptOrForeignFilesGiveAClearError) {
  TempDir dir("ckpt");
  write_file(dir / "junk.ckpt", "this is not a checkpoint");
  try {
    ember::engine::load_checkpoint_file(dir / "junk.ckpt");
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("junk.ckpt is corrupt or not a checkpoint"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ember::engine::load_checkpoint_file(dir / "missing.ckpt"), std::runtime_error);
}
