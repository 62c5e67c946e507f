// The pieces of the csv logger that need no trainer: number cells, RFC 4180 quoting and parsing,
// atomic file replacement and durable appends. Header-only and free of Ember types so unit tests can include it.
#pragma once
#include <ember/support/number_text.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace ember_csv {

namespace fs = std::filesystem;

// One row of metrics.csv: column name -> cell text. Columns a row lacks are empty cells.
using Row = std::map<std::string, std::string>;

// The shortest text that reads back as the same number (see <ember/support/number_text.h>).
inline std::string format_number(double v) { return ember::shortest_number(v); }

// RFC 4180: a field with a comma, quote or line break is quoted, quotes doubled.
inline std::string escape(const std::string& field) {
  if (field.find_first_of(",\"\r\n") == std::string::npos) return field;
  std::string out = "\"";
  for (char c : field) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}

inline std::string join_line(const std::vector<std::string>& fields) {
  std::string out;
  for (size_t i = 0; i < fields.size(); ++i) {
    if (i) out += ',';
    out += escape(fields[i]);
  }
  return out + "\n";  // Python's csv writes "\r\n"; readers take both, and "\n" diffs cleanly
}

// The CSV line of `row` under `header`.
inline std::string row_line(const std::vector<std::string>& header, const Row& row) {
  std::vector<std::string> cells;
  cells.reserve(header.size());
  for (const auto& key : header) {
    auto it = row.find(key);
    cells.push_back(it == row.end() ? std::string() : it->second);
  }
  return join_line(cells);
}

// RFC 4180 records (quoted fields may hold commas, quotes and line breaks; "\r\n" or "\n" ends a
// record). Blank lines are skipped.
inline std::vector<std::vector<std::string>> parse(std::string_view text) {
  std::vector<std::vector<std::string>> records;
  std::vector<std::string> record;
  std::string field;
  bool quoted = false, field_started = false;
  auto end_record = [&] {
    if (field_started || !record.empty()) {
      record.push_back(std::move(field));
      records.push_back(std::move(record));
    }
    record.clear();
    field.clear();
    field_started = false;
  };
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (quoted) {
      if (c == '"' && i + 1 < text.size() && text[i + 1] == '"') {
        field += '"';
        ++i;
      } else if (c == '"') {
        quoted = false;
      } else {
        field += c;
      }
    } else if (c == '"') {
      quoted = field_started = true;
    } else if (c == ',') {
      record.push_back(std::move(field));
      field.clear();
      field_started = true;  // a trailing comma still makes an (empty) last field
    } else if (c == '\n' || c == '\r') {
      if (c == '\r' && i + 1 < text.size() && text[i + 1] == '\n') ++i;
      end_record();
    } else {
      field += c;
      field_started = true;
    }
  }
  end_record();
  return records;
}

// A CSV file as a header and rows keyed by it.
struct Table {
  std::vector<std::string> header;
  std::vector<Row> rows;
};

inline std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path.string() + ": " + std::strerror(errno));
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

inline Table parse_table(std::string_view text) {
  Table t;
  auto records = parse(text);
  if (records.empty()) return t;
  t.header = std::move(records.front());
  for (size_t r = 1; r < records.size(); ++r) {
    Row row;
    for (size_t i = 0; i < records[r].size() && i < t.header.size(); ++i) {
      if (!records[r][i].empty()) row[t.header[i]] = std::move(records[r][i]);
    }
    t.rows.push_back(std::move(row));
  }
  return t;
}
inline Table read_table(const fs::path& path) { return parse_table(read_file(path)); }

namespace detail {
inline void fail(const std::string& what, const fs::path& path) {
  throw std::runtime_error(what + " " + path.string() + ": " + std::strerror(errno));
}
inline void write_all(int fd, std::string_view data, const fs::path& path) {
  while (!data.empty()) {
    const ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail("cannot write", path);
    data.remove_prefix(static_cast<size_t>(n));
  }
}
inline fs::path temp_for(const fs::path& path) {
  std::string name = path.filename().string();
  name.insert(name.begin(), '.');
  name.append(".tmp");
  return path.parent_path() / name;
}
// Writes `data` (after what `tmp` already holds when `append`), makes it durable, and renames
// `tmp` over `path`: readers see the old file or the new one, never a half-written one.
inline void finish(const fs::path& tmp, const fs::path& path, std::string_view data, bool append) {
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CLOEXEC | (append ? O_APPEND : (O_CREAT | O_TRUNC)), 0644);
  if (fd < 0) fail("cannot create", tmp);
  try {
    write_all(fd, data, tmp);
    if (::fsync(fd) != 0) fail("cannot sync", tmp);
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::close(fd) != 0) fail("cannot close", tmp);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    fail("cannot rename onto", path);
  }
  // Make the rename itself durable.
  const fs::path dir = path.has_parent_path() ? path.parent_path() : fs::path(".");
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}
}  // namespace detail

// Replaces `path` with `content` atomically (a temporary file in the same folder, then rename).
inline void write_atomic(const fs::path& path, std::string_view content) {
  detail::finish(detail::temp_for(path), path, content, /*append=*/false);
}

// Appends `extra` to the existing file `path` in place and makes it durable (fsync): the cost is
// that of the new rows, not of the whole file. A failed write is cut back off (ftruncate), so a
// retry never follows half a row. Only a crash mid-write can leave a partial last record, which
// complete_records() finds on the next read.
inline void append_durable(const fs::path& path, std::string_view extra) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  if (fd < 0) detail::fail("cannot open", path);
  const off_t before = ::lseek(fd, 0, SEEK_END);
  try {
    if (before < 0) detail::fail("cannot seek", path);
    detail::write_all(fd, extra, path);
    if (::fsync(fd) != 0) detail::fail("cannot sync", path);
  } catch (...) {
    if (before >= 0 && ::ftruncate(fd, before) == 0) ::fsync(fd);
    ::close(fd);
    throw;
  }
  if (::close(fd) != 0) detail::fail("cannot close", path);
}

// The length of `text` up to the end of its last complete record: one that ends with a line break
// outside quotes. What follows is a record a crash cut short.
inline size_t complete_records(std::string_view text) {
  size_t end = 0;
  bool quoted = false;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '"') quoted = !quoted;  // a doubled quote toggles twice
    else if (!quoted && text[i] == '\n') end = i + 1;
  }
  return end;
}

}  // namespace ember_csv
