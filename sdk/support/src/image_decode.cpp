#include <ember/support/image_decode.h>

#include <ember/error.h>

#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>

#include <jpeglib.h>
#include <png.h>

namespace ember::image {
namespace {

bool is_jpeg(const std::string& b) { return b.size() >= 3 && static_cast<unsigned char>(b[0]) == 0xFF && static_cast<unsigned char>(b[1]) == 0xD8; }
bool is_png(const std::string& b) { return b.size() >= 8 && png_sig_cmp(reinterpret_cast<png_const_bytep>(b.data()), 0, 8) == 0; }

// libjpeg reports errors through a longjmp; warnings (a premature end of data) are errors here.
struct JpegError {
  jpeg_error_mgr mgr;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};
void jpeg_fail(j_common_ptr cinfo) {
  auto* e = reinterpret_cast<JpegError*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, e->message);
  std::longjmp(e->jump, 1);
}
void jpeg_warn(j_common_ptr cinfo, int level) {
  if (level < 0) jpeg_fail(cinfo);  // corrupt or truncated data: libjpeg would go on with gray
}

struct JpegDecompress {
  jpeg_decompress_struct cinfo{};
  JpegError err{};
  JpegDecompress() {
    cinfo.err = jpeg_std_error(&err.mgr);
    err.mgr.error_exit = jpeg_fail;
    err.mgr.emit_message = jpeg_warn;
    jpeg_create_decompress(&cinfo);
  }
  ~JpegDecompress() { jpeg_destroy_decompress(&cinfo); }
};

[[noreturn]] void fail(const std::string& path, const std::string& why) {
  throw ember::RunError("image_folder: " + path + ": " + why + " (fix or remove the file, or set bad_images = \"skip\")");
}

// PIL's limit: Image.open refuses an image of more than 2 x MAX_IMAGE_PIXELS (89,478,485)
// pixels as a decompression bomb; a header is a few bytes, the pixels it claims can be gigabytes.
constexpr int64_t kMaxPixels = 2 * (int64_t{1024} * 1024 * 1024 / 4 / 3);

ImageInfo checked(const ImageInfo& info, const std::string& path) {
  if (info.width * info.height > kMaxPixels)
    fail(path, std::to_string(info.width) + " x " + std::to_string(info.height) + " pixels, more than " + std::to_string(kMaxPixels) +
                   " (PIL refuses such an image too, as a decompression bomb; shrink it)");
  return info;
}

}  // namespace

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ember::RunError("image_folder: cannot read " + path + ": " + std::strerror(errno));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

ImageInfo probe_image(const std::string& bytes, const std::string& path) {
  if (is_jpeg(bytes)) {
    JpegDecompress d;
    if (setjmp(d.err.jump)) fail(path, std::string("not a readable JPEG (") + d.err.message + ")");
    jpeg_mem_src(&d.cinfo, reinterpret_cast<const unsigned char*>(bytes.data()), static_cast<unsigned long>(bytes.size()));
    jpeg_read_header(&d.cinfo, TRUE);
    return checked({d.cinfo.image_width, d.cinfo.image_height, true}, path);
  }
  if (is_png(bytes)) {
    png_image image{};
    image.version = PNG_IMAGE_VERSION;
    if (!png_image_begin_read_from_memory(&image, bytes.data(), bytes.size())) fail(path, std::string("not a readable PNG (") + image.message + ")");
    const ImageInfo info{image.width, image.height, false};
    png_image_free(&image);
    return checked(info, path);
  }
  fail(path, bytes.empty() ? "an empty file" : "neither a JPEG nor a PNG file");
}

ImageInfo probe_image_file(const std::string& path) {
  constexpr std::streamsize kHead = 64 * 1024;
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ember::RunError("image_folder: cannot read " + path + ": " + std::strerror(errno));
  std::string head(static_cast<size_t>(kHead), '\0');
  in.read(head.data(), kHead);
  head.resize(static_cast<size_t>(in.gcount()));
  if (in.gcount() < kHead) return probe_image(head, path);  // the whole file
  try {
    return probe_image(head, path);
  } catch (const ember::RunError&) {
    return probe_image(read_file(path), path);  // the header goes on past the head, or the file is bad
  }
}

at::Tensor decode_image(const std::string& bytes, const std::string& path, int denominator) {
  if (is_jpeg(bytes)) {
    JpegDecompress d;
    at::Tensor out;
    if (setjmp(d.err.jump)) fail(path, std::string("corrupt JPEG data (") + d.err.message + ")");
    jpeg_mem_src(&d.cinfo, reinterpret_cast<const unsigned char*>(bytes.data()), static_cast<unsigned long>(bytes.size()));
    jpeg_read_header(&d.cinfo, TRUE);
    checked({d.cinfo.image_width, d.cinfo.image_height, true}, path);
    if (d.cinfo.jpeg_color_space == JCS_CMYK || d.cinfo.jpeg_color_space == JCS_YCCK)
      fail(path, "a CMYK JPEG (convert it to RGB)");
    d.cinfo.out_color_space = JCS_RGB;  // grayscale replicated, YCbCr converted
    d.cinfo.scale_num = 1;
    d.cinfo.scale_denom = static_cast<unsigned>(denominator == 2 || denominator == 4 || denominator == 8 ? denominator : 1);
    d.cinfo.dct_method = JDCT_ISLOW;  // PIL's default
    jpeg_start_decompress(&d.cinfo);
    out = at::empty({d.cinfo.output_height, d.cinfo.output_width, 3}, at::kByte);
    auto* base = out.data_ptr<uint8_t>();
    const size_t stride = static_cast<size_t>(d.cinfo.output_width) * 3;
    while (d.cinfo.output_scanline < d.cinfo.output_height) {
      JSAMPROW row = base + d.cinfo.output_scanline * stride;
      jpeg_read_scanlines(&d.cinfo, &row, 1);
    }
    jpeg_finish_decompress(&d.cinfo);
    return out;
  }
  if (is_png(bytes)) {
    png_image image{};
    image.version = PNG_IMAGE_VERSION;
    if (!png_image_begin_read_from_memory(&image, bytes.data(), bytes.size())) fail(path, std::string("not a readable PNG (") + image.message + ")");
    try {
      checked({image.width, image.height, false}, path);
    } catch (...) {
      png_image_free(&image);
      throw;
    }
    // RGBA then the alpha dropped: PIL's convert("RGB") keeps the colour values, it does not
    // composite onto a background.
    image.format = PNG_FORMAT_RGBA;
    at::Tensor rgba = at::empty({image.height, image.width, 4}, at::kByte);
    if (!png_image_finish_read(&image, nullptr, rgba.data_ptr<uint8_t>(), 0, nullptr)) {
      const std::string why = image.message;
      png_image_free(&image);
      fail(path, "corrupt PNG data (" + why + ")");
    }
    return rgba.narrow(2, 0, 3).contiguous();
  }
  fail(path, bytes.empty() ? "an empty file" : "neither a JPEG nor a PNG file");
}

}  // namespace ember::image
