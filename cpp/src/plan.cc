#include "plan.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>

#include "errors.h"

namespace datadist {
namespace {

void CheckRange(std::pair<int32_t, int32_t> r, const char *name) {
  if (r.first < -1 || r.second < -1 || r.first > r.second)
    Invalid(std::string(name) + " {" + std::to_string(r.first) + ", " + std::to_string(r.second) +
            "} is invalid: both ends must be >= -1 and first <= second");
}

}  // namespace

void CheckExtParam(const llm_datadist::KvCacheExtParam &ext, bool push) {
  CheckRange(ext.src_layer_range, "src_layer_range");
  CheckRange(ext.dst_layer_range, "dst_layer_range");
  if (ext.tensor_num_per_layer == 0) Invalid("tensor_num_per_layer must be > 0");
  auto src = ext.src_layer_range, dst = ext.dst_layer_range;
  // A push's ranges must be as wide as each other before anything else, {-1, -1} (width 0)
  // included, as CANN's PushKvCache / PushKvBlocks (CheckKvCacheExtParam with check_range_same).
  if (push && src.second - src.first != dst.second - dst.first)
    Invalid("src_layer_range {" + std::to_string(src.first) + ", " + std::to_string(src.second) +
            "} and dst_layer_range {" + std::to_string(dst.first) + ", " + std::to_string(dst.second) +
            "} differ in length");
}

void PairTensors(Plan &plan, uint32_t local_n, const llm_datadist::KvCacheExtParam &ext, bool push) {
  CheckExtParam(ext, push);
  const int64_t n = ext.tensor_num_per_layer;
  auto src = ext.src_layer_range, dst = ext.dst_layer_range;
  if (push) {
    // CANN pushes layer by layer (LayerWiseTransferJob::Prepare): a source whose tensors are
    // not whole layers is refused at its first layer, and a source range pushes to
    // dst_layer_range.first + i, which {-1, -1} puts out of range.
    if (local_n % n != 0)
      Invalid("the source's " + std::to_string(local_n) + " tensors are not layers of " + std::to_string(n));
    if (src.first >= 0 && dst.first < 0) Invalid("a push with a src_layer_range needs a dst_layer_range");
  }
  bool all = push ? src.first < 0 : (src.first < 0 || dst.first < 0);
  plan.remote_tensors.clear();
  plan.local_tensors.clear();
  plan.whole = all && !push;
  if (all) {
    for (uint32_t i = 0; i < local_n; ++i) {
      plan.remote_tensors.push_back(i);
      plan.local_tensors.push_back(i);
    }
    return;
  }
  // CANN's DataCacheEngine::CheckTensorIndices: a layer-ranged pull refuses a destination
  // whose tensors are not whole layers, as pushes do their source (above).
  if (!push && local_n % n != 0)
    Invalid("When using layer wise transfer, the tensor_num [" + std::to_string(local_n) +
            "] of caches must be a multiple of tensor_num_per_layer[" + std::to_string(n) + "].");
  if (src.second - src.first != dst.second - dst.first)
    Invalid("src_layer_range {" + std::to_string(src.first) + ", " + std::to_string(src.second) +
            "} and dst_layer_range {" + std::to_string(dst.first) + ", " + std::to_string(dst.second) +
            "} differ in length");
  auto local = push ? src : dst;
  auto remote = push ? dst : src;
  if ((static_cast<int64_t>(local.second) + 1) * n > local_n)
    Invalid("layers " + std::to_string(local.first) + ".." + std::to_string(local.second) + " of " + std::to_string(n) +
            " tensors exceed the local cache's " + std::to_string(local_n) + " tensors");
  if ((static_cast<int64_t>(remote.second) + 1) * n > (int64_t{1} << 32))
    Invalid("the remote layer range reaches past the largest tensor index");
  const int64_t count = (static_cast<int64_t>(local.second) - local.first + 1) * n;
  for (int64_t i = 0; i < count; ++i) {
    plan.remote_tensors.push_back(static_cast<uint32_t>(remote.first * n + i));
    plan.local_tensors.push_back(static_cast<uint32_t>(local.first * n + i));
  }
}

void PlanSlot(Plan &plan, const Geometry &local, uint64_t local_unit, int64_t size, uint64_t remote_offset,
              uint64_t local_offset) {
  const uint64_t stride = local.unit_bytes;
  if (local_unit >= local.units)
    Invalid("batch_index " + std::to_string(local_unit) + " out of range [0, " + std::to_string(local.units) + ")");
  if (local_offset >= stride)
    Invalid("dst offset " + std::to_string(local_offset) + " out of range [0, " + std::to_string(stride) + ")");
  const uint64_t rest = stride - local_offset;
  if (size == -1) size = static_cast<int64_t>(rest);  // a slot is < 2**63 bytes: it was registered
  if (size <= 0 || static_cast<uint64_t>(size) > rest)
    Invalid("size " + std::to_string(size) + " does not fit the destination slot of " + std::to_string(stride) +
            " bytes after offset " + std::to_string(local_offset));
  if (remote_offset > UINT64_MAX - static_cast<uint64_t>(size))
    Invalid("src offset " + std::to_string(remote_offset) + " plus size " + std::to_string(size) +
            " overflows 64 bits");
  plan.remote_offsets = {remote_offset};
  plan.local_offsets = {local_unit * stride + local_offset};
  plan.lengths = {static_cast<uint64_t>(size)};
}

namespace {

// Remote blocks 0, 1, ..., n - 1 (a pull of a remote slot split in blocks), without a list.
struct Iota {
  size_t n;
  size_t size() const { return n; }
  uint64_t operator[](size_t i) const { return i; }
};

uint64_t Largest(Blocks b) { return *std::max_element(b.begin(), b.end()); }
uint64_t Largest(Iota b) { return b.n - 1; }  // n > 0: checked before

template <class Remote>
void PlanBlockRuns(Plan &plan, const Geometry &local, const Remote &remote_blocks, Blocks local_blocks) {
  if (local_blocks.empty()) Invalid("dst_blocks must not be empty");
  if (remote_blocks.size() != local_blocks.size())
    Invalid("src_blocks has " + std::to_string(remote_blocks.size()) + " entries but dst_blocks has " +
            std::to_string(local_blocks.size()));
  const uint64_t bb = local.unit_bytes;
  const uint64_t local_max = Largest(local_blocks);
  if (local_max >= local.units)
    Invalid("dst block " + std::to_string(local_max) + " out of range: the cache has " + std::to_string(local.units) +
            " blocks");
  // A block's whole extent [b * bb, (b + 1) * bb) must fit in 64 bits: a wrapped offset names
  // another block than the one asked for.
  const uint64_t remote_max = Largest(remote_blocks);
  if (bb == 0 || remote_max > UINT64_MAX / bb - 1)
    Invalid("src block " + std::to_string(remote_max) + " is out of range: its offset (" + std::to_string(bb) +
            " bytes a block) overflows 64 bits");
  // Runs of blocks adjacent on both sides are one span. Counted first, so that each array is
  // allocated once at its size: grown by push_back, a 100k-run plan allocated (and the kernel
  // zeroed) twice its bytes, and kept up to twice the capacity it needs.
  const size_t n = local_blocks.size();
  size_t runs = 1;
  for (size_t i = 1; i < n; ++i)
    runs += remote_blocks[i] != remote_blocks[i - 1] + 1 || local_blocks[i] != local_blocks[i - 1] + 1;
  plan.remote_offsets.clear();
  plan.local_offsets.clear();
  plan.lengths.clear();
  plan.remote_offsets.reserve(runs);
  plan.local_offsets.reserve(runs);
  plan.lengths.reserve(runs);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t r = remote_blocks[i] * bb, l = local_blocks[i] * bb;
    if (!plan.lengths.empty() && plan.remote_offsets.back() + plan.lengths.back() == r &&
        plan.local_offsets.back() + plan.lengths.back() == l) {
      plan.lengths.back() += bb;
      continue;
    }
    plan.remote_offsets.push_back(r);
    plan.local_offsets.push_back(l);
    plan.lengths.push_back(bb);
  }
}

}  // namespace

