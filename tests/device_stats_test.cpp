// device_stats: host memory and CPU use reach every logger.
#include <gtest/gtest.h>

#include "nvml.h"
#include "observability_support.h"

using namespace ember::test;
namespace fs = std::filesystem;

TEST(DeviceStats, HostMemoryAndCpuReachEveryLogger) {
  TempDir dir("observability");
  write_file(dir / "run.toml", kMlp);
  const bool tensorboard = EMBER_TEST_WITH_PROTOBUF;
  engine_ok(dir, {"--plugins", tensorboard ? "csv,tensorboard,device_stats" : "csv,device_stats"});
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
  EXPECT_EQ(event_file, tensorboard);  // tensorboard_readable_by_tensorboard reads the same values back
}

// NVML is the driver's: on a machine without one, opening it fails with a reason instead of
// crashing; with one, an unknown PCI address is refused by name.
TEST(DeviceStats, NvmlOpensOrSaysWhy) {
  EXPECT_EQ(ember_ds::pci_bus_id(0, 0x65, 0), "00000000:65:00.0");
  std::string why;
  auto nvml = ember_ds::Nvml::open("00000000:ff:1f.0", &why);
  EXPECT_FALSE(nvml);
  EXPECT_TRUE(why.find("libnvidia-ml.so.1 not found") != std::string::npos || why.find("does not know the device") != std::string::npos ||
              why.find("nvmlInit_v2 failed") != std::string::npos)
      << why;
}
