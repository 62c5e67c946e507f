#include "sharded_state_io.h"

#include <ember/error.h>

#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>
#include <torch/serialize.h>

#include <algorithm>
#include <cstring>
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
    if (to_whole_) whole = to_whole_(p.name, whole);
    if (build) out.insert(p.name, whole.to(at::kCPU).clone());
  }
  if (build)
    for (const auto& b : module.named_buffers()) out.insert(b.key(), b.value().detach().to(at::kCPU).clone());
  return out;
}

void ShardedStateIO::load_full_model_state(torch::nn::Module& module, const c10::Dict<std::string, at::Tensor>& whole_state) {
  c10::Dict<std::string, at::Tensor> state = whole_state;
  if (to_slice_) {  // this rank's tensor-parallel slices of the whole tensors
    state = c10::Dict<std::string, at::Tensor>();
    for (const auto& e : whole_state) state.insert(e.key(), to_slice_(e.key(), e.value()));
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
        if (to_whole_) whole = to_whole_(p.name, whole);
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
  return to_whole_ ? to_whole_(p.name, whole) : whole;
}

at::Tensor ShardedStateIO::part_of_field(const at::Tensor& trained, const at::Tensor& whole) {
  const auto& p = t_.param_of(trained);
  at::Tensor field = to_slice_ ? to_slice_(p.name, whole) : whole;
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
        if (to_slice_) field = to_slice_(p.name, field);
        if (field.numel() != p.numel)
          throw ember::RunError("optimizer state '" + std::string(name) + "' of '" + p.name + "' has " + std::to_string(field.numel()) +
                                " elements, the parameter " + std::to_string(p.numel) + " (saved from another model?)");
        field = ShardTable::my_part(p, field, c_.rank()).to(p.shard.device()).clone();
      });
    }
}

// A sharded checkpoint part: this rank's real elements of every parameter and of every per-element
// optimizer state tensor, by parameter name, with the shape and chunk size that place them in the
// whole tensor; the optimizer's own serialization with those fields emptied (groups, options,
// step counts); and, in rank 0's part, the buffers.
c10::IValue ShardedStateIO::sharded_state(torch::nn::Module& module, torch::optim::Optimizer& optimizer) {
  using Dict = c10::impl::GenericDict;
  Dict part(c10::StringType::get(), c10::AnyType::get());
  part.insert("world_size", static_cast<int64_t>(c_.world()));
  part.insert("rank", static_cast<int64_t>(c_.comm.rank()));
  part.insert("stage", static_cast<int64_t>(c_.o.stage));
  // Hybrid sharding: the replicas hold the same shards, so only the first replica's ranks (the
  // run's first `world_size` ranks) save theirs; the others' parts say whose copy they hold.
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
    e.insert("data", p.shard.detach().to(at::kCPU).clone());
    params.insert(p.name, e);
  }
  part.insert("params", params);
  Dict buffers(c10::StringType::get(), c10::AnyType::get());
  if (c_.comm.rank() == 0)
    for (const auto& b : module.named_buffers()) buffers.insert(b.key(), b.value().detach().to(at::kCPU).clone());
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
  std::ostringstream out;
  torch::save(optimizer, out);
  for (auto& [field, value] : saved) *field = value;
  const std::string bytes = out.str();
  at::Tensor blob = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(blob.data_ptr(), bytes.data(), bytes.size());
  part.insert("optimizer", blob);
  part.insert("optimizer_fields", fields);
  return part;
}

