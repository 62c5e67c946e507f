// Decoding JPEG (libjpeg-turbo's libjpeg API) and PNG (libpng's simplified API) files into RGB
// pixels, as PIL's Image.open(...).convert("RGB") gives them to torchvision's ImageFolder:
// grayscale replicated to three channels, RGBA and gray + alpha with the alpha dropped, palettes
// expanded. A JPEG may be decoded at 1/2, 1/4 or 1/8 of its size in the DCT (libjpeg's scaled
// decoding: far less work when the image is then shrunk anyway).
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <string>

namespace ember::image {

struct ImageInfo {
  int64_t width = 0, height = 0;
  bool jpeg = false;
};

// The file's bytes; throws ember::RunError naming the path when it cannot be read.
std::string read_file(const std::string& path);
// Width and height from the header alone. Throws ember::RunError naming `path` (not an image, a
// format other than JPEG or PNG, a broken header).
ImageInfo probe_image(const std::string& bytes, const std::string& path);
// The same for a file, reading only its first 64 KiB (where a header nearly always ends); the
// whole file only when the header goes on past them (large EXIF or ICC segments). Throws
// ember::RunError naming `path` when it cannot be read or is not a readable image.
ImageInfo probe_image_file(const std::string& path);
// uint8 [height, width, 3]. `denominator` (1, 2, 4 or 8) shrinks a JPEG by that much while
// decoding (ignored for PNG). Throws ember::RunError naming `path` for corrupt or truncated data
// (where PIL raises "image file is truncated", libjpeg would only warn and fill the rest with gray).
at::Tensor decode_image(const std::string& bytes, const std::string& path, int denominator = 1);

}  // namespace ember::image
