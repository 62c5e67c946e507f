// `engine export CKPT --format safetensors OUT`: a checkpoint's model weights as safetensors, read
// back here with Ember::safetensors and compared with the checkpoint's own state_dict (Python's
// safetensors and transformers read them in tests/python_interop.sh and text_test.cpp).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <ember/error.h>
#include <ember/support/safetensors.h>

#include <fstream>

#include "checkpoint_support.h"
#include "support.h"

using namespace ember::test;
namespace fs = std::filesystem;

namespace {

const std::string kRun = synthetic_mlp_toml({}) + "[optimizer]\nname = \"adam\"\nlr = 0.01\n";

void expect_same_tensors(const fs::path& file, const std::map<std::string, at::Tensor>& want) {
  ember::support::SafetensorsFile st(file.string());
  EXPECT_EQ(st.names().size(), want.size());
  for (const auto& [name, t] : want) {
    ASSERT_TRUE(st.contains(name)) << name;
    const at::Tensor got = st.tensor(name);
    EXPECT_EQ(got.scalar_type(), t.scalar_type()) << name;
    EXPECT_TRUE(got.equal(t)) << name;
  }
}

// The stderr line that carries the error (the engine logs "[error] ...").
std::string error_line(const std::string& err) {
  const auto at = err.find("error");
  if (at == std::string::npos) return "(no error line) " + err;
  const auto start = err.rfind('\n', at);
  const auto end = err.find('\n', at);
  return err.substr(start == std::string::npos ? 0 : start + 1, end == std::string::npos ? std::string::npos : end - start - 1);
}

}  // namespace

TEST(WeightsExport, WritesTheCheckpointsStateDictUnderTheModulesNames) {
  TempDir dir("weights_export");
  write_file(dir / "run.toml", kRun);
  run_engine_ok(dir, {"run.toml"});
  const auto ckpt = last_checkpoint(dir);
  const auto want = weights(ckpt);
  ASSERT_EQ(want.size(), 6u);  // three linear layers

  auto r = run_engine_ok(dir, {"export", ckpt.string(), "--format", "safetensors", "mlp.safetensors"});
  EXPECT_NE(r.err.find("wrote mlp.safetensors (6 tensors"), std::string::npos) << r.err;
  expect_same_tensors(dir / "mlp.safetensors", want);
  ember::support::SafetensorsFile st((dir / "mlp.safetensors").string());
  EXPECT_EQ(st.metadata().at("format"), "pt");  // what transformers and safetensors.torch look for
  EXPECT_EQ(st.metadata().at("ember_model"), "mlp");
  EXPECT_EQ(st.metadata().at("ember_checkpoint"), "last.ckpt");

  // A folder (made when missing): model.safetensors and nothing else for a model without extras.
  run_engine_ok(dir, {"export", ckpt.string(), "exported/mlp"});
  expect_same_tensors(dir / "exported/mlp/model.safetensors", want);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir / "exported/mlp"), fs::directory_iterator()), 1);
}

TEST(WeightsExport, BadRequestsAreOneLineErrorsAndAnEarlierExportSurvives) {
  TempDir dir("weights_export_errors");
  write_file(dir / "run.toml", kRun);
  run_engine_ok(dir, {"run.toml"});
  const auto ckpt = last_checkpoint(dir).string();
  run_engine_ok(dir, {"export", ckpt, "good.safetensors"});
  const std::string good = read_file(dir / "good.safetensors");

  struct Case {
    std::vector<std::string> args;
    int exit_code;
    std::string says;
  };
  const std::vector<Case> cases = {
      {{"export", ckpt, "--format", "onnx", "x.onnx"}, 2, "--format onnx: not a format engine export writes (formats: safetensors, the model's weights; peft, the adapters alone"},
      {{"export", "nope.ckpt", "x.safetensors"}, 2, "nope.ckpt: no such checkpoint file or sharded checkpoint folder"},
      {{"export", ckpt}, 2, "expected `engine export CKPT --format safetensors OUT`"},
      {{"export", ckpt, "missing/x.safetensors"}, 2, "missing/x.safetensors: no folder missing to write it in"},
      {{"export", ckpt, "run.toml"}, 2, "run.toml exists and is not a folder"},
      // The checkpoint's config with another network: the names would not fit the tensors.
      {{"export", ckpt, "--set", "model.hidden=[5, 17]", "changed.safetensors"}, 2, "state_dict 'fc1.weight' has shape [23, 32], model 'mlp' built from the checkpoint's config has [5, 32]"},
  };
  for (const auto& c : cases) {
    auto r = run_engine(c.args, dir.path());
    EXPECT_EQ(r.exit_code, c.exit_code) << r.err;
    const std::string line = error_line(r.err);
    EXPECT_NE(line.find(c.says), std::string::npos) << r.err;
  }
  EXPECT_FALSE(fs::exists(dir / "changed.safetensors"));

  // A damaged checkpoint is refused (its checksums) and the earlier export under that name stays.
  std::string bytes = read_file(ckpt);
  const auto data = bytes.find("data/0");
  ASSERT_NE(data, std::string::npos);
  bytes[data + 200] = static_cast<char>(bytes[data + 200] ^ 0x5a);
  write_file(dir / "damaged.ckpt", bytes);
  auto r = run_engine({"export", "damaged.ckpt", "good.safetensors"}, dir.path());
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(error_line(r.err).find("damaged.ckpt"), std::string::npos) << r.err;
  EXPECT_EQ(read_file(dir / "good.safetensors"), good);
  EXPECT_FALSE(fs::exists(dir / "good.safetensors.tmp"));
}

