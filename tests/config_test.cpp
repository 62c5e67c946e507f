// Configuration: every kind of bad input yields one line naming the place and the fix.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "config/run_config.h"
#include "config/engine_schema.h"
#include "support.h"

using namespace ember::engine;
using ember::test::TempDir;
using ember::test::write_file;

namespace {

std::vector<SectionSchema> schemas() {
  SectionSchema model;
  model.name = "model";
  model.keys = model_base_keys();
  KeySchema width;
  width.key = "width";
  width.type = EMBER_TYPE_INT;
  width.flags = EMBER_KEY_HAS_MIN;
  width.min_value = 1;
  width.default_toml = "8";
  model.keys.push_back(width);
  KeySchema free;  // a number without a range
  free.key = "free";
  free.type = EMBER_TYPE_FLOAT;
  free.default_toml = "0.0";
  model.keys.push_back(free);
  return {trainer_schema(), model, optimizer_schema()};
}

std::string resolve_error(const std::string& toml, const std::vector<std::string>& sets = {}) {
  TempDir dir("config");
  write_file(dir / "run.toml", toml);
  try {
    auto raw = RawConfig::load((dir / "run.toml").string());
    for (const auto& s : sets) raw.add_override(s);
    ResolvedConfig::resolve(raw, schemas(), {});
  } catch (const UsageError& e) {
    std::string msg = e.what();
    auto pos = msg.find("run.toml");
    return pos == std::string::npos ? msg : msg.substr(pos);
  }
  return "";
}

}  // namespace

TEST(Config, UnknownKeySuggestsClosestWithPosition) {
  auto err = resolve_error("[trainer]\nmax_epoch = 3\n");
  EXPECT_NE(err.find("run.toml:2:13"), std::string::npos) << err;
  EXPECT_NE(err.find("trainer.max_epoch: unknown key"), std::string::npos) << err;
  EXPECT_NE(err.find("did you mean 'max_epochs'"), std::string::npos) << err;
}

TEST(Config, UnknownSectionSuggestsClosest) {
  auto err = resolve_error("[trainr]\nmax_epochs = 3\n");
  EXPECT_NE(err.find("run.toml:1:1"), std::string::npos) << err;
  EXPECT_NE(err.find("unknown section [trainr]"), std::string::npos) << err;
  EXPECT_NE(err.find("did you mean 'trainer'"), std::string::npos) << err;
}

TEST(Config, TypeErrorGivesLineAndColumn) {
  auto err = resolve_error("[trainer]\n\nmax_epochs = \"ten\"\n");
  EXPECT_NE(err.find("run.toml:3:14"), std::string::npos) << err;
  EXPECT_NE(err.find("expected an integer, got string 'ten'"), std::string::npos) << err;
}

TEST(Config, RangeError) {
  auto err = resolve_error("[optimizer]\nlr = -0.1\n");
  EXPECT_NE(err.find("run.toml:2:6"), std::string::npos) << err;
  EXPECT_NE(err.find("optimizer.lr: must be > 0, got -0.1"), std::string::npos) << err;
  err = resolve_error("[model]\nwidth = 0\n");
  EXPECT_NE(err.find("model.width: must be >= 1, got 0"), std::string::npos) << err;
}

TEST(Config, InfinityIsRefusedByKeysWithARange) {
  // TOML's inf is a number: an lr of inf trained to nan without a word. A range such as [0, inf)
  // excludes it.
  auto err = resolve_error("[optimizer]\nlr = inf\n");
  EXPECT_NE(err.find("run.toml:2:6"), std::string::npos) << err;
  EXPECT_NE(err.find("optimizer.lr: must be a finite number, got inf"), std::string::npos) << err;
  err = resolve_error("", {"trainer.gradient_clip_val=-inf"});
  EXPECT_NE(err.find("--set trainer.gradient_clip_val=-inf"), std::string::npos) << err;
  EXPECT_NE(err.find("must be a finite number, got -inf"), std::string::npos) << err;
  EXPECT_NE(resolve_error("[model]\nwidth = inf\n").find("expected an integer"), std::string::npos);  // not even a float key
  EXPECT_EQ(resolve_error("[optimizer]\nlr = 1e300\n"), "");  // large but finite
  // A key without a range takes it (a test plugin's scripted metric values: early_stopping_test).
  EXPECT_EQ(resolve_error("[model]\nfree = inf\n"), "");
  EXPECT_EQ(resolve_error("[model]\nfree = -inf\n"), "");
}

TEST(Config, ASetNumberTomlCannotReadSaysWhy) {
  // Beyond 64 bits: TOML reads no number, so the value is a string; the error says why.
  auto err = resolve_error("", {"trainer.max_epochs=99999999999999999999"});
  EXPECT_NE(err.find("trainer.max_epochs: expected an integer, got string '99999999999999999999' (TOML does not read it as a "
                     "number: '99999999999999999999' is not representable in 64 bits)"),
            std::string::npos)
      << err;
  err = resolve_error("", {"optimizer.lr=1e999"});
  EXPECT_NE(err.find("optimizer.lr: expected a number, got string '1e999' (TOML does not read it as a number: "), std::string::npos) << err;
  // A word is not a number to explain.
  EXPECT_EQ(resolve_error("", {"trainer.max_epochs=abc"}).find("TOML does not read"), std::string::npos);
}

