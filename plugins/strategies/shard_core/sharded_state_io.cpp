#include "sharded_state_io.h"

#include <ember/error.h>

#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>
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
    if (build) out.insert(p.name, whole.to(at::kCPU).clone());
  }
  if (build)
    for (const auto& b : module.named_buffers()) out.insert(b.key(), b.value().detach().to(at::kCPU).clone());
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
c10::IValue ShardedStateIO::sharded_state(torch::nn::Module& module, torch::optim::Optimizer& optimizer) {
  using Dict = c10::impl::GenericDict;
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
    e.insert("data", p.shard.detach().to(at::kCPU).clone());
    params.insert(p.name, e);
  }
  part.insert("params", params);
  Dict buffers(c10::StringType::get(), c10::AnyType::get());
  for (const auto& b : module.named_buffers()) {
    at::Tensor whole = tp_.to_whole ? tp_.to_whole(b.key(), b.value().detach()) : b.value().detach();
    if (c_.rank() == 0 && tp_.rank == 0) buffers.insert(b.key(), whole.to(at::kCPU).clone());
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
        mine.insert(name, field.detach().to(at::kCPU).clone());
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

// The whole tensor's flat index of every element of the slice, in the slice's flat order.
at::Tensor whole_indices(const Slice& s, const std::vector<int64_t>& whole_shape) {
  int64_t n = 1;
  for (auto d : whole_shape) n *= d;
  at::Tensor all = at::arange(n, at::kLong);
  if (!s.split) return all;
  return ember::shard_of(all.view(whole_shape), s.shard, s.rank, s.size).reshape({-1});
}

}  // namespace