void PlanBlocks(Plan &plan, const Geometry &local, Blocks remote_blocks, Blocks local_blocks) {
  PlanBlockRuns(plan, local, remote_blocks, local_blocks);
}

namespace {

// A half-open range as Python prints the tuple the original's messages show: "(0, 2)".
std::string Pair(uint64_t start, uint64_t stop) {
  return "(" + std::to_string(start) + ", " + std::to_string(stop) + ")";
}
std::string Pair(const LayerRange &r) { return Pair(r.start, r.stop); }

}  // namespace

void PairLayers(Plan &plan, uint32_t local_n, const LayerRange &src_in, const LayerRange &dst_in, int64_t n_in) {
  if (n_in <= 0) Invalid("tensor_num_per_layer must be > 0, got " + std::to_string(n_in));
  plan.remote_tensors.clear();
  plan.local_tensors.clear();
  plan.whole = !src_in.set && !dst_in.set;
  if (plan.whole) {
    plan.remote_tensors.reserve(local_n);
    for (uint32_t i = 0; i < local_n; ++i) plan.remote_tensors.push_back(i);
    plan.local_tensors = plan.remote_tensors;
    return;
  }
  const uint64_t n = static_cast<uint64_t>(n_in);
  if (local_n % n != 0)
    Invalid("destination num_tensors " + std::to_string(local_n) + " is not a multiple of tensor_num_per_layer " +
            std::to_string(n));
  for (const auto &[name, r] : {std::pair<const char *, const LayerRange &>{"src_layer_range", src_in},
                                std::pair<const char *, const LayerRange &>{"dst_layer_range", dst_in}})
    if (r.set && r.start >= r.stop) Invalid(std::string(name) + " must satisfy 0 <= start < stop, got " + Pair(r));
  const uint64_t dst_layers = local_n / n;
  LayerRange src = src_in, dst = dst_in;
  if (!dst.set) {
    // __int128: a range of up to 2**64 layers times n tensors
    const unsigned __int128 covers = static_cast<unsigned __int128>(src.stop - src.start) * n;
    if (covers != local_n)
      Invalid("src_layer_range " + Pair(src) + " covers " +
              (covers > UINT64_MAX ? std::string("more than 2**64") : std::to_string(static_cast<uint64_t>(covers))) +
              " tensors but the destination has " + std::to_string(local_n));
    dst = {true, 0, dst_layers};
  }
  if (dst.stop > dst_layers)
    Invalid("dst_layer_range " + Pair(dst) + " exceeds the destination's " + std::to_string(dst_layers) + " layers");
  const uint64_t width = dst.stop - dst.start;
  if (!src.set) src = {true, 0, width};
  if (src.stop - src.start != width)
    Invalid("src_layer_range " + Pair(src) + " and dst_layer_range " + Pair(dst) + " differ in length");
  // Tensor indices travel as u32; the owner checks them against its own count.
  if (static_cast<unsigned __int128>(src.stop) * n > (uint64_t{1} << 32))
    Invalid("src_layer_range " + Pair(src) + " reaches past the largest tensor index");
  const uint64_t count = width * n;
  plan.remote_tensors.reserve(count);
  plan.local_tensors.reserve(count);
  for (uint64_t i = 0; i < count; ++i) {
    plan.remote_tensors.push_back(static_cast<uint32_t>(src.start * n + i));
    plan.local_tensors.push_back(static_cast<uint32_t>(dst.start * n + i));
  }
}

