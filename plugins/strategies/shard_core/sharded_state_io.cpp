#include "sharded_state_io.h"

#include <ember/error.h>
#include <ember/support/grad_util.h>

#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/serialize.h>

#include <ember/support/tensor_parallel.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <sstream>
#include <vector>

#include <ember/support/optimizer_state_tensors.h>

namespace ember_shard {

using ember::for_each_state_tensor;

at::Tensor ShardedStateIO::gather_whole(const ShardedParam& p, const at::Tensor& part) {
  at::NoGradGuard no_grad;
  if (c_.world() == 1) return part.detach().reshape({-1}).narrow(0, 0, p.numel).view(p.shape);
  // Collectives run on the compute device (NCCL needs device tensors); the result goes back
  // where `part` lives.
  at::Tensor in = at::zeros({p.chunk}, part.options().device(c_.comm.device()).requires_grad(false));
  if (p.valid > 0) in.narrow(0, 0, p.valid).copy_(part.detach().reshape({-1}));
  at::Tensor out = at::empty({p.chunk * c_.world()}, in.options());
  c_.comm.label("gather of " + p.name);
  c_.backend()._allgather_base(out, in)->wait();
  return out.narrow(0, 0, p.numel).view(p.shape);
}

c10::Dict<std::string, at::Tensor> ShardedStateIO::full_model_state(torch::nn::Module& module, bool build) {
  c10::Dict<std::string, at::Tensor> out;
  for (auto& p : t_.params) {
    at::Tensor whole = gather_whole(p, p.shard);
    if (tp_.to_whole) whole = tp_.to_whole(p.name, whole);
    if (build) out.insert(p.name, ember::detached_host_copy(whole));
  }
  if (build)
    for (const auto& b : module.named_buffers()) out.insert(b.key(), ember::detached_host_copy(b.value()));
  return out;
}

void ShardedStateIO::load_full_model_state(torch::nn::Module& module, const c10::Dict<std::string, at::Tensor>& whole_state) {
  c10::Dict<std::string, at::Tensor> state = whole_state;
  if (tp_.to_slice) {  // this rank's tensor-parallel slices of the whole tensors
    state = c10::Dict<std::string, at::Tensor>();
    for (const auto& e : whole_state) state.insert(e.key(), tp_.to_slice(e.key(), e.value()));
  }
  std::vector<std::string> missing;
  auto check = [&](const std::string& name, at::IntArrayRef sizes) {
    auto it = state.find(name);
    if (it == state.end()) {
      missing.push_back(name);
      return;
    }
    if (it->value().sizes() != sizes)
      throw ember::RunError("'" + name + "' has shape " + c10::str(it->value().sizes()) + " but the model's is " + c10::str(sizes) +
                            " (was it saved from a model with other settings?)");
  };
  for (const auto& p : t_.params) check(p.name, p.shape);
  for (const auto& b : module.named_buffers()) check(b.key(), b.value().sizes());
  if (!missing.empty())
    throw ember::RunError("lacks " + std::to_string(missing.size()) + " of the model's tensors, e.g. '" + missing.front() +
                          "' (was it saved from another model?)");
  at::NoGradGuard no_grad;
  for (auto& p : t_.params) p.shard.detach().copy_(ShardTable::my_part(p, state.at(p.name), c_.rank()));
  for (auto& b : module.named_buffers()) b.value().detach().copy_(state.at(b.key()));
}

// torch::save of the optimizer with every per-element state tensor whole, exactly what a
// replicating strategy saves, so the file resumes under any strategy and world size.
std::string ShardedStateIO::full_optimizer_state(torch::optim::Optimizer& optimizer, bool rank0_only) {
  const bool build = !rank0_only || c_.comm.rank() == 0;
  std::vector<std::pair<at::Tensor*, at::Tensor>> saved;
  for (auto& group : optimizer.param_groups())
    for (auto& t : group.params()) {
      auto it = optimizer.state().find(t.unsafeGetTensorImpl());
      if (it == optimizer.state().end()) continue;
      const auto& p = t_.param_of(t);
      for_each_state_tensor(*it->second, [&](const char*, at::Tensor& field) {
        at::Tensor whole = gather_whole(p, field);
        if (tp_.to_whole) whole = tp_.to_whole(p.name, whole);
        saved.emplace_back(&field, field);
        field = whole;
      });
    }
  std::string bytes;
  if (build) {
    std::ostringstream out;
    torch::save(optimizer, out);
    bytes = out.str();
  }
  for (auto& [field, shard] : saved) *field = shard;
  return bytes;
}

at::Tensor ShardedStateIO::whole_field(const at::Tensor& trained, const at::Tensor& field) {
  const auto& p = t_.param_of(trained);
  at::Tensor whole = gather_whole(p, field);
  return tp_.to_whole ? tp_.to_whole(p.name, whole) : whole;
}

at::Tensor ShardedStateIO::part_of_field(const at::Tensor& trained, const at::Tensor& whole) {
  const auto& p = t_.param_of(trained);
  at::Tensor field = tp_.to_slice ? tp_.to_slice(p.name, whole) : whole;
  if (field.numel() != p.numel)
    throw ember::RunError("optimizer state of '" + p.name + "' has " + std::to_string(field.numel()) + " elements, the parameter " +
                          std::to_string(p.numel) + " (saved from another model?)");
  return ShardTable::my_part(p, field, c_.rank()).to(p.shard.device()).clone();
}

void ShardedStateIO::load_full_optimizer_state(torch::optim::Optimizer& optimizer, const std::string& bytes) {
  std::istringstream in(bytes);
  optimizer.state().clear();
  torch::load(optimizer, in);
  at::NoGradGuard no_grad;
  for (auto& group : optimizer.param_groups())
    for (auto& t : group.params()) {
      auto it = optimizer.state().find(t.unsafeGetTensorImpl());
      if (it == optimizer.state().end()) continue;
      const auto& p = t_.param_of(t);
      for_each_state_tensor(*it->second, [&](const char* name, at::Tensor& field) {
        if (tp_.to_slice) field = tp_.to_slice(p.name, field);
        if (field.numel() != p.numel)
          throw ember::RunError("optimizer state '" + std::string(name) + "' of '" + p.name + "' has " + std::to_string(field.numel()) +
                                " elements, the parameter " + std::to_string(p.numel) + " (saved from another model?)");
        field = ShardTable::my_part(p, field, c_.rank()).to(p.shard.device()).clone();
      });
    }
}

// A sharded checkpoint part: this rank's real elements of every parameter and of every per-element
// optimizer state tensor it trains, by parameter name, with what places them in the whole tensor
// (the shard's index and chunk size, and under tensor parallelism the slice's split); the
// optimizer's own serialization with those fields emptied (groups, options and step counts, over
// the whole model's groups under pipeline parallelism); and, in the parts of each stage's first
// shard and tensor-parallel rank, that stage's buffers, whole.
namespace {

using Dict = c10::impl::GenericDict;

// What a part holds, without its values: the part's keys, each parameter's entry without "data",
// the buffers' names. Loading decides from it whether a part is worth reading.
Dict layout_of(const Dict& part) {
  Dict layout(c10::StringType::get(), c10::AnyType::get());
  for (const auto& item : part) {
    const std::string& key = item.key().toStringRef();
    if (key == "params") {
      Dict params(c10::StringType::get(), c10::AnyType::get());
      for (const auto& p : item.value().toGenericDict()) {
        Dict entry(c10::StringType::get(), c10::AnyType::get());
        for (const auto& e : p.value().toGenericDict())
          if (e.key().toStringRef() != "data") entry.insert(e.key(), e.value());
        params.insert(p.key(), entry);
      }
      layout.insert("params", params);
    } else if (key == "buffers") {
      c10::List<std::string> names;
      for (const auto& b : item.value().toGenericDict()) names.push_back(b.key().toStringRef());
      layout.insert("buffers", names);
    } else if (item.value().isInt()) {
      layout.insert(item.key(), item.value());
    }
  }
  return layout;
}

}  // namespace

// Every rank's layout_of(part), in world rank order (the order of the directory's part files),
// gathered over the world: the lengths, then the pickled layouts as the rows of one byte tensor,
// each rank filling its own row of zeros, summed.
std::vector<c10::IValue> ShardedStateIO::gather_layouts(const c10::IValue& layout) {
  const std::vector<char> bytes = torch::jit::pickle_save(layout);
  const int64_t world = c_.comm.world(), me = c_.comm.rank();
  at::Tensor lengths = at::zeros({world}, at::kLong);
  lengths[me] = static_cast<int64_t>(bytes.size());
  lengths = c_.comm.reduce(lengths, ember::ReduceOp::sum);
  at::Tensor rows = at::zeros({world, lengths.max().item<int64_t>()}, at::kByte);
  std::memcpy(rows[me].data_ptr(), bytes.data(), bytes.size());
  rows = c_.comm.reduce(rows, ember::ReduceOp::sum);
  std::vector<c10::IValue> layouts;
  for (int64_t r = 0; r < world; ++r) {
    const auto* data = static_cast<const char*>(rows[r].data_ptr());
    layouts.push_back(torch::jit::pickle_load(std::vector<char>(data, data + lengths[r].item<int64_t>())));
  }
  return layouts;
}

c10::IValue ShardedStateIO::sharded_state(torch::nn::Module& module, torch::optim::Optimizer& optimizer) {
  Dict part = part_of_this_rank(module, optimizer);
  // The first part (world rank 0's, read first by every load) carries every part's layout, so a
  // loading rank reads only the parts that hold something it needs.
  if (c_.comm.world() > 1) {
    const auto layouts = gather_layouts(layout_of(part));
    if (c_.comm.rank() == 0) {
      c10::impl::GenericList list(c10::AnyType::get());
      for (const auto& l : layouts) list.push_back(l);
      part.insert("layout", list);
    }
  }
  return part;
}

c10::impl::GenericDict ShardedStateIO::part_of_this_rank(torch::nn::Module& module, torch::optim::Optimizer& optimizer) {
  Dict part(c10::StringType::get(), c10::AnyType::get());
  part.insert("world_size", static_cast<int64_t>(c_.world()));
  part.insert("rank", static_cast<int64_t>(c_.comm.rank()));
  part.insert("stage", static_cast<int64_t>(c_.o.stage));
  part.insert("index", static_cast<int64_t>(c_.rank()));
  part.insert("pipeline_rank", pp_.rank);
  part.insert("tensor_parallel_rank", tp_.rank);
  part.insert("tensor_parallel_size", tp_.size);
  // Hybrid sharding: the replicas hold the same shards, so only the first replica's ranks save
  // theirs; the others' parts say whose copy they hold. (The collectives below run within a
  // replica: its pipeline and tensor-parallel groups.)
  if (c_.replicas.rank > 0) {
    part.insert("replica", static_cast<int64_t>(c_.replicas.rank));
    part.insert("copy_of", static_cast<int64_t>(c_.rank()));
    return part;
  }
  Dict params(c10::StringType::get(), c10::AnyType::get());
  for (const auto& p : t_.params) {
    Dict e(c10::StringType::get(), c10::AnyType::get());
    e.insert("shape", c10::List<int64_t>(p.shape));
    e.insert("chunk", p.chunk);
    e.insert("index", static_cast<int64_t>(c_.rank()));
    if (auto it = tp_.splits.find(p.name); it != tp_.splits.end()) {
      std::vector<int64_t> whole = p.shape;
      whole[it->second.dim] *= tp_.size;
      e.insert("whole_shape", c10::List<int64_t>(whole));
      e.insert("split_dim", it->second.dim);
      e.insert("split_blocks", it->second.blocks);
    }
    e.insert("data", ember::detached_host_copy(p.shard));
    params.insert(p.name, e);
  }
  part.insert("params", params);
  // Every part holds its rank's buffers (small beside the shards): a rank resumed on the same mesh
  // then reads its own part and no other.
  Dict buffers(c10::StringType::get(), c10::AnyType::get());
  for (const auto& b : module.named_buffers()) {
    at::Tensor whole = tp_.to_whole ? tp_.to_whole(b.key(), b.value().detach()) : b.value().detach();
    buffers.insert(b.key(), ember::detached_host_copy(whole));
  }
  part.insert("buffers", buffers);
  Dict fields(c10::StringType::get(), c10::AnyType::get());
  std::vector<std::pair<at::Tensor*, at::Tensor>> saved;
  for (auto& group : optimizer.param_groups())
    for (auto& t : group.params()) {
      auto it = optimizer.state().find(t.unsafeGetTensorImpl());
      if (it == optimizer.state().end()) continue;
      const auto& p = t_.param_of(t);
      Dict mine(c10::StringType::get(), c10::AnyType::get());
      for_each_state_tensor(*it->second, [&](const char* name, at::Tensor& field) {
        mine.insert(name, ember::detached_host_copy(field));
        saved.emplace_back(&field, field);
        field = at::empty({0}, field.options());
      });
      fields.insert(p.name, mine);
    }
  std::string bytes;
  try {
    if (pp_.save_optimizer) {
      bytes = pp_.save_optimizer(optimizer);
    } else {
      std::ostringstream out;
      torch::save(optimizer, out);
      bytes = out.str();
    }
  } catch (...) {
    for (auto& [field, value] : saved) *field = value;
    throw;
  }
  for (auto& [field, value] : saved) *field = value;
  at::Tensor blob = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(blob.data_ptr(), bytes.data(), bytes.size());
  part.insert("optimizer", blob);
  part.insert("optimizer_fields", fields);
  return part;
}

namespace {

int64_t int_or(const c10::impl::GenericDict& d, const char* key, int64_t fallback) {
  return d.contains(key) ? d.at(key).toInt() : fallback;
}

// How a saved (or this rank's) tensor sits in the whole one: its tensor-parallel slice, if split.
struct Slice {
  bool split = false;
  ember::TensorShard shard;
  int64_t rank = 0, size = 1;
  bool same_as(const Slice& o) const {
    return split == o.split && (!split || (shard.dim == o.shard.dim && shard.blocks == o.shard.blocks && size == o.size));
  }
};

// The whole tensor's flat index of the slice's elements [begin, begin + count) (in the slice's flat
// order), computed for those elements only: a whole-size index of a large embedding would take
// 8 bytes per element of the whole tensor on every rank. The slice is ember::shard_of's: along
// `dim`, each of `blocks` equal blocks cut into `size` equal pieces, the rank's piece of each block.
at::Tensor whole_indices(const Slice& s, const std::vector<int64_t>& whole_shape, int64_t begin, int64_t count) {
  at::Tensor i = at::arange(begin, begin + count, at::kLong);
  if (!s.split) return i;
  const auto d = static_cast<size_t>(s.shard.dim);
  int64_t inner = 1;
  for (size_t k = d + 1; k < whole_shape.size(); ++k) inner *= whole_shape[k];
  const int64_t rows = whole_shape[d], block = rows / s.shard.blocks, piece = block / s.size;
  const int64_t slice_rows = piece * s.shard.blocks;
  const at::Tensor outer = i.div(slice_rows * inner, "floor"), within = i.remainder(slice_rows * inner);
  const at::Tensor row = within.div(inner, "floor"), col = within.remainder(inner);
  const at::Tensor whole_row = row.div(piece, "floor") * block + s.rank * piece + row.remainder(piece);
  return outer * (rows * inner) + whole_row * inner + col;
}

}  // namespace

// Re-sharding: each saved part holds, of a parameter, elements [i * c', i * c' + valid') of the
// tensor its rank trained (i its shard index, c' its chunk): the whole parameter, or a
// tensor-parallel slice of it. This rank needs [r * c, r * c + valid) of its own. Where the two
// tensors are laid out alike (both whole, or slices of the same split) the overlap of the ranges
// is copied; across tensor-parallel degrees the elements are matched by their flat index in the
// whole tensor. Parts are read one at a time, so any saved mesh loads onto any other with at most
// one part in memory besides this rank's shards. The first part read is the one this world rank
// wrote: resumed on the mesh that saved it, that part holds everything the rank needs and is the
// only one read. Otherwise the first part (world rank 0's) follows, whose list of every part's
// layout says which others hold something still missing.
int64_t ShardedStateIO::load_sharded_state(torch::nn::Module& module, torch::optim::Optimizer& optimizer, int64_t saved_world,
                                           const std::function<c10::IValue(int64_t)>& read_part, bool with_optimizer,
                                           const Pick& pick, int64_t* kept) {
  if (with_optimizer && pick) throw std::logic_error("load_sharded_state: pick is for the model alone");
  auto source = [&](const std::string& name) { return pick ? pick(name) : ember::InitialTensor::from_checkpoint; };
  if (saved_world < 1) throw ember::RunError("the sharded checkpoint says it was written by " + std::to_string(saved_world) + " ranks");
  const int64_t me = c_.comm.rank();
  int64_t start = me < saved_world ? me : 0;
  Dict head = read_part(start).toGenericDict();
  if (start != 0 && !head.contains("optimizer")) {  // a later replica's copy: it holds no state
    start = 0;
    head = read_part(0).toGenericDict();
  }
  // Groups, options and step counts from the serialization of the part read first (every rank
  // writes the same groups: its shards of every parameter, or the whole model's groups when it ran
  // pipeline stages); per-element fields refilled below.
  if (with_optimizer) {
    at::Tensor blob = head.at("optimizer").toTensor().contiguous();
    const std::string bytes(static_cast<const char*>(blob.data_ptr()), static_cast<size_t>(blob.numel()));
    optimizer.state().clear();
    if (pp_.load_optimizer) {
      pp_.load_optimizer(optimizer, bytes);
    } else {
      std::istringstream in(bytes);
      torch::load(optimizer, in);
    }
  }
  // What this rank needs, per parameter.
  struct Need {
    ShardedParam* p = nullptr;
    Slice slice;
    std::vector<int64_t> whole_shape;
    std::vector<std::pair<std::string, at::Tensor*>> fields;  // the optimizer state to fill
    at::Tensor filled;                                         // which of the valid elements arrived
    at::Tensor sorted, order;                                  // their whole indices, sorted (across degrees)
    ember::InitialTensor source = ember::InitialTensor::from_checkpoint;
  };
  std::vector<Need> needs(t_.params.size());
  std::map<std::string, size_t> by_name;
  for (size_t i = 0; i < t_.params.size(); ++i) {
    auto& n = needs[i];
    n.p = &t_.params[i];
    n.whole_shape = n.p->shape;
    if (auto it = tp_.splits.find(n.p->name); it != tp_.splits.end()) {
      n.slice = {true, it->second, tp_.rank, tp_.size};
      n.whole_shape[it->second.dim] *= tp_.size;
    }
    n.filled = at::zeros({n.p->valid}, at::kBool);
    n.source = source(n.p->name);
    if (n.source == ember::InitialTensor::own) {
      n.filled.fill_(true);  // (its own value stays: the parts' entry, of any shape, is not looked at)
      continue;
    }
    by_name.emplace(n.p->name, i);
  }
  for (auto& group : optimizer.param_groups())
    for (auto& t : group.params()) {
      if (!with_optimizer) continue;  // (its fields stay as they are)
      auto it = optimizer.state().find(t.unsafeGetTensorImpl());
      if (it == optimizer.state().end()) continue;
      auto& n = needs[t_.param_of_shard.at(t.unsafeGetTensorImpl())];
      for_each_state_tensor(*it->second, [&](const char* name, at::Tensor& field) {
        field = at::zeros({n.p->valid}, field.options().device(n.p->shard.device()));
        n.fields.emplace_back(name, &field);
      });
    }
  std::map<std::string, bool> buffer_found;
  std::map<std::string, bool> buffer_optional;  // from_checkpoint_if_saved
  for (const auto& b : module.named_buffers()) {
    const auto from = source(b.key());
    buffer_found[b.key()] = from == ember::InitialTensor::own;
    if (from == ember::InitialTensor::from_checkpoint_if_saved) buffer_optional[b.key()] = true;
  }

  at::NoGradGuard no_grad;
  const int64_t rank = c_.rank();  // this rank's place among the shards (of its replica)
  // Where a saved entry's elements lie against what this rank needs: a range of both layouts
  // (alike), or, across tensor-parallel degrees, possibly some (matched element by element below).
  struct Placement {
    bool any = false, alike = false;
    Slice saved;
    std::vector<int64_t> shape;
    int64_t begin = 0, end = 0, count = 0, lo = 0, hi = 0;
  };
  auto place = [&](const Need& n, const Dict& entry, int64_t part_tp_rank, int64_t part_tp_size, int64_t k) {
    const auto& p = *n.p;
    Placement pl;
    if (entry.contains("split_dim"))
      pl.saved = {true, {p.name, entry.at("split_dim").toInt(), int_or(entry, "split_blocks", 1)}, part_tp_rank, part_tp_size};
    else if (part_tp_rank != 0)
      return pl;  // a whole tensor every tensor-parallel rank holds: rank 0's copy is read
    pl.shape = entry.at("shape").toIntVector();
    const auto whole_shape = entry.contains("whole_shape") ? entry.at("whole_shape").toIntVector() : pl.shape;
    if (whole_shape != n.whole_shape)
      throw ember::RunError("'" + p.name + "' has shape " + c10::str(c10::IntArrayRef(whole_shape)) + " but the model's is " +
                            c10::str(c10::IntArrayRef(n.whole_shape)) + " (was it saved from a model with other settings?)");
    pl.alike = pl.saved.same_as(n.slice);
    if (pl.alike && pl.saved.split && pl.saved.rank != n.slice.rank) return pl;  // another tensor-parallel rank's slice
    int64_t numel = 1;
    for (auto d : pl.shape) numel *= d;
    const int64_t chunk = entry.at("chunk").toInt(), index = int_or(entry, "index", k);
    pl.begin = index * chunk;
    pl.end = std::min(numel, pl.begin + chunk);
    pl.count = std::max<int64_t>(0, pl.end - pl.begin);
    if (pl.alike) {
      pl.lo = std::max(pl.begin, rank * p.chunk);
      pl.hi = std::min(pl.end, rank * p.chunk + p.valid);
      pl.any = pl.lo < pl.hi;
    } else {
      pl.any = pl.count > 0 && p.valid > 0;
    }
    return pl;
  };
  // From the first part's list of layouts: whether part k holds anything this rank still needs.
  auto worth_reading = [&](const Dict& layout, int64_t k) {
    if (layout.contains("copy_of")) return false;
    if (!layout.contains("params")) return true;  // reading it says what is wrong
    const int64_t part_tp_rank = int_or(layout, "tensor_parallel_rank", 0), part_tp_size = int_or(layout, "tensor_parallel_size", 1);
    for (const auto& item : layout.at("params").toGenericDict()) {
      auto found = by_name.find(item.key().toStringRef());
      if (found == by_name.end()) continue;
      const Need& n = needs[found->second];
      const Placement pl = place(n, item.value().toGenericDict(), part_tp_rank, part_tp_size, k);
      if (!pl.any) continue;
      if (!pl.alike) return true;  // (which elements it holds is known once it is read)
      if (!n.filled.narrow(0, pl.lo - rank * n.p->chunk, pl.hi - pl.lo).all().item<bool>()) return true;
    }
    if (layout.contains("buffers"))
      for (const auto& name : layout.at("buffers").toListRef()) {
        auto it = buffer_found.find(name.toStringRef());
        if (it != buffer_found.end() && !it->second) return true;
      }
    return false;
  };
  int64_t parts_read = 0;
  // Copies what part k holds of this rank's shards, optimizer state and buffers.
  auto take = [&](const Dict& part, int64_t k) {
    ++parts_read;
    if (part.contains("copy_of")) return;  // a later replica's: the first replica's parts hold its tensors
    if (!part.contains("params"))
      throw ember::RunError("part " + std::to_string(k) + " holds no tensors and names no copy (a damaged checkpoint?)");
    const std::string of_part = "part " + std::to_string(k);
    const int64_t part_tp_rank = int_or(part, "tensor_parallel_rank", 0), part_tp_size = int_or(part, "tensor_parallel_size", 1);
    auto sp = part.at("params").toGenericDict();
    auto sf = part.at("optimizer_fields").toGenericDict();
    for (const auto& item : sp) {
      auto found = by_name.find(item.key().toStringRef());
      if (found == by_name.end()) continue;  // another stage's
      auto& n = needs[found->second];
      auto& p = *n.p;
      auto entry = item.value().toGenericDict();
      const Placement pl = place(n, entry, part_tp_rank, part_tp_size, k);
      if (!pl.any) continue;
      // Where the part's elements go in this rank's shard: a range, or (across degrees) a list.
      at::Tensor dst_index, src_index;
      if (!pl.alike) {
        if (!n.sorted.defined()) {
          auto sorted = whole_indices(n.slice, n.whole_shape, rank * p.chunk, p.valid).sort();
          n.sorted = std::get<0>(sorted);
          n.order = std::get<1>(sorted);
        }
        const at::Tensor have = whole_indices(pl.saved, n.whole_shape, pl.begin, pl.count);
        const at::Tensor slot = at::searchsorted(n.sorted, have).clamp_max(p.valid - 1);
        const at::Tensor match = n.sorted.index_select(0, slot).eq(have);
        src_index = match.nonzero().reshape({-1});
        if (src_index.numel() == 0) continue;
        dst_index = n.order.index_select(0, slot.index_select(0, src_index));
      }
      auto copy = [&](const at::Tensor& dst, const at::Tensor& src, const std::string& what) {
        if (src.numel() != pl.count)
          throw ember::RunError(of_part + " holds " + std::to_string(src.numel()) + " elements of " + what + ", expected " +
                                std::to_string(pl.count) + " (a damaged checkpoint?)");
        if (pl.alike) {
          dst.narrow(0, pl.lo - rank * p.chunk, pl.hi - pl.lo).copy_(src.narrow(0, pl.lo - pl.begin, pl.hi - pl.lo));
        } else {
          const at::Tensor values = src.index_select(0, src_index).to(dst.options());
          dst.index_copy_(0, dst_index.to(dst.device()), values);
        }
      };
      copy(p.shard.detach(), entry.at("data").toTensor(), "'" + p.name + "'");
      if (pl.alike) n.filled.narrow(0, pl.lo - rank * p.chunk, pl.hi - pl.lo).fill_(true);
      else n.filled.index_fill_(0, dst_index, true);
      if (!n.fields.empty()) {
        if (!sf.contains(p.name)) throw ember::RunError(of_part + " has no optimizer state for '" + p.name + "'");
        auto fields = sf.at(p.name).toGenericDict();
        for (auto& [name, field] : n.fields) {
          if (!fields.contains(name))
            throw ember::RunError(of_part + " has no optimizer state '" + name + "' for '" + p.name + "'");
          copy(*field, fields.at(name).toTensor(), "the optimizer's '" + name + "' of '" + p.name + "'");
        }
      }
    }
    if (part.contains("buffers"))
      for (const auto& b : part.at("buffers").toGenericDict()) {
        auto it = buffer_found.find(b.key().toStringRef());
        if (it == buffer_found.end() || it->second) continue;
        at::Tensor value = b.value().toTensor();
        if (tp_.to_slice) value = tp_.to_slice(it->first, value);
        module.named_buffers()[it->first].detach().copy_(value);
        it->second = true;
      }
  };
  auto complete = [&] {
    for (const auto& n : needs)
      if (!n.filled.all().item<bool>()) return false;
    for (const auto& [name, found] : buffer_found)
      if (!found) return false;
    return true;
  };
  take(head, start);
  if (!complete()) {
    std::vector<bool> done(static_cast<size_t>(saved_world), false);
    done[static_cast<size_t>(start)] = true;
    if (start != 0) {
      head = read_part(0).toGenericDict();
      take(head, 0);
      done[0] = true;
    }
    std::vector<c10::IValue> layouts;
    if (head.contains("layout")) {
      const auto list = head.at("layout").toList();
      if (static_cast<int64_t>(list.size()) == saved_world)
        for (const auto& l : list) layouts.push_back(l);
    }
    head = Dict(c10::StringType::get(), c10::AnyType::get());  // (one part in memory at a time)
    for (int64_t k = 0; k < saved_world && !complete(); ++k) {
      if (done[static_cast<size_t>(k)]) continue;
      if (!layouts.empty() && !worth_reading(layouts[static_cast<size_t>(k)].toGenericDict(), k)) continue;
      take(read_part(k).toGenericDict(), k);
    }
  }
  int64_t absent = 0;
  for (const auto& n : needs) {
    const int64_t got = n.filled.sum().item<int64_t>();
    if (got == n.p->valid) continue;
    if (got == 0 && n.source == ember::InitialTensor::from_checkpoint_if_saved) {
      ++absent;  // not saved there: it keeps its value
      continue;
    }
    if (got == 0) throw ember::RunError("lacks parameter '" + n.p->name + "' (was it saved from another model?)");
    throw ember::RunError("holds " + std::to_string(got) + " of the " + std::to_string(n.p->valid) + " elements of '" + n.p->name +
                          "' this rank needs (a damaged checkpoint?)");
  }
  for (const auto& [name, found] : buffer_found) {
    if (found) continue;
    if (buffer_optional.count(name)) {
      ++absent;
      continue;
    }
    throw ember::RunError("lacks buffer '" + name + "' (was it saved from another model?)");
  }
  if (kept != nullptr) *kept = absent;
  return parts_read;
}

}  // namespace ember_shard
