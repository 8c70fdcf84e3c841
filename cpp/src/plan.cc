#include "plan.h"

#include <string>

#include "errors.h"

namespace datadist {
namespace {

// An inclusive C++ range as a half-open one; `all` when it is {-1, -1}.
bool HalfOpen(std::pair<int32_t, int32_t> r, const char *name, int64_t &start, int64_t &stop) {
  if (r.first == -1 && r.second == -1) return false;
  if (r.first < 0 || r.second < r.first)
    Invalid(std::string(name) + " must be {-1, -1} or {a, b} with 0 <= a <= b, got {" + std::to_string(r.first) +
            ", " + std::to_string(r.second) + "}");
  start = r.first;
  stop = static_cast<int64_t>(r.second) + 1;
  return true;
}

}  // namespace

void PairTensors(Plan &plan, uint32_t local_n, std::pair<int32_t, int32_t> remote_range,
                 std::pair<int32_t, int32_t> local_range, uint8_t tensor_num_per_layer) {
  int64_t n = tensor_num_per_layer;
  if (n <= 0) Invalid("tensor_num_per_layer must be > 0");
  int64_t rs = 0, re = 0, ls = 0, le = 0;
  bool has_remote = HalfOpen(remote_range, "remote layer range", rs, re);
  bool has_local = HalfOpen(local_range, "local layer range", ls, le);
  plan.remote_tensors.clear();
  plan.local_tensors.clear();
  if (!has_remote && !has_local) {
    for (uint32_t i = 0; i < local_n; ++i) {
      plan.remote_tensors.push_back(i);
      plan.local_tensors.push_back(i);
    }
    return;
  }
  if (local_n % n) Invalid("local num_tensors " + std::to_string(local_n) + " is not a multiple of tensor_num_per_layer " + std::to_string(n));
  int64_t local_layers = local_n / n;
  if (!has_local) {
    if ((re - rs) * n != local_n) Invalid("the remote layer range covers another number of tensors than the local cache has");
    ls = 0;
    le = local_layers;
  }
  if (le > local_layers) Invalid("local layer range exceeds the local cache's " + std::to_string(local_layers) + " layers");
  if (!has_remote) {
    rs = 0;
    re = le - ls;
  }
  if (re - rs != le - ls) Invalid("src_layer_range and dst_layer_range differ in length");
  if (re * n > (int64_t{1} << 32)) Invalid("remote layer range reaches past the largest tensor index");
  for (int64_t i = 0; i < (le - ls) * n; ++i) {
    plan.remote_tensors.push_back(static_cast<uint32_t>(rs * n + i));
    plan.local_tensors.push_back(static_cast<uint32_t>(ls * n + i));
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
      Invalid("local block " + std::to_string(local_blocks[i]) + " out of range: the cache has " + std::to_string(local.units) + " blocks");
    if (remote_blocks[i] >= UINT64_MAX / bb) Invalid("remote block " + std::to_string(remote_blocks[i]) + " is out of range");
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

std::vector<iovec> LocalIov(const Plan &plan, const std::vector<uint64_t> &addrs) {
  std::vector<iovec> iov;
  iov.reserve(plan.local_tensors.size() * plan.lengths.size());
  for (uint32_t t : plan.local_tensors)
    for (size_t i = 0; i < plan.lengths.size(); ++i)
      iov.push_back({reinterpret_cast<void *>(addrs[t] + plan.local_offsets[i]), static_cast<size_t>(plan.lengths[i])});
  return iov;
}

}  // namespace datadist
