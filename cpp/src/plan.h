// Turning a C++ API call into byte spans (the counterpart of Python's core/layout.py).
// A transfer is a list of tensor pairs (remote, local) from the layer ranges, and a list of
// spans (remote offset, local offset, length) repeated in every tensor pair. Remote offsets
// are relative to the remote unit the key names (a batch slot, or the tensor base for blocks);
// the owner checks them. Local offsets are absolute in the local tensor and checked here.
// Errors are LLM_PARAM_INVALID.
#ifndef DATADIST_CPP_PLAN_H_
#define DATADIST_CPP_PLAN_H_

#include <cstdint>
#include <vector>

#include "llm_datadist/llm_datadist.h"
#include "registry.h"

namespace datadist {

struct Plan {
  std::vector<uint32_t> remote_tensors, local_tensors;
  std::vector<uint64_t> remote_offsets, local_offsets, lengths;
  bool whole = false;  // a pull of every tensor (no layer range): the source must have as many
};

/// Pairs remote and local tensor indices from KvCacheExtParam's inclusive layer ranges, as
/// CANN: each range must be {-1, -1}-like (first, second >= -1, first <= second) and
/// tensor_num_per_layer > 0, else LLM_PARAM_INVALID. A pull moves every tensor (i <-> i) unless
/// both ranges start at >= 0 (plan.whole: the owner then wants the same tensor count); a push
/// moves every tensor unless the source range does, which then needs a destination range, and
/// its source must be whole layers of tensor_num_per_layer. Explicit ranges must have the same
/// width and fit the local cache; the owner checks its side.
/// CANN's CheckKvCacheExtParam (src/llm_datadist/llm_datadist.cc): both layer ranges
/// {-1, -1} or 0 <= first <= second, tensor_num_per_layer > 0 and, for a push, two ranges as
/// wide as each other. LLM_PARAM_INVALID otherwise. The calls make it before they look up
/// the local cache, as there; PairTensors repeats it.
void CheckExtParam(const llm_datadist::KvCacheExtParam &ext, bool push);
void PairTensors(Plan &plan, uint32_t local_num_tensors, const llm_datadist::KvCacheExtParam &ext, bool push);

/// One slot: remote slot (relative offset 0) <-> local slot `local_unit`; size -1 = the whole slot.
void PlanSlot(Plan &plan, const Geometry &local, uint64_t local_unit, int64_t size);

/// Blocks: remote block remote_blocks[i] <-> local block local_blocks[i]; runs adjacent on both
/// sides become one span.
void PlanBlocks(Plan &plan, const Geometry &local, const std::vector<uint64_t> &remote_blocks,
                const std::vector<uint64_t> &local_blocks);

/// The one check of a transfer's local side, both faces' (Session::Prepare for the Python
/// binding's, Session::Transfer for the C++ API's): the plan's arrays agree in length (tensor
/// pairs; spans), every local tensor index is below `local.num_tensors`, and every local span
/// [offset, offset + length) is at least one byte long and lies inside a tensor's
/// `local.tensor_bytes` (compared overflow-safe). LLM_PARAM_INVALID naming the first that does
/// not fit and cache `cache_id`. O(tensors + spans); never blocks.
void CheckLocalSpans(const Plan &plan, const Geometry &local, int64_t cache_id);

/// The local spans, absolute, tensor-major (the order the wire moves them in). The plan must
/// have passed CheckLocalSpans against the cache `addrs` are the tensors of.
std::vector<iovec> LocalIov(const Plan &plan, const std::vector<uint64_t> &addrs);

}  // namespace datadist

#endif  // DATADIST_CPP_PLAN_H_
