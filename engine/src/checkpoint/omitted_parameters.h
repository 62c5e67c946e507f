// Checkpoints that leave out frozen parameters (a transform such as LoRA says so:
// ember::IFrozenParameters): the file's "omitted_parameters" record names them, with their dtypes
// and one fingerprint of their values, and loading takes them from the model as the loading run
// built it, refusing a model whose values differ (another base, seed or precision). A run that
// started from [model] init_checkpoint records that checkpoint as their source too (`base`), and
// loading reads them from it (LitGPT's way: a fine-tune's checkpoints never copy the base).
#pragma once
#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace ember::engine {

struct OmittedParameters {
  std::vector<std::string> names;
  std::vector<c10::ScalarType> dtypes;  // as the saving run held them (its precision's)
  int64_t fingerprint = 0;
  // Where the values of `from_base` (a subset of `names`) came from: the run's init_checkpoint,
  // an absolute path. Empty: every one from the model as it is built.
  std::string base;
  std::vector<std::string> from_base;
  // The same checkpoint relative to the folder of the checkpoint holding the record (written when
  // both are known): a project folder that moved or was copied elsewhere whole, its checkpoints in
  // the same places relative to each other, still finds its base.
  std::string base_relative;
  // Read back with the holder's path: `base_relative` resolved against its folder, and whether
  // `base` was replaced by it because the recorded path is gone and this one is there.
  std::string beside;
  bool moved = false;

  c10::IValue to_ivalue() const;
  // Throws RunError naming `where` for a record that is not one. `holder`: the checkpoint file the
  // record came from, against which a relative base is found when the recorded one is gone.
  static OmittedParameters from_ivalue(const c10::IValue& v, const std::string& where, const std::filesystem::path& holder = {});
};

// `base` relative to the folder every one of `checkpoints` is written in (empty when they are in
// different folders, or no relative path leads there).
std::string base_relative_to(const std::string& base, const std::vector<std::string>& checkpoints);

// A CRC32C over the names, shapes and float32 values of `names`, each from `tensor_of`.
int64_t fingerprint_of(const std::vector<std::string>& names, const std::function<at::Tensor(const std::string&)>& tensor_of);

// `state` without `names` (rank 0's gathered model state before it is written); the record
// describes what was left out (its fingerprint computed once, then reused: the values are frozen).
c10::Dict<std::string, at::Tensor> without_omitted(const c10::Dict<std::string, at::Tensor>& state, const std::vector<std::string>& names,
                                                   std::optional<int64_t>& fingerprint, OmittedParameters& record);

// "WHERE leaves out N frozen parameters whose values come from BASE (model.init_checkpoint of the
// run that wrote it)": how every line about a checkpoint's base starts.
std::string from_base_text(const std::string& where, size_t count, const std::string& base);
// Why the record's base cannot be read `depth` bases deep (it is gone, from where it was recorded
// and from beside its holder alike, or the chain of bases is longer than 8: a checkpoint naming
// itself), as a whole line; empty when it can.
std::string unreadable_base(const std::string& where, const OmittedParameters& omitted, int depth);

// Fills `state` (read from a file that left `omitted` out) with this run's own values, converted
// to the dtypes the saving run held; `own` returns nothing for a name the model lacks. Throws
// RunError naming `where` when a name is missing or the values differ from the ones trained on.
void fill_omitted(c10::Dict<std::string, at::Tensor>& state, const OmittedParameters& omitted,
                  const std::function<std::optional<at::Tensor>(const std::string&)>& own, const std::string& where);

}  // namespace ember::engine