void PlanPull(Plan &plan, const Geometry &local, const PullSpec &spec) {
  PairLayers(plan, local.num_tensors, spec.src_layers, spec.dst_layers, spec.tensor_num_per_layer);
  switch (spec.kind) {
    case PullSpec::kSlot: PlanSlot(plan, local, spec.batch_index, spec.size, spec.src_offset, spec.dst_offset); return;
    case PullSpec::kBlocks: PlanBlocks(plan, local, spec.src_blocks, spec.dst_blocks); return;
    case PullSpec::kSlotToBlocks:  // chunk i of the remote slot goes to dst_blocks[i]
      PlanBlockRuns(plan, local, Iota{spec.dst_blocks.size()}, spec.dst_blocks);
      return;
  }
  Invalid("unknown pull kind " + std::to_string(static_cast<int>(spec.kind)));
}

void CheckLocalSpans(const Plan &plan, const Geometry &local, int64_t cache_id) {
  const std::string cache = cache_id >= 0 ? "cache " + std::to_string(cache_id) : std::string("the local cache");
  if (plan.local_tensors.size() != plan.remote_tensors.size())
    Invalid("the transfer pairs " + std::to_string(plan.local_tensors.size()) + " local tensors with " +
            std::to_string(plan.remote_tensors.size()) + " remote ones");
  if (plan.local_offsets.size() != plan.lengths.size() || plan.remote_offsets.size() != plan.lengths.size())
    Invalid("the transfer's span arrays differ in length (" + std::to_string(plan.local_offsets.size()) +
            " local offsets, " + std::to_string(plan.remote_offsets.size()) + " remote offsets, " +
            std::to_string(plan.lengths.size()) + " lengths)");
  for (uint32_t t : plan.local_tensors)
    if (t >= local.num_tensors)
      Invalid("local tensor " + std::to_string(t) + " is out of range: " + cache + " has " +
              std::to_string(local.num_tensors) + " tensors");
  const uint64_t limit = local.tensor_bytes;
  for (size_t i = 0; i < plan.lengths.size(); ++i) {
    const uint64_t off = plan.local_offsets[i], len = plan.lengths[i];
    if (len == 0) Invalid("local span [" + std::to_string(off) + ", +0) is empty: spans move >= 1 byte");
    if (len > limit || off > limit - len)  // off + len <= limit, without overflow
      Invalid("local span [" + std::to_string(off) + ", +" + std::to_string(len) + ") lies outside the " +
              std::to_string(limit) + " bytes of each tensor of " + cache);
  }
}

