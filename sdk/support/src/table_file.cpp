#include "ember/support/table_file.h"

#include <ember/error.h>

#include <csv.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

namespace ember::support {
namespace {

[[noreturn]] void file_error(const std::filesystem::path& path, int64_t line, const std::string& what) {
  throw ember::RunError(path.string() + ":" + std::to_string(line) + ": " + what);
}

std::vector<TableRecord> read_jsonl(const std::filesystem::path& path, const std::vector<TableColumn>& columns) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ember::RunError("cannot read " + path.string());
  std::vector<TableRecord> out;
  std::string line;
  int64_t n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      file_error(path, n, std::string("not a JSON object (") + e.what() + "): JSONL needs one object a line");
    }
    if (!j.is_object()) file_error(path, n, "not a JSON object: JSONL needs one object a line");
    TableRecord r;
    r.line = n;
    for (const auto& c : columns) {
      const auto it = j.find(c.name);
      auto scalar = [](const nlohmann::json& v) { return v.is_string() ? v.get<std::string>() : std::to_string(v.get<int64_t>()); };
      if (it != j.end() && it->is_array() && !c.list_separator.empty()) {
        std::string joined;
        for (const auto& item : *it) {
          if (!(item.is_string() || item.is_number_integer()))
            file_error(path, n, "field \"" + c.name + "\" lists " + item.dump() + ": a list holds strings or integers");
          const std::string value = scalar(item);
          if (value.find(c.list_separator) != std::string::npos)
            file_error(path, n, "field \"" + c.name + "\" lists \"" + value + "\", which holds the separator \"" + c.list_separator +
                                    "\": set another separator");
          joined += (&item == &it->front() ? "" : c.list_separator) + value;
        }
        r.values.push_back(std::move(joined));
        continue;
      }
      if (it == j.end() || !(it->is_string() || it->is_number_integer()))
        file_error(path, n, "no string or integer field \"" + c.name + "\"" + (c.list_separator.empty() ? "" : " (or list of them)") + ": set " +
                                c.key + " to the field that holds it");
      r.values.push_back(scalar(*it));
    }
    out.push_back(std::move(r));
  }
  return out;
}

// libcsv hands over fields and record ends through callbacks; this collects them.
struct CsvCollector {
  std::vector<std::vector<std::string>> records;
  std::vector<std::string> current;
  static void field(void* s, size_t len, void* self) {
    static_cast<CsvCollector*>(self)->current.emplace_back(static_cast<const char*>(s), s == nullptr ? 0 : len);
  }
  static void row(int, void* self) {
    auto* c = static_cast<CsvCollector*>(self);
    c->records.push_back(std::move(c->current));
    c->current.clear();
  }
};

std::vector<TableRecord> read_csv(const std::filesystem::path& path, const std::vector<TableColumn>& columns) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ember::RunError("cannot read " + path.string());
  const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  csv_parser p{};
  if (csv_init(&p, CSV_STRICT | CSV_STRICT_FINI | CSV_APPEND_NULL) != 0) throw ember::RunError(path.string() + ": cannot start the CSV parser");
  CsvCollector c;
  const size_t done = csv_parse(&p, data.data(), data.size(), CsvCollector::field, CsvCollector::row, &c);
  const bool ok = done == data.size() && csv_fini(&p, CsvCollector::field, CsvCollector::row, &c) == 0;
  const std::string err = ok ? "" : csv_strerror(csv_error(&p));
  csv_free(&p);
  if (!ok) {
    const int64_t line = 1 + std::count(data.begin(), data.begin() + static_cast<std::ptrdiff_t>(std::min(done, data.size())), '\n');
    file_error(path, line, "malformed CSV (" + err + "): quote fields that hold commas, quotes or newlines");
  }
  if (c.records.empty()) file_error(path, 1, "empty file: a CSV file needs a header row naming its columns");
  const auto& header = c.records.front();
  std::vector<size_t> index;
  for (const auto& col : columns) {
    const auto it = std::find(header.begin(), header.end(), col.name);
    if (it == header.end()) file_error(path, 1, "no column \"" + col.name + "\" in the header: set " + col.key + " to one of its columns");
    index.push_back(static_cast<size_t>(it - header.begin()));
  }
  std::vector<TableRecord> out;
  for (size_t r = 1; r < c.records.size(); ++r) {
    const auto& rec = c.records[r];
    if (rec.size() != header.size())
      file_error(path, static_cast<int64_t>(r + 1),
                 "record " + std::to_string(r) + " has " + std::to_string(rec.size()) + " fields, the header " + std::to_string(header.size()));
    TableRecord t;
    t.line = static_cast<int64_t>(r + 1);
    for (size_t i : index) t.values.push_back(rec[i]);
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace

std::vector<std::string> split_list(const std::string& field, const std::string& separator) {
  if (separator.empty()) return {field};
  std::vector<std::string> out;
  for (size_t start = 0; start <= field.size();) {
    const size_t end = std::min(field.find(separator, start), field.size());
    const std::string item = field.substr(start, end - start);
    const size_t first = item.find_first_not_of(" \t"), last = item.find_last_not_of(" \t");
    if (first != std::string::npos) out.push_back(item.substr(first, last - first + 1));
    start = end + separator.size();
  }
  return out;
}

namespace {

// A label that is a class index: digits, at most 9 of them, no leading zero ("007" is a name).
int64_t class_index(const std::string& s) {
  if (s.empty() || s.size() > 9 || (s.size() > 1 && s[0] == '0') ||
      !std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isdigit(c) != 0; }))
    return -1;
  return std::stoll(s);
}

}  // namespace

std::vector<std::string> label_classes(const std::vector<std::string>& labels) {
  std::vector<std::string> classes = labels;
  std::sort(classes.begin(), classes.end());
  classes.erase(std::unique(classes.begin(), classes.end()), classes.end());
  if (classes.empty() || !std::all_of(classes.begin(), classes.end(), [](const std::string& l) { return class_index(l) >= 0; }))
    return classes;
  int64_t top = 0;
  for (const auto& l : classes) top = std::max(top, class_index(l));
  // Dense integers are ids: "0" .. the largest. Sparse ones (codes such as 20417 among a few
  // labels) would make a class of every unused number below the largest, up to a billion: they
  // stay names, in numeric order.
  if (top + 1 <= 4 * static_cast<int64_t>(classes.size())) {
    classes.clear();
    for (int64_t c = 0; c <= top; ++c) classes.push_back(std::to_string(c));
    return classes;
  }
  std::sort(classes.begin(), classes.end(), [](const std::string& a, const std::string& b) { return class_index(a) < class_index(b); });
  return classes;
}

bool is_table_file(const std::filesystem::path& path) {
  const std::string ext = path.extension().string();
  return ext == ".csv" || ext == ".jsonl" || ext == ".ndjson";
}

std::vector<TableRecord> read_table(const std::filesystem::path& path, const std::vector<TableColumn>& columns) {
  return path.extension() == ".csv" ? read_csv(path, columns) : read_jsonl(path, columns);
}

}  // namespace ember::support
