// <ember/support/npy.h>, the .npy reader of tensor_files and webdataset: the files numpy writes
// (format versions 1, 2 and 3, every supported dtype, 0-d and empty arrays, Python 2's "3L"
// sizes) read as numpy wrote them, and a damaged or crafted header is one line naming the file
// and what is wrong, never a shape whose size wraps around (which viewed memory the file does not
// have) or an exception of the standard library.
#include <gtest/gtest.h>

#include <ember/error.h>
#include <ember/support/npy.h>

#include "support.h"

using namespace ember::test;
namespace fs = std::filesystem;

namespace {

// A version-1 .npy file with this header text (padded as numpy pads it) and `data` after it.
std::string npy(const std::string& header, const std::string& data = "", int major = 1) {
  std::string h = header;
  const size_t prefix = major == 1 ? 10 : 12;
  while ((prefix + h.size() + 1) % 64 != 0) h += ' ';
  h += '\n';
  std::string out = "\x93NUMPY";
  out += static_cast<char>(major);
  out += '\0';
  const size_t n = h.size();
  out += static_cast<char>(n & 0xFF);
  out += static_cast<char>((n >> 8) & 0xFF);
  if (major != 1) {
    out += static_cast<char>((n >> 16) & 0xFF);
    out += static_cast<char>((n >> 24) & 0xFF);
  }
  return out + h + data;
}

std::string error_of(const std::string& bytes) {
  try {
    ember::support::read_npy(bytes.data(), bytes.size(), "x.npy");
  } catch (const ember::RunError& e) {
    return e.what();
  }
  return "(accepted)";
}

}  // namespace

TEST(Npy, HeadersAreParsedAsNumpyWritesThem) {
  const std::string twelve(12 * 4, '\0');
  for (const auto& [header, shape] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
           {"{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }", {3, 4}},
           {"{'descr': '<f4', 'fortran_order': False, 'shape': (12,), }", {12}},
           {"{'shape': (2, 6), 'fortran_order': False, 'descr': '<f4'}", {2, 6}},     // any key order
           {"{'descr': '<f4', 'fortran_order': False, 'shape': (3L, 4L), }", {3, 4}},  // Python 2's numpy
           {"{\"descr\": \"<f4\", \"fortran_order\": False, \"shape\": (2,2,3)}", {2, 2, 3}}}) {
    for (int major : {1, 2, 3}) {
      const std::string file = npy(header, twelve, major);
      const at::Tensor t = ember::support::read_npy(file.data(), file.size(), "x.npy");
      EXPECT_EQ(t.sizes().vec(), shape) << header << " v" << major;
      EXPECT_EQ(t.scalar_type(), at::kFloat);
    }
  }
  // A 0-d array holds one value; an empty one none.
  const std::string scalar = npy("{'descr': '<i8', 'fortran_order': False, 'shape': (), }", std::string("\x07\0\0\0\0\0\0\0", 8));
  const at::Tensor s = ember::support::read_npy(scalar.data(), scalar.size(), "x.npy");
  EXPECT_EQ(s.dim(), 0);
  EXPECT_EQ(s.item<int64_t>(), 7);
  const std::string empty = npy("{'descr': '<f8', 'fortran_order': False, 'shape': (0, 5), }");
  EXPECT_EQ(ember::support::read_npy(empty.data(), empty.size(), "x.npy").sizes().vec(), (std::vector<int64_t>{0, 5}));
}

