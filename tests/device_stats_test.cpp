// device_stats: host memory and CPU use reach every logger.
#include <gtest/gtest.h>

#include "observability_support.h"

using namespace ember::test;
namespace fs = std::filesystem;

TEST(DeviceStats, HostMemoryAndCpuReachEveryLogger) {
  TempDir dir("observability");
  write_file(dir / "run.toml", kMlp);
  engine_ok(dir, {"--plugins", "csv,tensorboard,device_stats"});
  const auto rows = read_csv(dir / "runs/run/version_0/metrics.csv");
  int n = 0;
  const double rss = last_value(rows, "device_stats/host_rss_mb", &n);
  EXPECT_EQ(n, 12);
  EXPECT_GT(rss, 50.0);      // LibTorch alone maps more than that
  EXPECT_LT(rss, 64 * 1024.0);
  EXPECT_GE(last_value(rows, "device_stats/host_peak_rss_mb", &n), rss);
  const double cpu = last_value(rows, "device_stats/cpu_percent", &n);
  EXPECT_GT(cpu, 0.0);
  EXPECT_GT(last_value(rows, "device_stats/host_mem_percent", &n), 0.0);
  bool event_file = false;
  for (const auto& e : fs::directory_iterator(dir / "runs/run/version_0"))
    event_file |= e.path().filename().string().rfind("events.out.tfevents.", 0) == 0 && fs::file_size(e.path()) > 0;
  EXPECT_TRUE(event_file);  // tensorboard_readable_by_tensorboard reads the same values back
}