void PlanPush(Plan &plan, const Geometry &local, const PushSpec &spec) {
  if (spec.count > (uint64_t{1} << 32) || spec.remote_first > (uint64_t{1} << 32) - spec.count ||
      spec.local_first > (uint64_t{1} << 32) - spec.count)
    Invalid("the push's tensor pairs reach past the largest tensor index");
  plan.whole = false;
  plan.remote_tensors.resize(spec.count);
  plan.local_tensors.resize(spec.count);
  for (uint64_t i = 0; i < spec.count; ++i) {
    plan.remote_tensors[i] = static_cast<uint32_t>(spec.remote_first + i);
    plan.local_tensors[i] = static_cast<uint32_t>(spec.local_first + i);
  }
  if (spec.blocks)
    PlanBlocks(plan, local, spec.dst_blocks, spec.src_blocks);
  else
    PlanSlot(plan, local, spec.batch_index, spec.size);
}

namespace {

// Every tensor i with tensor i, once both sides have as many (the copies' rule).
void EveryTensor(Plan &plan, const Geometry &src, const Geometry &dst) {
  if (src.num_tensors != dst.num_tensors)
    Invalid("src has " + std::to_string(src.num_tensors) + " tensors but dst has " + std::to_string(dst.num_tensors) +
            " tensors");
  plan.whole = false;
  plan.remote_tensors.resize(src.num_tensors);
  for (uint32_t i = 0; i < src.num_tensors; ++i) plan.remote_tensors[i] = i;
  plan.local_tensors = plan.remote_tensors;
}

}  // namespace

void PlanSlotCopy(Plan &plan, const Geometry &src, const Geometry &dst, uint64_t src_unit, uint64_t dst_unit,
                  uint64_t offset, int64_t size) {
  EveryTensor(plan, src, dst);
  if (src_unit >= src.units)
    Invalid("src_batch_index " + std::to_string(src_unit) + " out of range [0, " + std::to_string(src.units) + ")");
  if (dst_unit >= dst.units)
    Invalid("dst_batch_index " + std::to_string(dst_unit) + " out of range [0, " + std::to_string(dst.units) + ")");
  const std::pair<const char *, const Geometry *> sides[] = {{"src", &src}, {"dst", &dst}};
  for (const auto &[name, g] : sides)
    if (offset >= g->unit_bytes)
      Invalid("offset " + std::to_string(offset) + " out of range of the " + name + " batch stride " +
              std::to_string(g->unit_bytes));
  if (size == -1) size = static_cast<int64_t>(src.unit_bytes - offset);  // a slot is < 2**63 bytes
  for (const auto &[name, g] : sides)
    if (size <= 0 || static_cast<uint64_t>(size) > g->unit_bytes - offset)
      Invalid("size " + std::to_string(size) + " does not fit the " + name + " batch stride " +
              std::to_string(g->unit_bytes) + " after offset " + std::to_string(offset));
  // The source offset absolute in the tensor (slot base + offset), as the copy takes it.
  PlanSlot(plan, dst, dst_unit, size, src_unit * src.unit_bytes + offset, offset);
}