// Re-sharding: each saved rank k held elements [k * c', k * c' + valid'_k) of a parameter (c' its
// saved chunk); this rank needs [r * c, r * c + valid). The overlap of the two is copied, part by
// part, so any saved world size loads onto any other.
void ShardedStateIO::load_sharded_state(torch::nn::Module& module, torch::optim::Optimizer& optimizer, int64_t saved_world,
                                        const std::function<c10::IValue(int64_t)>& read_part) {
  if (saved_world < 1) throw ember::RunError("the sharded checkpoint says it was written by " + std::to_string(saved_world) + " ranks");
  auto first = read_part(0).toGenericDict();
  // Parts 0 .. shards-1 hold one copy of the model: every part of a run that sharded over all its
  // ranks, the first replica's under hybrid sharding (the later replicas saved no tensors).
  const int64_t shards = first.contains("world_size") ? first.at("world_size").toInt() : saved_world;
  if (shards < 1 || saved_world % shards != 0)
    throw ember::RunError("the sharded checkpoint's parts say " + std::to_string(shards) + " shards of " + std::to_string(saved_world) +
                          " ranks (a damaged checkpoint?)");
  auto saved_params = first.at("params").toGenericDict();
  for (const auto& p : t_.params) {
    if (!saved_params.contains(p.name))
      throw ember::RunError("lacks parameter '" + p.name + "' (was it saved from another model?)");
    auto shape = saved_params.at(p.name).toGenericDict().at("shape").toIntVector();
    if (shape != p.shape)
      throw ember::RunError("'" + p.name + "' has shape " + c10::str(c10::IntArrayRef(shape)) + " but the model's is " +
                            c10::str(c10::IntArrayRef(p.shape)) + " (was it saved from a model with other settings?)");
  }
  // Groups, options and step counts from rank 0's serialization; per-element fields refilled below.
  {
    at::Tensor blob = first.at("optimizer").toTensor().contiguous();
    std::istringstream in(std::string(static_cast<const char*>(blob.data_ptr()), static_cast<size_t>(blob.numel())));
    optimizer.state().clear();
    torch::load(optimizer, in);
  }
  // The fields to fill, per parameter index.
  std::vector<std::vector<std::pair<std::string, at::Tensor*>>> targets(t_.params.size());
  for (auto& group : optimizer.param_groups())
    for (auto& t : group.params()) {
      auto it = optimizer.state().find(t.unsafeGetTensorImpl());
      if (it == optimizer.state().end()) continue;
      const size_t k = t_.param_of_shard.at(t.unsafeGetTensorImpl());
      for_each_state_tensor(*it->second, [&](const char* name, at::Tensor& field) {
        field = at::zeros({t_.params[k].valid}, field.options().device(t_.params[k].shard.device()));
        targets[k].emplace_back(name, &field);
      });
    }
  at::NoGradGuard no_grad;
  const int64_t rank = c_.rank();  // this rank's place among the shards (of its replica)
  for (int64_t k = 0; k < shards; ++k) {
    auto part = k == 0 ? first : read_part(k).toGenericDict();
    if (!part.contains("params"))
      throw ember::RunError("part " + std::to_string(k) + " holds no tensors (a later replica's), but the first replica's parts are 0 to " +
                            std::to_string(shards - 1) + " (a damaged checkpoint?)");
    auto sp = part.at("params").toGenericDict();
    auto sf = part.at("optimizer_fields").toGenericDict();
    for (size_t i = 0; i < t_.params.size(); ++i) {
      auto& p = t_.params[i];
      auto entry = sp.at(p.name).toGenericDict();
      const int64_t chunk = entry.at("chunk").toInt();
      const int64_t begin = k * chunk, end = std::min(p.numel, begin + chunk);
      const int64_t lo = std::max(begin, rank * p.chunk), hi = std::min(end, rank * p.chunk + p.valid);
      if (lo >= hi) continue;
      auto copy = [&](at::Tensor& dst, const at::Tensor& src, const std::string& what) {
        if (src.numel() != std::max<int64_t>(0, end - begin))
          throw ember::RunError("part " + std::to_string(k) + " holds " + std::to_string(src.numel()) + " elements of " + what +
                                ", expected " + std::to_string(std::max<int64_t>(0, end - begin)) + " (a damaged checkpoint?)");
        dst.narrow(0, lo - rank * p.chunk, hi - lo).copy_(src.narrow(0, lo - begin, hi - lo));
      };
      copy(p.shard, entry.at("data").toTensor(), "'" + p.name + "'");
      if (!targets[i].empty()) {
        if (!sf.contains(p.name)) throw ember::RunError("part " + std::to_string(k) + " has no optimizer state for '" + p.name + "'");
        auto fields = sf.at(p.name).toGenericDict();
        for (auto& [name, field] : targets[i]) {
          if (!fields.contains(name))
            throw ember::RunError("part " + std::to_string(k) + " has no optimizer state '" + name + "' for '" + p.name + "'");
          copy(*field, fields.at(name).toTensor(), "the optimizer's '" + name + "' of '" + p.name + "'");
        }
      }
    }
  }
  auto buffers = first.at("buffers").toGenericDict();
  for (auto& b : module.named_buffers()) {
    if (!buffers.contains(b.key())) throw ember::RunError("lacks buffer '" + b.key() + "' (was it saved from another model?)");
    b.value().detach().copy_(buffers.at(b.key()).toTensor());
  }
}

}  // namespace ember_shard
