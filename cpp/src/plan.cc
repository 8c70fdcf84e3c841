#include "plan.h"

#include <string>

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

void PlanSlot(Plan &plan, const Geometry &local, uint64_t local_unit, int64_t size) {
  if (local_unit >= local.units)
    Invalid("batch_index " + std::to_string(local_unit) + " out of range [0, " + std::to_string(local.units) + ")");
  if (size == -1) size = static_cast<int64_t>(local.unit_bytes);
  if (size <= 0 || static_cast<uint64_t>(size) > local.unit_bytes)
    Invalid("size " + std::to_string(size) + " does not fit a slot of " + std::to_string(local.unit_bytes) + " bytes");
  plan.remote_offsets = {0};
  plan.local_offsets = {local_unit * local.unit_bytes};
  plan.lengths = {static_cast<uint64_t>(size)};
}

void PlanBlocks(Plan &plan, const Geometry &local, const std::vector<uint64_t> &remote_blocks,
                const std::vector<uint64_t> &local_blocks) {
  if (local_blocks.empty()) Invalid("block lists must not be empty");
  if (remote_blocks.size() != local_blocks.size())
    Invalid("src_blocks has " + std::to_string(remote_blocks.size()) + " entries but dst_blocks has " +
            std::to_string(local_blocks.size()));
  const uint64_t bb = local.unit_bytes;
  plan.remote_offsets.clear();
  plan.local_offsets.clear();
  plan.lengths.clear();
  for (size_t i = 0; i < local_blocks.size(); ++i) {
    if (local_blocks[i] >= local.units)
      Invalid("local block " + std::to_string(local_blocks[i]) + " out of range: the cache has " +
              std::to_string(local.units) + " blocks");
    if (remote_blocks[i] >= UINT64_MAX / bb)
      Invalid("remote block " + std::to_string(remote_blocks[i]) + " is out of range");
    uint64_t r = remote_blocks[i] * bb, l = local_blocks[i] * bb;
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

std::vector<iovec> LocalIov(const Plan &plan, const std::vector<uint64_t> &addrs) {
  std::vector<iovec> iov;
  iov.reserve(plan.local_tensors.size() * plan.lengths.size());
  for (uint32_t t : plan.local_tensors)
    for (size_t i = 0; i < plan.lengths.size(); ++i)
      iov.push_back({reinterpret_cast<void *>(addrs[t] + plan.local_offsets[i]), static_cast<size_t>(plan.lengths[i])});
  return iov;
}

}  // namespace datadist