void PlanBlockCopy(Plan &plan, const Geometry &src, const Geometry &dst, const std::vector<uint64_t> &src_blocks,
                   const std::vector<uint64_t> &dst_blocks, bool same_cache) {
  EveryTensor(plan, src, dst);
  if (src.unit_bytes != dst.unit_bytes)
    Invalid("block sizes differ: the source's blocks hold " + InElements(src.unit_bytes, src.layout) +
            ", the destination's " + InElements(dst.unit_bytes, dst.layout));
  if (src_blocks.empty()) Invalid("no blocks to copy");
  const uint64_t src_max = *std::max_element(src_blocks.begin(), src_blocks.end());
  if (src_max >= src.units)
    Invalid("src block " + std::to_string(src_max) + " out of range: the cache has " + std::to_string(src.units) +
            " blocks");
  std::vector<uint64_t> d(dst_blocks);
  std::sort(d.begin(), d.end());
  if (std::adjacent_find(d.begin(), d.end()) != d.end()) Invalid("a destination block is listed more than once");
  if (same_cache) {
    std::vector<uint64_t> s(src_blocks);
    std::sort(s.begin(), s.end());
    // the smallest block in both lists (both sorted)
    for (auto i = s.begin(), j = d.begin(); i != s.end() && j != d.end();) {
      if (*i < *j) {
        ++i;
      } else if (*j < *i) {
        ++j;
      } else {
        Invalid("block " + std::to_string(*i) + " is both a source and a destination");
      }
    }
  }
  PlanBlocks(plan, dst, src_blocks, dst_blocks);
}

namespace {

// Python's coalesce (core/layout.py): spans adjacent on both sides merged, in order.
void Coalesce(Plan &plan) {
  size_t out = 0;
  for (size_t i = 0; i < plan.lengths.size(); ++i) {
    if (out > 0 && plan.remote_offsets[out - 1] + plan.lengths[out - 1] == plan.remote_offsets[i] &&
        plan.local_offsets[out - 1] + plan.lengths[out - 1] == plan.local_offsets[i]) {
      plan.lengths[out - 1] += plan.lengths[i];
      continue;
    }
    plan.remote_offsets[out] = plan.remote_offsets[i];
    plan.local_offsets[out] = plan.local_offsets[i];
    plan.lengths[out] = plan.lengths[i];
    ++out;
  }
  plan.remote_offsets.resize(out);
  plan.local_offsets.resize(out);
  plan.lengths.resize(out);
}

// Python's block_offsets (core/layout.py) for destination blocks: every block's whole extent
// [b * size, (b + 1) * size) must fit in 64 bits (a wrapped offset would name another block).
void CheckDstBlockExtent(Blocks blocks, uint64_t block_bytes) {
  if (block_bytes == 0) Invalid("dst block size must be > 0, got 0");
  if (blocks.empty()) return;
  const uint64_t top = *std::max_element(blocks.begin(), blocks.end());
  if (top > UINT64_MAX / block_bytes - 1)
    Invalid("dst block " + std::to_string(top) + " is out of range: its offset (" + std::to_string(block_bytes) +
            " bytes a block) overflows 64 bits");
}

void CheckSlot(const Geometry &view, uint64_t unit) {
  if (unit >= view.units)
    Invalid("src_batch_index " + std::to_string(unit) + " out of range [0, " + std::to_string(view.units) + ")");
}

}  // namespace

Geometry LayerPushView(const Geometry &local, bool local_blocks, LayerPushSpec::Kind kind) {
  if (kind == LayerPushSpec::kBlocks) {
    if (!local_blocks) Invalid("src_block_indices need a blocks cache source");
    return local;
  }
  Geometry view = local;
  if (local_blocks && kind == LayerPushSpec::kSlotToBlocks) {  // one slot: the whole tensor
    view.units = 1;
    view.unit_bytes = local.tensor_bytes;
  }
  return view;
}