// Re-sharding: each saved part holds, of a parameter, elements [i * c', i * c' + valid') of the
// tensor its rank trained (i its shard index, c' its chunk): the whole parameter, or a
// tensor-parallel slice of it. This rank needs [r * c, r * c + valid) of its own. Where the two
// tensors are laid out alike (both whole, or slices of the same split) the overlap of the ranges
// is copied; across tensor-parallel degrees the elements are matched by their flat index in the
// whole tensor. Parts are read one at a time, so any saved mesh loads onto any other with at most
// one part in memory besides this rank's shards.
void ShardedStateIO::load_sharded_state(torch::nn::Module& module, torch::optim::Optimizer& optimizer, int64_t saved_world,
                                        const std::function<c10::IValue(int64_t)>& read_part) {
  if (saved_world < 1) throw ember::RunError("the sharded checkpoint says it was written by " + std::to_string(saved_world) + " ranks");
  auto first = read_part(0).toGenericDict();
  // Groups, options and step counts from rank 0's serialization (over the whole model's groups
  // when it ran pipeline stages); per-element fields refilled below.
  {
    at::Tensor blob = first.at("optimizer").toTensor().contiguous();
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
    by_name.emplace(n.p->name, i);
  }
  for (auto& group : optimizer.param_groups())
    for (auto& t : group.params()) {
      auto it = optimizer.state().find(t.unsafeGetTensorImpl());
      if (it == optimizer.state().end()) continue;
      auto& n = needs[t_.param_of_shard.at(t.unsafeGetTensorImpl())];
      for_each_state_tensor(*it->second, [&](const char* name, at::Tensor& field) {
        field = at::zeros({n.p->valid}, field.options().device(n.p->shard.device()));
        n.fields.emplace_back(name, &field);
      });
    }
  std::map<std::string, bool> buffer_found;
  for (const auto& b : module.named_buffers()) buffer_found[b.key()] = false;

  at::NoGradGuard no_grad;
  const int64_t rank = c_.rank();  // this rank's place among the shards (of its replica)
  for (int64_t k = 0; k < saved_world; ++k) {
    auto part = k == 0 ? first : read_part(k).toGenericDict();
    if (part.contains("copy_of")) continue;  // a later replica's: the first replica's parts hold its tensors
    if (!part.contains("params"))
      throw ember::RunError("part " + std::to_string(k) + " holds no tensors and names no copy (a damaged checkpoint?)");
    const std::string of_part = "part " + std::to_string(k);
    const int64_t part_tp_rank = int_or(part, "tensor_parallel_rank", 0);
    auto sp = part.at("params").toGenericDict();
    auto sf = part.at("optimizer_fields").toGenericDict();
    for (const auto& item : sp) {
      auto found = by_name.find(item.key().toStringRef());
      if (found == by_name.end()) continue;  // another stage's
      auto& n = needs[found->second];
      auto& p = *n.p;
      auto entry = item.value().toGenericDict();
      Slice saved;
      if (entry.contains("split_dim"))
        saved = {true, {p.name, entry.at("split_dim").toInt(), int_or(entry, "split_blocks", 1)}, part_tp_rank,
                 int_or(part, "tensor_parallel_size", 1)};
      else if (part_tp_rank != 0)
        continue;  // a whole tensor every tensor-parallel rank holds: rank 0's copy is read
      const auto shape = entry.at("shape").toIntVector();
      const auto whole_shape = entry.contains("whole_shape") ? entry.at("whole_shape").toIntVector() : shape;
      if (whole_shape != n.whole_shape)
        throw ember::RunError("'" + p.name + "' has shape " + c10::str(c10::IntArrayRef(whole_shape)) + " but the model's is " +
                              c10::str(c10::IntArrayRef(n.whole_shape)) + " (was it saved from a model with other settings?)");
      const bool alike = saved.same_as(n.slice);
      if (alike && saved.split && saved.rank != n.slice.rank) continue;  // another tensor-parallel rank's slice
      int64_t numel = 1;
      for (auto d : shape) numel *= d;
      const int64_t chunk = entry.at("chunk").toInt(), index = int_or(entry, "index", k);
      const int64_t begin = index * chunk, end = std::min(numel, begin + chunk), count = std::max<int64_t>(0, end - begin);
      // Where the part's elements go in this rank's shard: a range, or (across degrees) a list.
      int64_t lo = 0, hi = 0;
      at::Tensor dst_index, src_index;
      if (alike) {
        lo = std::max(begin, rank * p.chunk);
        hi = std::min(end, rank * p.chunk + p.valid);
        if (lo >= hi) continue;
      } else {
        if (count == 0 || p.valid == 0) continue;
        if (!n.sorted.defined()) {
          auto sorted = whole_indices(n.slice, n.whole_shape).narrow(0, rank * p.chunk, p.valid).sort();
          n.sorted = std::get<0>(sorted);
          n.order = std::get<1>(sorted);
        }
        const at::Tensor have = whole_indices(saved, whole_shape).narrow(0, begin, count);
        const at::Tensor slot = at::searchsorted(n.sorted, have).clamp_max(p.valid - 1);
        const at::Tensor match = n.sorted.index_select(0, slot).eq(have);
        src_index = match.nonzero().reshape({-1});
        if (src_index.numel() == 0) continue;
        dst_index = n.order.index_select(0, slot.index_select(0, src_index));
      }
      auto copy = [&](const at::Tensor& dst, const at::Tensor& src, const std::string& what) {
        if (src.numel() != count)
          throw ember::RunError(of_part + " holds " + std::to_string(src.numel()) + " elements of " + what + ", expected " +
                                std::to_string(count) + " (a damaged checkpoint?)");
        if (alike) {
          dst.narrow(0, lo - rank * p.chunk, hi - lo).copy_(src.narrow(0, lo - begin, hi - lo));
        } else {
          const at::Tensor values = src.index_select(0, src_index).to(dst.options());
          dst.index_copy_(0, dst_index.to(dst.device()), values);
        }
      };
      copy(p.shard.detach(), entry.at("data").toTensor(), "'" + p.name + "'");
      if (alike) n.filled.narrow(0, lo - rank * p.chunk, hi - lo).fill_(true);
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
  }
  for (const auto& n : needs) {
    const int64_t got = n.filled.sum().item<int64_t>();
    if (got == n.p->valid) continue;
    if (got == 0) throw ember::RunError("lacks parameter '" + n.p->name + "' (was it saved from another model?)");
    throw ember::RunError("holds " + std::to_string(got) + " of the " + std::to_string(n.p->valid) + " elements of '" + n.p->name +
                          "' this rank needs (a damaged checkpoint?)");
  }
  for (const auto& [name, found] : buffer_found)
    if (!found) throw ember::RunError("lacks buffer '" + name + "' (was it saved from another model?)");
}

}  // namespace ember_shard
