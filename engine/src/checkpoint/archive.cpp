#include "checkpoint/archive.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>

#include "checkpoint/checkpoint_io.h"
#include "checkpoint/crc32c.h"

namespace ember::engine {

std::string format_manifest(const Manifest& m) {
  std::ostringstream out;
  out << "ember-manifest 1\nformat_version " << m.format_version << "\nweights_only " << (m.weights_only ? 1 : 0) << "\n";
  for (const auto& r : m.records) out << "record " << hex32(r.crc) << " " << r.size << " " << r.name << "\n";
  std::string text = out.str();
  text += "end " + hex32(crc32c(text.data(), text.size())) + "\n";
  return text;
}

Manifest parse_manifest(const std::string& text) {
  // The last line checks the others.
  const size_t end = text.size() >= 14 ? text.rfind("\nend ", text.size() - 1) : std::string::npos;
  if (end == std::string::npos || text.size() != end + 1 + 4 + 8 + 1 || text.back() != '\n')
    throw std::invalid_argument("its last line is not 'end <checksum>'");
  const std::string body = text.substr(0, end + 1);
  if (text.compare(end + 5, 8, hex32(crc32c(body.data(), body.size()))) != 0)
    throw std::invalid_argument("its own checksum does not match");
  std::istringstream in(body);
  std::string line;
  if (!std::getline(in, line) || line != "ember-manifest 1") throw std::invalid_argument("its first line is not 'ember-manifest 1'");
  Manifest m;
  int line_no = 1;
  while (std::getline(in, line)) {
    ++line_no;
    std::istringstream ls(line);
    std::string word;
    ls >> word;
    bool ok = true;
    if (word == "format_version") {
      ok = static_cast<bool>(ls >> m.format_version);
    } else if (word == "weights_only") {
      int v = -1;
      ok = static_cast<bool>(ls >> v) && (v == 0 || v == 1);
      m.weights_only = v == 1;
    } else if (word == "record") {
      ManifestEntry e;
      std::string crc;
      ok = static_cast<bool>(ls >> crc >> e.size >> e.name) && crc.size() == 8 &&
           crc.find_first_not_of("0123456789abcdef") == std::string::npos;
      if (ok) e.crc = static_cast<uint32_t>(std::stoul(crc, nullptr, 16));
      m.records.push_back(std::move(e));
    } else {
      ok = false;
    }
    std::string rest;
    if (!ok || (ls >> rest)) throw std::invalid_argument("line " + std::to_string(line_no) + " is malformed");
  }
  if (m.format_version < 2 || m.records.empty()) throw std::invalid_argument("it lacks the format version or the records");
  return m;
}

bool is_payload_record(const std::string& name) {
  return name == "data.pkl" || name.rfind("data/", 0) == 0 || (name.rfind("ember/", 0) == 0 && name != kManifestRecord);
}

std::string read_record_text(caffe2::serialize::PyTorchStreamReader& reader, const std::string& name) {
  auto [ptr, size] = reader.getRecord(name);
  return std::string(static_cast<const char*>(ptr.get()), size);
}

std::string short_what(const std::exception& e) {
  std::string what = e.what();
  if (auto nl = what.find('\n'); nl != std::string::npos) what.resize(nl);
  if (what.size() > 120)
    if (auto dot = what.find(". "); dot != std::string::npos) what.resize(dot);
  return what.substr(0, 200);
}

void verify_records(caffe2::serialize::PyTorchStreamReader& reader, const Manifest& m, std::string_view bytes,
                    const std::string& where) {
  verify_records(reader, m, bytes.size(), [&](uint64_t offset, uint64_t size) { return crc32c(bytes.data() + offset, size); },
                 where);
}

void verify_records(caffe2::serialize::PyTorchStreamReader& reader, const Manifest& m, uint64_t archive_size,
                    const RangeCrc& crc_of, const std::string& where) {
  auto damaged = [&](const std::string& what) -> std::runtime_error {
    return std::runtime_error("checkpoint " + where + " is damaged: " + what +
                              "; it changed after it was written (disk, copy or transfer error): use another checkpoint");
  };
  // The zip reader's own errors (a damaged local header, an unknown compression method) are
  // damage too, said in one line naming the file.
  try {
    std::vector<std::string> listed;
    for (const auto& r : m.records) {
      if (!reader.hasRecord(r.name)) throw damaged("record '" + r.name + "' named in the manifest is missing");
      const size_t size = reader.getRecordSize(r.name);
      if (size != r.size)
        throw damaged("record '" + r.name + "' has " + std::to_string(size) + " bytes, the manifest says " + std::to_string(r.size));
      const size_t offset = reader.getRecordOffset(r.name);
      if (offset > archive_size || size > archive_size - offset) throw damaged("record '" + r.name + "' lies past the end of the file");
      const uint32_t now = crc_of(offset, size);
      if (now != r.crc)
        throw damaged("record '" + r.name + "' (" + std::to_string(size) + " bytes) fails its CRC32C check (stored " + hex32(r.crc) +
                      ", computed " + hex32(now) + ")");
      listed.push_back(r.name);
    }
    for (const auto& name : reader.getAllRecords())
      if (is_payload_record(name) && std::find(listed.begin(), listed.end(), name) == listed.end())
        throw damaged("record '" + name + "' is not in the manifest");
  } catch (const c10::Error& e) {
    throw damaged("its archive cannot be read (" + short_what(e) + ")");
  }
}

}  // namespace ember::engine