// A sharded checkpoint folder (2 CPU ranks, one part per rank) exports the whole model: the same
// tensors as the parts joined independently of the strategy's own code.
TEST(WeightsExport, ExportsAShardedCheckpointFolderWhole) {
  EMBER_SKIP_WITHOUT_MPI();
  TempDir dir("weights_export_sharded");
  write_file(dir / "run.toml", synthetic_mlp_toml({.accelerator = "cpu", .batch_size = 12}) + "[optimizer]\nname = \"sgd\"\nlr = 0.1\n");
  run_engine_ok(dir, {"--plugins", "sharded", "run.toml", "--set", "trainer.devices=2", "--set", "sharded.stage=3", "--set",
                      "sharded.timeout=30.0", "--set", "sharded.state_dict_type=\"sharded\""});
  const auto ckpt = last_checkpoint(dir);
  ASSERT_TRUE(fs::is_directory(ckpt)) << ckpt;
  run_engine_ok(dir, {"export", ckpt.string(), "whole.safetensors"});
  expect_same_tensors(dir / "whole.safetensors", weights(ckpt));
}

// A safetensors file is often downloaded (a Hugging Face model folder): a header whose shape
// claims more elements than 64 bits count, or a dimension beyond int64, is refused in one line.
// Unchecked, [2^62, 4] float32 wrapped to 0 bytes, matched offsets [0, 0] and gave a tensor of
// 2^64 elements over no data.
TEST(Safetensors, ShapesWhoseSizeOverflowsAreRefused) {
  TempDir dir("safetensors");
  auto write_header = [&](const std::string& json) {
    const fs::path file = dir / "crafted.safetensors";
    std::ofstream out(file, std::ios::binary);
    uint64_t n = json.size();
    for (int i = 0; i < 8; ++i, n >>= 8) out.put(static_cast<char>(n & 0xff));
    out << json;
    return file.string();
  };
  auto error_of = [](const std::string& file) -> std::string {
    try {
      ember::support::SafetensorsFile st(file);
    } catch (const ember::RunError& e) {
      return e.what();
    }
    return "(opened)";
  };
  for (const std::string shape : {"[4611686018427387904, 4]", "[2305843009213693952, 2]", "[9223372036854775808]",
                                  "[18446744073709551615, 1]", "[4294967296, 4294967296]"}) {
    const std::string file = write_header(R"({"w":{"dtype":"F32","shape":)" + shape + R"(,"data_offsets":[0,0]}})");
    const std::string e = error_of(file);
    EXPECT_NE(e.find(file + ": not a valid safetensors file: tensor 'w' has a shape whose size overflows 64 bits"), std::string::npos)
        << shape << ": " << e;
  }
  // A large shape that fits is judged by its bytes as before.
  const std::string fits = write_header(R"({"w":{"dtype":"F32","shape":[1048576, 1048576],"data_offsets":[0,0]}})");
  EXPECT_NE(error_of(fits).find("holds 0 bytes, its shape and dtype need 4398046511104"), std::string::npos) << error_of(fits);
}