TEST(Config, ChoiceErrorSuggests) {
  auto err = resolve_error("[trainer]\ngradient_clip_algorithm = \"nrom\"\n");
  EXPECT_NE(err.find("must be one of norm|value"), std::string::npos) << err;
  EXPECT_NE(err.find("did you mean 'norm'"), std::string::npos) << err;
}

TEST(Config, TomlSyntaxErrorGivesPosition) {
  auto err = resolve_error("[trainer]\nmax_epochs = = 3\n");
  EXPECT_NE(err.find("run.toml:2:"), std::string::npos) << err;
}

TEST(Config, SetOverridesFileAndIsChecked) {
  TempDir dir("config");
  write_file(dir / "run.toml", "[trainer]\nmax_epochs = 3\n[model]\nname = \"m\"\n");
  auto raw = RawConfig::load((dir / "run.toml").string());
  raw.add_override("trainer.max_epochs=7");
  raw.add_override("model.name=other");  // a bare word is a string
  auto rc = ResolvedConfig::resolve(raw, schemas(), {});
  EXPECT_EQ(rc.section("trainer").get_int("max_epochs"), 7);
  EXPECT_EQ(rc.section("trainer").where("max_epochs"), "--set trainer.max_epochs=7");
  EXPECT_EQ(rc.section("model").get_string("name"), "other");
  EXPECT_EQ(rc.section("trainer").where("max_steps"), "default");

  auto err = resolve_error("", {"trainer.max_epochs=abc"});
  EXPECT_NE(err.find("--set trainer.max_epochs=abc"), std::string::npos) << err;
  EXPECT_NE(err.find("expected an integer"), std::string::npos) << err;
  err = resolve_error("", {"trainer.max_epoch=3"});
  EXPECT_NE(err.find("did you mean 'max_epochs'"), std::string::npos) << err;
  err = resolve_error("", {"trainr.max_epochs=3"});
  EXPECT_NE(err.find("did you mean 'trainer'"), std::string::npos) << err;
  EXPECT_THROW(RawConfig().add_override("max_epochs=3"), UsageError);
  EXPECT_THROW(RawConfig().add_override("trainer.max_epochs"), UsageError);
}

TEST(Config, ResolvedTomlRoundTrips) {
  TempDir dir("config");
  write_file(dir / "run.toml", "[trainer]\nmax_epochs = 3\nval_check_interval = 0.5\n[model]\nname = \"m\"\nwidth = 4\n"
                               "[optimizer]\nname = \"adamw\"\nbetas = [0.8, 0.9]\n");
  auto raw = RawConfig::load((dir / "run.toml").string());
  auto first = ResolvedConfig::resolve(raw, schemas(), {"csv"});
  write_file(dir / "resolved.toml", first.to_toml());
  auto again = ResolvedConfig::resolve(RawConfig::load((dir / "resolved.toml").string()), schemas(), {"csv"});
  EXPECT_EQ(first.to_toml(), again.to_toml());
  EXPECT_EQ(again.section("model").get_int("width"), 4);
  EXPECT_DOUBLE_EQ(again.section("trainer").get_float("val_check_interval"), 0.5);
  EXPECT_FALSE(again.section("trainer").is_integer("val_check_interval"));
  EXPECT_EQ(again.section("optimizer").get_float_list("betas"), (std::vector<double>{0.8, 0.9}));
}

TEST(Config, ClosestName) {
  EXPECT_EQ(closest_name("chekpoint", {"checkpoint", "csv", "cnn"}), "checkpoint");
  EXPECT_EQ(closest_name("zzzzzz", {"checkpoint", "csv"}), "");
}

TEST(Config, OptimizerRejectsKeysItDoesNotUse) {
  TempDir dir("config");
  write_file(dir / "run.toml", "[optimizer]\nname = \"sgd\"\nbetas = [0.9, 0.99]\n");
  auto rc = ResolvedConfig::resolve(RawConfig::load((dir / "run.toml").string()), schemas(), {});
  auto p = at::zeros({2}, at::requires_grad());
  try {
    make_optimizer(rc.section("optimizer"), {p});
    FAIL() << "expected an error";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("optimizer.betas does not apply to sgd"), std::string::npos) << e.what();
  }
}

// Found by fuzzing under UBSan: a huge integral float read as an integer was an undefined cast.
TEST(Config, IntegralFloatTooLargeForAnIntegerIsAConfigError) {
  auto raw = RawConfig::parse("[trainer]\nlimit_train_batches = 1e300\nlimit_val_batches = 4.0\n", "run.toml");
  auto rc = ResolvedConfig::resolve(raw, schemas(), {});
  const auto& trainer = rc.section("trainer");
  EXPECT_EQ(trainer.get_int("limit_val_batches"), 4);
  EXPECT_THROW(trainer.get_int("limit_train_batches"), ember::ConfigError);
  EXPECT_EQ(trainer.get_float("limit_train_batches"), 1e300);
}

// Found by fuzzing: every config error is one line, whatever the user's text holds.
TEST(Config, ErrorsStayOneLineAndSetMustBeUtf8) {
  try {
    RawConfig::parse("[trainer]\nenable_progress_bar = fal\n", "run.toml");
    ADD_FAILURE() << "parsed";
  } catch (const UsageError& e) {
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
  }
  RawConfig raw;
  EXPECT_THROW(raw.add_override("trainer.name=\xff\xfe"), UsageError);
  EXPECT_NO_THROW(raw.add_override("trainer.name=caf\xc3\xa9"));
}
