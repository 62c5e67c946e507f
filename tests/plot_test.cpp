// `engine plot`: one PNG from the metrics.csv of one or several runs, one panel per kind of
// metric found (loss, accuracy, lr); clear errors for what it cannot plot.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

#include "support.h"

using namespace ember::test;
namespace fs = std::filesystem;

namespace {

// Width and height from a PNG's IHDR chunk; false when the file is no PNG.
bool png_size(const fs::path& p, uint32_t* w, uint32_t* h) {
  std::ifstream in(p, std::ios::binary);
  unsigned char b[24] = {};
  in.read(reinterpret_cast<char*>(b), 24);
  const unsigned char sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (!in || !std::equal(sig, sig + 8, b) || std::string(reinterpret_cast<char*>(b + 12), 4) != "IHDR") return false;
  *w = (b[16] << 24) | (b[17] << 16) | (b[18] << 8) | b[19];
  *h = (b[20] << 24) | (b[21] << 16) | (b[22] << 8) | b[23];
  return true;
}

void write_run(const fs::path& dir, bool with_lr, double scale) {
  fs::create_directories(dir);
  std::string csv = with_lr ? "epoch,lr-SGD,step,train_acc_epoch,train_loss_epoch,train_loss_step,val_acc,val_loss\n"
                            : "epoch,step,train_acc_epoch,train_loss_epoch,train_loss_step,val_acc,val_loss\n";
  const char* lr = with_lr ? "," : "";  // the lr column's separator, when there is one
  char line[256];
  for (int e = 0; e < 4; ++e) {
    for (int s = 0; s < 10; ++s) {
      const int step = e * 10 + s;
      if (with_lr)
        std::snprintf(line, sizeof line, "%d,%g,%d,,,%g,,\n", e, 0.1 / (1 + step), step, scale * 2.0 / (1 + 0.1 * step));
      else
        std::snprintf(line, sizeof line, "%d,%d,,,%g,,\n", e, step, scale * 2.0 / (1 + 0.1 * step));
      csv += line;
    }
    const int step = e * 10 + 9;
    std::snprintf(line, sizeof line, "%d%s,%d,,,,\"%g\",%g\n", e, lr, step, 0.5 + 0.1 * e, scale * 1.8 / (1 + e));
    csv += line;
    std::snprintf(line, sizeof line, "%d%s,%d,%g,%g,,,\n", e, lr, step, 0.45 + 0.1 * e, scale * 1.9 / (1 + e));
    csv += line;
  }
  write_file(dir / "metrics.csv", csv);
}

}  // namespace

TEST(Plot, DrawsOnePanelPerKindOfMetric) {
  EMBER_SKIP_UNLESS_BUILT_WITH(EMBER_TEST_WITH_CAIRO, "cairo, so `engine plot` cannot draw");
  TempDir dir("plot");
  write_run(dir / "runs/a/version_0", true, 1.0);
  write_run(dir / "runs/a/version_1", false, 0.8);
  auto r = run_engine({"plot", "runs/a/version_0", "runs/a/version_1", "--output", "curves.png"}, dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("3 panels, 2 runs"), std::string::npos) << r.out;
  uint32_t w = 0, h = 0;
  ASSERT_TRUE(png_size(dir / "curves.png", &w, &h));
  EXPECT_EQ(w, 1100u);
  EXPECT_EQ(h, 20u + 3 * 330u);  // loss, accuracy, lr
  // Without a learning rate: two panels.
  r = run_engine({"plot", "runs/a/version_1", "-o", "two.png"}, dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  ASSERT_TRUE(png_size(dir / "two.png", &w, &h));
  EXPECT_EQ(h, 20u + 2 * 330u);
}

// A build without cairo keeps the command and says why it cannot draw.
TEST(Plot, WithoutCairoSaysWhyItCannotDraw) {
  if (EMBER_TEST_WITH_CAIRO) GTEST_SKIP() << "this build has cairo (see Plot.DrawsOnePanelPerKindOfMetric)";
  TempDir dir("plot");
  write_run(dir / "ok", false, 1.0);
  auto r = run_engine({"plot", "ok", "--output", "x.png"}, dir.path());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("this build has no cairo, so it cannot draw (install libcairo2-dev"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(dir / "x.png"));
}

TEST(Plot, ExplainsWhatItCannotPlot) {
  EMBER_SKIP_UNLESS_BUILT_WITH(EMBER_TEST_WITH_CAIRO, "cairo (the messages of `engine plot` that need it)");
  TempDir dir("plot");
  auto r = run_engine({"plot", "nowhere", "--output", "x.png"}, dir.path());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("plot: nowhere: no such run folder"), std::string::npos) << r.err;
  fs::create_directories(dir / "empty");
  r = run_engine({"plot", "empty", "--output", "x.png"}, dir.path());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("cannot read empty/metrics.csv"), std::string::npos) << r.err;
  write_file(dir / "bad/metrics.csv", "a,b\n1,2\n");
  r = run_engine({"plot", "bad", "--output", "x.png"}, dir.path());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("metrics.csv:1: no 'step' column"), std::string::npos) << r.err;
  write_run(dir / "ok", false, 1.0);
  r = run_engine({"plot", "ok"}, dir.path());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--output FILE.png is required"), std::string::npos) << r.err;
  r = run_engine({"plot", "ok", "--output", "x.jpg"}, dir.path());
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("plot: --output x.jpg: engine plot writes PNG images: give a file name ending in .png"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(dir / "x.jpg"));
  EXPECT_FALSE(fs::exists(dir / "x.png"));
}
