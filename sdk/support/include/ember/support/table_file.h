// Tables users write by hand or export from elsewhere: a CSV file with a header row (RFC 4180
// quoting, parsed by libcsv) or a JSON Lines file (one object a line, parsed by nlohmann-json).
// What data plugins read their lists from: text_classification's texts and labels, image_folder's
// image paths and labels. Ember::table_file, a small compiled library (static, position-
// independent, hidden); libcsv and nlohmann-json stay private to it.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace ember::support {

// A column to read: the header's column (CSV) or the object's field (JSONL), and the config key
// that names it (for the message when it is missing).
struct TableColumn {
  std::string name;
  std::string key;
  // Non-empty: the column may hold a list. A JSONL array of strings and integers is read as its
  // items joined by this separator (an item holding the separator is refused: it would split); a
  // CSV cell is read as it is (its list already written with the separator).
  std::string list_separator = {};
};

// One record: a value per requested column, in their order (a JSONL integer as its decimal text),
// and the line it starts on (1-based; the header is line 1 of a CSV file).
struct TableRecord {
  std::vector<std::string> values;
  int64_t line = 0;
};

// .csv, .jsonl or .ndjson.
bool is_table_file(const std::filesystem::path& path);

// The requested columns of every record. Throws ember::RunError "PATH:LINE: what is wrong; how to
// fix it" for an unreadable or malformed file, a missing column, a CSV record with another number
// of fields than the header, or a JSONL field that is neither a string nor an integer (nor, for a
// list column, an array of them). Blank JSONL
// lines are skipped.
std::vector<TableRecord> read_table(const std::filesystem::path& path, const std::vector<TableColumn>& columns);

// A list field's items: split at `separator`, each without the spaces and tabs around it, empty
// ones left out ("a; b;" -> {"a", "b"}; "" -> {}). With no separator, the field itself.
std::vector<std::string> split_list(const std::string& field, const std::string& separator);

// The classes a training file's labels define, in id order (SDK 2.21): when every label is an
// integer (digits, at most 9, no leading zero) and they are dense (the largest below 4x the
// number of distinct labels) they are class indices, "0" .. the largest, so output i is label i
// as in a Hugging Face dataset's integer labels (a class no row names keeps its id); sparse
// integers (codes) are names in numeric order; otherwise the distinct names, sorted
// (torchvision sorts class folders). Empty for no labels.
std::vector<std::string> label_classes(const std::vector<std::string>& labels);

}  // namespace ember::support
