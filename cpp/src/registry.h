// The registry: this process's caches (registered user memory or allocated host memory), the
// ids peers name them by (1, 2, 3, ... in registration order), and their lifetimes.
//
// Every span a peer asks for is checked here against the cache's tensors (Open); the server
// moves only what Open returned. A read or write holds a lease on the cache until its bytes
// have moved; unregistering waits (bounded) for leases, so a peer never touches memory that was
// given back. Thread-safe: one mutex guards everything; waits use a condition on it.
#ifndef DATADIST_CPP_REGISTRY_H_
#define DATADIST_CPP_REGISTRY_H_

#include <sys/uio.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "llm_datadist/llm_datadist.h"
#include "wire.h"

namespace datadist {
namespace lease {
class Fence;  // lease.h
}  // namespace lease

/// Most spans (tensors x spans per tensor) one request may name (docs/protocol.md).
constexpr uint64_t kMaxRequestSpans = 1ULL << 22;

struct Geometry {
  uint32_t num_tensors = 0;
  uint64_t tensor_bytes = 0;
  uint64_t units = 0;  // shape[0]: batch slots or blocks
  uint64_t unit_bytes = 0;
  uint64_t layout = 0;  // wire::LayoutTag(dtype, shape[1:])
};

/// Validates a CacheDesc (LLM_PARAM_INVALID) and computes its geometry.
Geometry GeometryOf(const llm_datadist::CacheDesc &desc);

struct Entry {
  int64_t id = 0;
  Geometry geo;
  llm_datadist::CacheDesc desc;
  std::vector<uint64_t> addrs;  // base of each tensor
  std::vector<std::unique_ptr<uint8_t[]>> owned;  // AllocateCache's memory; empty when registered
  int leases = 0;
  bool closing = false;
  /// Set once a reader leased the whole cache (LeaseCache); revoked and drained before the
  /// memory goes. A revoked one is replaced by a new one at the next lease.
  std::shared_ptr<lease::Fence> fence;
};

class Registry;

/// A lease on one cache: the absolute spans of one transfer. Ends (and may let an unregister
/// finish) when destroyed.
class Lease {
 public:
  Lease(Registry *reg, std::shared_ptr<Entry> entry) : reg_(reg), entry_(std::move(entry)) {}
  ~Lease();
  Lease(const Lease &) = delete;
  Lease &operator=(const Lease &) = delete;
  const Entry &entry() const { return *entry_; }
  /// The owner wants the memory back (the cache is being unregistered or deallocated):
  /// a same-host grant on it expires sooner.
  bool WantedBack() const;
  std::vector<iovec> iov;
  /// Per requested tensor, the absolute address its offsets count from (the slot's base, or
  /// the tensor's for blocks): what a same-host GRANT discloses. Empty for raw addresses.
  std::vector<uint64_t> bases;
  uint64_t nbytes = 0;

 private:
  Registry *reg_;
  std::shared_ptr<Entry> entry_;
};

class Registry {
 public:
  /// Adds a cache; returns its id. `owned` is the memory AllocateCache made (may be empty).
  int64_t Add(const llm_datadist::CacheDesc &desc, const std::vector<uint64_t> &addrs,
              std::vector<std::unique_ptr<uint8_t[]>> owned);
  /// Adds a cache described by its geometry under the id the caller chose (the Python
  /// package's engine: its own registry numbers caches and computes geometry, this one serves
  /// them to peers). LLM_PARAM_INVALID for a taken id or a bad geometry / address list.
  void AddAs(int64_t id, const Geometry &geo, const std::vector<uint64_t> &addrs);
  /// Removes a cache once no lease holds it (waits up to `wait_s`, then LLM_TIMEOUT and the
  /// cache stays). Unknown ids: no-op. `owned` says which kind the caller may remove
  /// (registered vs allocated); the other kind is LLM_PARAM_INVALID.
  void Remove(int64_t id, bool owned, double wait_s);
  /// A lease on a local cache for a local transfer (LLM_KV_CACHE_NOT_EXIST if unknown).
  std::unique_ptr<Lease> Hold(int64_t id);
  /// Owner side of a peer's READ / WRITE: resolve, bounds-check every span, lease.
  /// LLM_KV_CACHE_NOT_EXIST for an unknown cache, LLM_PARAM_INVALID for anything that does not fit.
  std::unique_ptr<Lease> Open(const wire::Request &req);
  /// Owner side of LEASE_REQUEST: the cache a kCacheId (b ignored) or kBlocksKey key names
  /// (a C++ owner resolves a model id as its cache id), its geometry and addresses, and its
  /// live fence. LLM_KV_CACHE_NOT_EXIST for an unknown cache or one being unregistered.
  wire::CacheLease LeaseCache(const wire::LeaseRequest &q);
  /// Revokes every cache's lease fence (the server stopped) and waits up to `wait_s` for
  /// the leased copies in flight. Returns how many fences are still held.
  int RevokeLeases(double wait_s);
  /// Drops everything (Finalize); waits up to `wait_s` for leases. Returns how many remain leased.
  int Clear(double wait_s);

 private:
  friend class Lease;
  void Release(Entry *e);
  bool Closing(const Entry *e);
  std::unique_ptr<Lease> OpenAddresses(const wire::Request &req);
  /// Revokes `e`'s fence and waits (mu_ held by `lock`) until no transfer holds it and no
  /// leased copy is in flight, or the deadline passes (false).
  bool Drain(std::unique_lock<std::mutex> &lock, Entry &e, std::chrono::steady_clock::time_point deadline);
  std::mutex mu_;
  std::condition_variable changed_;
  int64_t next_id_ = 1;
  std::map<int64_t, std::shared_ptr<Entry>> by_id_;
};

/// Every check of a READ / WRITE by cache id (kind 2: slot `b`) or BlocksCacheKey (kind 3)
/// against the geometry of the cache `id` it names, in the owner's order (docs/protocol.md,
/// "Spans"): tensor indexes, the span cap, repeated tensors, block size or batch index, span
/// bounds, layouts. Returns the byte offset of the unit the offsets count from (0 for
/// blocks). LLM_PARAM_INVALID. Used by the owner (Registry::Open) and by a reader holding a
/// lease on the whole cache (lease.h), so both refuse exactly the same requests.
uint64_t CheckRequest(const Geometry &g, uint64_t id, const wire::Request &req);

/// Every span [offset, offset + length) must lie in [0, limit) (overflow-safe).
void CheckSpans(const std::vector<uint64_t> &offsets, const std::vector<uint64_t> &lengths, uint64_t limit);

}  // namespace datadist

#endif  // DATADIST_CPP_REGISTRY_H_