TEST(Npy, BadHeadersAreOneLineNamingTheFile) {
  const std::string f4 = "'descr': '<f4', 'fortran_order': False";
  const std::vector<std::pair<std::string, std::string>> cases = {
      // Sizes whose product wraps around 64 bits: 2^62 x 4 floats is 2^66 bytes, 0 after wrapping.
      {npy("{" + f4 + ", 'shape': (4611686018427387904, 4), }"), "x.npy: a shape [4611686018427387904, 4] whose size overflows 64 bits"},
      {npy("{" + f4 + ", 'shape': (0, 4611686018427387904, 4), }"), "whose size overflows 64 bits"},
      {npy("{" + f4 + ", 'shape': (99999999999999999999,), }"), "x.npy: the header's 'shape' has a size that does not fit 64 bits"},
      {npy("{" + f4 + ", 'shape': (-1,), }"), "x.npy: the header's 'shape' holds something other than sizes (non-negative integers)"},
      {npy("{" + f4 + ", 'shape': (3, 4), }", std::string(47, '\0')), "x.npy: holds fewer bytes than its shape [3, 4] needs (a truncated file)"},
      {npy("{" + f4 + ", 'shape': 12, }"), "x.npy: the header's 'shape' is not a tuple"},
      {npy("{" + f4 + ", 'shape': (1 2), }"), "x.npy: the header's 'shape' is malformed at byte"},
      {npy("{'descr': '<f4', 'shape': (1,), }"), "x.npy: the header lacks 'descr', 'fortran_order' or 'shape'"},
      {npy("{" + f4 + ", 'shape': (1,), 'extra': 1}"), "x.npy: the header has a key 'extra' numpy does not write"},
      {npy("{" + f4 + ", 'shape': (1,), 'shape': (1,)}"), "x.npy: the header names 'shape' twice"},
      {npy("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (1,)}"), "x.npy: the header's 'descr' is not a string (a structured dtype is not supported)"},
      {npy("{'descr': '<f4', 'fortran_order': Maybe, 'shape': (1,)}"), "x.npy: the header's 'fortran_order' is neither True nor False"},
      {npy("{'descr': '<f4', 'fortran_order': True, 'shape': (1,)}", std::string(4, '\0')), "x.npy: Fortran order"},
      {npy("{'descr': '>f4', 'fortran_order': False, 'shape': (1,)}", std::string(4, '\0')), "x.npy: dtype '>f4' (use little-endian"},
      {npy("{'descr': 'a\nb', 'fortran_order': False, 'shape': (1,)}"), "x.npy: dtype 'a\\x0ab' (use little-endian"},
      {npy("{" + f4 + ", 'shape': (1,)} junk"), "x.npy: the header has text after its dict"},
      {npy("[" + f4 + "]"), "x.npy: the header is not a Python dict"},
      {npy("{" + f4 + ", 'shape': (" + std::string(65 * 3, '1') + ")}"), "does not fit 64 bits"},
      {npy("{" + f4 + ", 'shape': (1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1)}"),
       "x.npy: the header's 'shape' has more than 64 dimensions (numpy's limit)"},
      {npy("{" + f4 + ", 'shape': (1,)}" + std::string(20000, ' '), "", 2), "bytes (numpy reads at most 10000)"},
      {std::string("\x93NUMPY\x04\0\0\0", 10), "x.npy: format version 4 is unknown"},
      {std::string("\x93NUMPY\x01\0\xff\x00", 10), "x.npy: a truncated header"},
      {"PK\x03\x04 not numpy", "x.npy: not a .npy file"},
  };
  for (const auto& [bytes, want] : cases) {
    const std::string got = error_of(bytes);
    EXPECT_NE(got.find(want), std::string::npos) << "want: " << want << "\ngot:  " << got;
    EXPECT_EQ(got.find('\n'), std::string::npos) << got;
    EXPECT_NE(got.find("(write it with numpy.save)"), std::string::npos) << got;
  }
}

#ifdef EMBER_TEST_PYTHON
// The files numpy itself writes, for every dtype the reader takes and each format version, hold
// the values numpy wrote.
TEST(Npy, ReadsWhatNumpyWrites) {
  TempDir dir("npy_numpy");
  const std::string script = R"(
import sys, numpy as np
from numpy.lib import format as f
out = sys.argv[1]
for dtype in ["<f4", "<f8", "<f2", "<i8", "<i4", "<i2", "|i1", "|u1", "|b1"]:
    for version in [(1, 0), (2, 0), (3, 0)]:
        a = (np.arange(24) % 7).reshape(2, 3, 4).astype(dtype)
        with open(f"{out}/{dtype[1:]}_{version[0]}.npy", "wb") as fh:
            f.write_array(fh, a, version=version)
np.save(f"{out}/scalar.npy", np.float32(2.5))
np.save(f"{out}/empty.npy", np.zeros((0, 4), np.float32))
)";
  write_file(dir / "write.py", script);
  const auto py = run_process({EMBER_TEST_PYTHON, (dir / "write.py").string(), dir.path().string()}, dir.path(), {}, 120);
  ASSERT_EQ(py.exit_code, 0) << py.err;
  const std::vector<std::pair<std::string, at::ScalarType>> dtypes = {{"f4", at::kFloat}, {"f8", at::kDouble}, {"f2", at::kHalf},
                                                                      {"i8", at::kLong},  {"i4", at::kInt},    {"i2", at::kShort},
                                                                      {"i1", at::kChar},  {"u1", at::kByte},   {"b1", at::kBool}};
  const at::Tensor want = (at::arange(24, at::kLong) % 7).reshape({2, 3, 4});
  for (const auto& [name, dtype] : dtypes)
    for (int version : {1, 2, 3}) {
      const std::string bytes = read_file(dir / (name + "_" + std::to_string(version) + ".npy"));
      const at::Tensor t = ember::support::read_npy(bytes.data(), bytes.size(), name);
      EXPECT_EQ(t.scalar_type(), dtype) << name;
      EXPECT_TRUE(at::equal(t, want.to(dtype))) << name << " v" << version;
    }
  const std::string scalar = read_file(dir / "scalar.npy"), empty = read_file(dir / "empty.npy");
  EXPECT_EQ(ember::support::read_npy(scalar.data(), scalar.size(), "scalar").item<float>(), 2.5f);
  EXPECT_EQ(ember::support::read_npy(empty.data(), empty.size(), "empty").sizes().vec(), (std::vector<int64_t>{0, 4}));
}
#endif
