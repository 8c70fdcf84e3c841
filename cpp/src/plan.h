// The one planner: turning a transfer call of either face into byte spans. The C++ API
// (llm_datadist.cc) pairs tensors by CANN's rules (CheckExtParam, PairTensors) and plans its
// spans with PlanSlot / PlanBlocks; the Python face states a pull as a PullSpec (PlanPull,
// through Session::PreparePull), whose layer rules are llm_datadist's Python ones and whose
// spans are planned by the same PlanSlot / PlanBlocks. A transfer is a list of tensor pairs
// (remote, local) from the layer ranges, and a list of spans (remote offset, local offset,
// length) repeated in every tensor pair. Remote offsets are relative to the remote unit the
// key names (a batch slot, or the tensor base for blocks); the owner checks them. Local
// offsets are absolute in the local tensor and checked here. Errors are LLM_PARAM_INVALID,
// their texts the Python API's (tests/api and tests/compat check some). Pure functions:
// never block, thread-safe.
#ifndef DATADIST_CPP_PLAN_H_
#define DATADIST_CPP_PLAN_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "llm_datadist/llm_datadist.h"
#include "registry.h"

namespace datadist {

/// A read-only view of `size()` values the caller owns and keeps unchanged while the call that
/// takes the view runs (C++17 has no std::span): the Python binding's block lists are views of
/// the caller's numpy buffers, so planning a 100k-block pull copies no list. Made from a vector
/// (implicitly: every C++ caller's lists) or from a pointer and a count (View::Of). Not from a
/// braced list or a temporary vector: a spec field would outlive it.
template <class T>
class View {
 public:
  View() = default;
  View(const std::vector<T> &v) : data_(v.data()), size_(v.size()) {}  // NOLINT: implicit, as std::span
  // not from a temporary: the view would dangle
  View(const std::vector<T> &&) = delete;
  static View Of(const T *data, size_t size) { return View(Raw{}, data, size); }
  const T *begin() const { return data_; }
  const T *end() const { return data_ + size_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  const T &operator[](size_t i) const { return data_[i]; }

 private:
  struct Raw {};  // (not a pointer and a count: a braced {0, n} must not name one)
  View(Raw, const T *data, size_t size) : data_(data), size_(size) {}
  const T *data_ = nullptr;
  size_t size_ = 0;
};
using Blocks = View<uint64_t>;  // block indices, as both faces name them

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

/// One slot: `size` bytes from `remote_offset` in the remote slot (the owner checks it fits
/// there) <-> local slot `local_unit` from `local_offset`; size -1 = the rest of the local slot
/// after `local_offset`. LLM_PARAM_INVALID: the unit outside the local cache, the local offset
/// outside the slot, a size that is not -1 and not in [1, rest of the slot], a remote span
/// whose end passes 2**64 - 1.
void PlanSlot(Plan &plan, const Geometry &local, uint64_t local_unit, int64_t size, uint64_t remote_offset = 0,
              uint64_t local_offset = 0);

/// Blocks: remote block remote_blocks[i] <-> local block local_blocks[i]; runs adjacent on both
/// sides become one span. LLM_PARAM_INVALID, in this order: no local block, lists of other
/// lengths, the largest local block outside the cache, the largest remote block whose extent
/// passes 2**64 - 1 (a wrapped offset would name another block). Each of the plan's span arrays
/// is allocated once, at its size.
void PlanBlocks(Plan &plan, const Geometry &local, Blocks remote_blocks, Blocks local_blocks);
/// The same with brace-listed blocks (tests) or any vectors: their views.
inline void PlanBlocks(Plan &plan, const Geometry &local, const std::vector<uint64_t> &remote_blocks,
                       const std::vector<uint64_t> &local_blocks) {
  PlanBlocks(plan, local, Blocks(remote_blocks), Blocks(local_blocks));
}

/// A layer range as the Python face states it: half-open [start, stop); `set` false = none.
struct LayerRange {
  bool set = false;
  uint64_t start = 0, stop = 0;
};

/// A pull as the Python face states it (CacheManager / KvCacheManager pull_cache and
/// pull_blocks, their asynchronous forms): what it reads and into which local unit, with
/// llm_datadist's Python layer rules. The key, cluster and local cache travel beside it
/// (Session::PreparePull). The block lists are views of the caller's (View): alive and
/// unchanged until PlanPull returns.
struct PullSpec {
  enum Kind : uint8_t {
    kSlot = 0,          // remote slot -> local slot `batch_index` (PlanSlot, with offsets and size)
    kBlocks = 1,        // remote blocks `src_blocks` -> local blocks `dst_blocks` (PlanBlocks)
    kSlotToBlocks = 2,  // remote slot split in blocks -> local blocks `dst_blocks`
  };
  Kind kind = kSlot;
  uint64_t batch_index = 0;
  int64_t size = -1;
  uint64_t src_offset = 0, dst_offset = 0;
  Blocks src_blocks, dst_blocks;
  LayerRange src_layers, dst_layers;
  int64_t tensor_num_per_layer = 2;
};

/// A push as the Python face states it (CacheManager push_cache / push_blocks, their
/// asynchronous forms): its tensor pairs, made by the face's argument rules (llm_datadist's
/// push_tensor_pairs: remote tensor `remote_first + i` <- local tensor `local_first + i`, for i
/// < `count`), then local slot `batch_index` (`size` bytes, -1: all of it) into the remote slot
/// the key names, or local blocks `src_blocks[i]` into remote blocks `dst_blocks[i]` (views of
/// the caller's lists, as PullSpec's).
struct PushSpec {
  bool blocks = false;
  uint64_t remote_first = 0, local_first = 0, count = 0;
  uint64_t batch_index = 0;
  int64_t size = -1;
  Blocks src_blocks, dst_blocks;
};

/// The whole plan of a Python-face push against the local (source) cache's geometry: the
/// tensor pairs (LLM_PARAM_INVALID past the u32 tensor indices; the local ones are checked
/// with the spans), then PlanSlot or PlanBlocks (remote: the destination's blocks), with
/// their texts. Never blocks.
void PlanPush(Plan &plan, const Geometry &local, const PushSpec &spec);

/// Python's layer rule: pairs source and destination tensor indices. Layer i is tensors
/// [i*n, (i+1)*n). With no range on either side, every local tensor with the remote one of the
/// same index (plan.whole: the owner wants the same count); with only a source range, it must
/// cover every local tensor; with only a destination range, the same number of layers from
/// remote layer 0. LLM_PARAM_INVALID: n <= 0, a local tensor count that is not a multiple of
/// n (with a range), an empty range, a destination range past the local layers, ranges of
/// other widths, a source range past the largest u32 tensor index.
void PairLayers(Plan &plan, uint32_t local_num_tensors, const LayerRange &src, const LayerRange &dst, int64_t n);

/// The whole plan of a Python-face pull against the local cache's geometry: PairLayers, then
/// PlanSlot (kSlot), PlanBlocks (kBlocks; kSlotToBlocks as remote blocks 0, 1, ...), in the
/// Python API's order of checks. LLM_PARAM_INVALID with its texts.
void PlanPull(Plan &plan, const Geometry &local, const PullSpec &spec);

/// A local copy's plan (both faces: Python's copy_cache / copy_blocks / swap_blocks, CANN's
/// CopyKvCache / CopyKvBlocks; through Session::CopySlot / CopyBlocks). Source in the plan's
/// remote_* fields, its offsets absolute in the source tensor; destination in its local_*
/// fields; every tensor i with tensor i. The rules and texts are the Python API's
/// (tests/api/test_local_copies.py): LLM_PARAM_INVALID. Pure functions: never block.
///
/// PlanSlotCopy: slot `src_unit` of every source tensor into slot `dst_unit` of the same-index
/// destination tensor, `size` bytes from `offset` within the slot on both sides; size -1 = the
/// rest of the source slot after `offset`, which must fit the destination slot too. Refused,
/// in this order: other tensor counts, either slot index outside its cache, `offset` outside
/// either side's slot, a size that does not fit either side's slot after `offset`.
void PlanSlotCopy(Plan &plan, const Geometry &src, const Geometry &dst, uint64_t src_unit, uint64_t dst_unit,
                  uint64_t offset, int64_t size);

/// PlanBlockCopy: block `src_blocks[i]` of every source tensor into block `dst_blocks[i]` of
/// the same-index destination tensor, runs adjacent on both sides coalesced (PlanBlocks).
/// Refused, in this order: other tensor counts, other block sizes (in the caller's units), no
/// block, the largest source block outside the source, a destination block listed twice (which
/// source would win is not defined), with `same_cache` a block that is both a source and a
/// destination (the smallest such), then PlanBlocks' refusals (lists of other lengths, the
/// largest destination block outside the destination). O(n log n) in the blocks.
void PlanBlockCopy(Plan &plan, const Geometry &src, const Geometry &dst, const std::vector<uint64_t> &src_blocks,
                   const std::vector<uint64_t> &dst_blocks, bool same_cache);

/// transfer_cache_async's push of a destination's layers, as the Python face states it
/// (api/async_transfer.py; LLM-DataDist's TransferCacheJob): source layer `src_first + k` into
/// destination layer `dst_first + k` for k < `layers`, layer i being tensors [i*n, (i+1)*n),
/// each layer's tensors moved by the same spans (PlanLayerSpans). By key (`dst_addrs` empty):
/// one push per layer, remote tensor `(dst_first + k)*n + t` <- local `(src_first + k)*n + t`. By
/// raw address: one push per tensor, tensor t of layer k to `dst_addrs[k*n + t]` (remote tensor
/// 0 of the write the peer resolves, the spans' remote offsets added to the address). The block
/// lists are views of the caller's, as PullSpec's.
struct LayerPushSpec {
  enum Kind : uint8_t {
    kSlot = 0,          // local slot `src_unit` into the destination slot (or address)
    kBlocks = 1,        // local blocks `src_blocks[i]` into destination blocks `dst_blocks[i]`
    kSlotToBlocks = 2,  // local slot `src_unit` cut in `dst_block_bytes` chunks, chunk i -> dst_blocks[i]
  };
  Kind kind = kSlot;
  uint64_t src_unit = 0;
  Blocks src_blocks, dst_blocks;
  uint64_t dst_block_bytes = 0;  // kBlocks: 0 = the source's block size
  uint64_t src_first = 0, dst_first = 0, layers = 0, tensors_per_layer = 2;
  std::vector<uint64_t> dst_addrs;  // raw destination addresses, layers * n of them; empty: by key
};

/// The view of a local (source) cache a layer push takes, LLM-DataDist's (its cache_manager.cc
/// files a blocks cache as a batch of one block): a blocks cache sent without source blocks is
/// contiguous, its slots one block each (kSlot) or one slot of the whole tensor
/// (kSlotToBlocks); anything else is the cache's geometry.
Geometry LayerPushView(const Geometry &local, bool local_blocks, LayerPushSpec::Kind kind);

/// One layer's spans of a layer push against the source's view (LayerPushView), the same for
/// every layer: remote offsets relative to what the destination names (a batch slot, a tensor
/// base, an address), local ones absolute in the tensor; spans adjacent on both sides
/// coalesced. The tensor pairs are left alone. LLM_PARAM_INVALID with the Python face's texts,
/// in its order: kSlot the slot outside the view; kBlocks the lists empty or of other lengths,
/// the largest source block outside the cache, a destination block smaller than a source one,
/// the largest destination block's extent past 2**64 - 1; kSlotToBlocks the slot outside the
/// view, a zero block size, blocks that do not fit the slot (none, or one starting past its
/// end), the extent past 2**64 - 1. Never blocks.
void PlanLayerSpans(Plan &plan, const Geometry &view, const LayerPushSpec &spec);

/// LLM_PARAM_INVALID ("dst address 0x... plus a span offset overflows 64 bits") when a span of
/// `plan` moved to raw address `addr` would end past 2**64 - 1. Never blocks.
void CheckAddressSpans(const Plan &plan, uint64_t addr);

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