void PlanLayerSpans(Plan &plan, const Geometry &view, const LayerPushSpec &spec) {
  plan.remote_offsets.clear();
  plan.local_offsets.clear();
  plan.lengths.clear();
  const uint64_t stride = view.unit_bytes;
  switch (spec.kind) {
    case LayerPushSpec::kSlot:
      CheckSlot(view, spec.src_unit);
      plan.remote_offsets = {0};
      plan.local_offsets = {spec.src_unit * stride};
      plan.lengths = {stride};
      return;
    case LayerPushSpec::kBlocks: {
      const auto &s = spec.src_blocks, &d = spec.dst_blocks;
      if (s.empty() || s.size() != d.size())
        Invalid("src_block_indices (" + std::to_string(s.size()) + ") and dst_block_indices (" +
                std::to_string(d.size()) + ") must be non-empty and of the same length");
      const uint64_t top = *std::max_element(s.begin(), s.end());
      if (top >= view.units)
        Invalid("src block " + std::to_string(top) + " out of range [0, " + std::to_string(view.units) + ")");
      const uint64_t dbb = spec.dst_block_bytes ? spec.dst_block_bytes : stride;
      if (dbb < stride)
        Invalid("dst_block_memory_size " + std::to_string(dbb) + " is smaller than a source block (" +
                std::to_string(stride) + " bytes)");
      CheckDstBlockExtent(d, dbb);
      plan.remote_offsets.resize(s.size());
      plan.local_offsets.resize(s.size());
      plan.lengths.assign(s.size(), stride);
      for (size_t i = 0; i < s.size(); ++i) {
        plan.remote_offsets[i] = d[i] * dbb;
        plan.local_offsets[i] = s[i] * stride;
      }
      break;
    }
    case LayerPushSpec::kSlotToBlocks: {
      CheckSlot(view, spec.src_unit);
      const auto &d = spec.dst_blocks;
      const uint64_t dbb = spec.dst_block_bytes;
      if (dbb == 0) Invalid("dst_block_memory_size must be > 0 for a transfer into blocks");
      // __int128: (n - 1) * size could wrap below the stride in 64 bits
      if (d.empty() || static_cast<unsigned __int128>(d.size() - 1) * dbb >= stride)
        Invalid(std::to_string(d.size()) + " destination blocks of " + std::to_string(dbb) +
                " bytes do not fit a source slot of " + std::to_string(stride) + " bytes");
      CheckDstBlockExtent(d, dbb);
      plan.remote_offsets.resize(d.size());
      plan.local_offsets.resize(d.size());
      plan.lengths.resize(d.size());
      const uint64_t base = spec.src_unit * stride;
      for (size_t i = 0; i < d.size(); ++i) {
        const uint64_t start = i * dbb;  // < stride: checked above
        plan.remote_offsets[i] = d[i] * dbb;
        plan.local_offsets[i] = base + start;
        plan.lengths[i] = std::min(dbb, stride - start);
      }
      break;
    }
    default: Invalid("unknown layer push kind " + std::to_string(static_cast<int>(spec.kind)));
  }
  Coalesce(plan);
}

void CheckAddressSpans(const Plan &plan, uint64_t addr) {
  const uint64_t room = UINT64_MAX - addr;
  for (size_t i = 0; i < plan.lengths.size(); ++i)
    if (plan.remote_offsets[i] > room || plan.lengths[i] > room - plan.remote_offsets[i]) {
      char hex[32];
      std::snprintf(hex, sizeof hex, "0x%llx", static_cast<unsigned long long>(addr));
      Invalid("dst address " + std::string(hex) + " plus a span offset overflows 64 bits");
    }
}

std::vector<iovec> LocalIov(const Plan &plan, const std::vector<uint64_t> &addrs) {
  std::vector<iovec> iov;
  iov.reserve(plan.local_tensors.size() * plan.lengths.size());
  for (uint32_t t : plan.local_tensors)
    for (size_t i = 0; i < plan.lengths.size(); ++i)
      iov.push_back({reinterpret_cast<void *>(addrs[t] + plan.local_offsets[i]), static_cast<size_t>(plan.lengths[i])});
  return iov;
}

}  // namespace datadist
