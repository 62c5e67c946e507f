#include "parameter_gather.h"

#include <ATen/ATen.h>

namespace ember_shard {

void ParameterGather::start_gather(size_t g) {
  auto& grp = t_.groups[g];
  if (grp.gather_pending) return;
  at::NoGradGuard no_grad;
  const auto& first = t_.params[grp.params.front()];
  // In the parameters' dtype and on their device (offload: host masters go in compute dtype).
  const auto options = first.param.options().requires_grad(false);
  ++c_.stats.gathers;
  grp.gather_pending = true;
  if (c_.world() == 1) {
    grp.gather_out = at::empty({grp.row}, options);
    if (c_.o.offload && c_.copies.async()) {
      // Converted to the compute dtype on the host, then one asynchronous copy per group.
      grp.gather_in = at::empty({grp.row}, first.shard.options().dtype(options.dtype()).pinned_memory(c_.copies.pinned()));
      for (size_t k : grp.params) grp.gather_in.narrow(0, t_.params[k].offset, t_.params[k].valid).copy_(t_.params[k].shard.detach());
      grp.copied = c_.copies.to_device(grp.gather_out, grp.gather_in);
    } else {
      for (size_t k : grp.params) grp.gather_out.narrow(0, t_.params[k].offset, t_.params[k].valid).copy_(t_.params[k].shard.detach());
    }
    return;
  }
  grp.gather_in = at::zeros({grp.row}, options);
  for (size_t k : grp.params) {
    const auto& p = t_.params[k];
    if (p.valid > 0) grp.gather_in.narrow(0, p.offset, p.valid).copy_(p.shard.detach());
  }
  grp.gather_out = at::empty({grp.row * c_.world()}, grp.gather_in.options());
  c_.comm.label("all-gather of " + grp.name);
  grp.gather_work = c_.backend()._allgather_base(grp.gather_out, grp.gather_in);
}

at::Tensor ParameterGather::whole_from_gather(const ShardGroup& grp, const ShardedParam& p) const {
  return grp.gather_out.view({c_.world(), grp.row}).narrow(1, p.offset, p.chunk).reshape({-1}).narrow(0, 0, p.numel).view(p.shape);
}

void ParameterGather::wait_gather(ShardGroup& grp) {
  if (grp.gather_work) grp.gather_work->wait();
  c_.copies.use_on_device(grp.copied);
  grp.gather_work.reset();
  grp.copied.reset();
  grp.gather_pending = false;
}

void ParameterGather::finish_gather(size_t g) {
  auto& grp = t_.groups[g];
  wait_gather(grp);
  at::NoGradGuard no_grad;
  for (size_t k : grp.params) {
    auto& p = t_.params[k];
    if (c_.o.stage == 3) allocate_storage(p.param);
    unversioned_view(p.param).copy_(whole_from_gather(grp, p));
  }
  grp.gather_in = grp.gather_out = at::Tensor();
  grp.materialized = true;
}

void ParameterGather::materialize(size_t g) {
  if (t_.groups[g].materialized) return;
  start_gather(g);
  finish_gather(g);
}

void ParameterGather::prefetch_unit(int64_t unit) {
  const size_t g = t_.group_of_unit(unit);
  if (g == kNone || t_.groups[g].materialized || t_.groups[g].gather_pending) return;
  start_gather(g);
  ++c_.stats.prefetched;
}

void ParameterGather::release(size_t g) {
  auto& grp = t_.groups[g];
  if (c_.o.stage < 3) return;
  if (grp.gather_pending) {  // a prefetch nobody used: it still has to complete
    wait_gather(grp);
    grp.gather_in = grp.gather_out = at::Tensor();
  }
  if (!grp.materialized) return;
  for (size_t k : grp.params) free_storage(t_.params[k].param);
  grp.materialized = false;
}

void ParameterGather::release_all() {
  for (size_t g = 0; g < t_.groups.size(); ++g) release(g);
}

void ParameterGather::gather_all_into_parameters() {
  if (shard_is_parameter()) return;
  if (c_.world() == 1) {  // one group's buffer at a time: no second copy of the whole model
    for (size_t g = 0; g < t_.groups.size(); ++g) {
      t_.groups[g].materialized = false;
      materialize(g);
    }
    return;
  }
  for (size_t g = 0; g < t_.groups.size(); ++g) {
    t_.groups[g].materialized = false;
    start_gather(g);
  }
  for (size_t g = 0; g < t_.groups.size(); ++g) finish_gather(g);
}

}  // namespace ember_shard
