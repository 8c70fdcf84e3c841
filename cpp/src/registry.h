// The registry: this process's caches (registered user memory or allocated host memory), the
// ids peers name them by, the keys bound to them, and their lifetimes. The only one: both faces
// file their caches here and ask it, and nothing keeps a copy.
//
// Every span a peer asks for is checked here against the cache's tensors (Open); the server
// moves only what Open returned. A read or write holds a lease on the cache until its bytes
// have moved, and so does a local transfer (Hold: a pull's destination, a push's or a local
// copy's source); unregistering waits (bounded) for leases, so neither a peer nor a local
// transfer ever touches memory that was given back. Thread-safe: one mutex guards the state;
// waits use a condition on it. The hooks (NIXL's registrations and leases, the CUDA query that
// says what memory a cache is in) run outside that mutex, in the order the changes were made
// (a second mutex orders them): a slow registration never stalls a peer's Open.
//
// Two embedders. The C++ API (llm_datadist.cc) files caches with Add (ids 1, 2, 3), binds no
// keys and resolves a BlocksCacheKey's model id as the cache id. The Python package
// (datadist.core.native) files them with File: the ids, its CacheKeys (key i -> slot i) and its
// BlocksCacheKey model ids are the registry's (SetModelMap(true): a model id names the cache
// bound to it); it asks Info for what it plans with, Bound and CheckKeys before it allocates,
// Hold for its local transfers. Its pools are here too (SetPool, Allocate: pool.h): the registry
// carves a pool cache's memory and gives its pages back itself once nothing holds the cache (no
// id, key, transfer or leased copy; Release). A read through a CacheKey consumes it here.
#ifndef DATADIST_CPP_REGISTRY_H_
#define DATADIST_CPP_REGISTRY_H_

#include <sys/uio.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "llm_datadist/llm_datadist.h"
#include "wire.h"

namespace datadist {
namespace lease {
class Fence;  // lease.h
}  // namespace lease
class Pool;  // pool.h

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

/// `bytes` in the caller's units for messages: "4096 DT_FLOAT16 elements (8192 bytes)" where
/// `layout`'s tag names a sized type that divides them, else "8192 bytes" (Python:
/// core/dtypes.py in_elements). Never blocks.
std::string InElements(uint64_t bytes, uint64_t layout);

/// A local CacheKey (Python's keys.KeyId): a req_id or a prefix_id within a model_id.
/// Cluster ids are not part of it.
struct KeyId {
  uint64_t value = 0;
  uint64_t model_id = 0;
  bool is_prefix = false;
  bool operator<(const KeyId &o) const {
    return value != o.value         ? value < o.value
           : model_id != o.model_id ? model_id < o.model_id
                                    : is_prefix < o.is_prefix;
  }
  bool operator==(const KeyId &o) const {
    return value == o.value && model_id == o.model_id && is_prefix == o.is_prefix;
  }
};

/// The key a CacheKey's fields name (Python's keys.key_id): its req_id unless that is
/// UINT64_MAX, else its prefix_id; false for the padding key (both UINT64_MAX). On the wire a
/// CacheKey is kind 1 with a = req_id, b = model_id, c = prefix_id.
bool KeyOf(uint64_t req_id, uint64_t prefix_id, uint64_t model_id, KeyId *key);

/// What the Python package says of a cache it files (Registry::File).
struct CacheOptions {
  /// Allocated from a pool (Python's CacheEntry.owned): a successful read through a req_id key
  /// consumes it; Deallocate applies. False: registered user memory (keys never consumed).
  bool allocated = false;
  /// register_*_cache(remote_accessible=False): peers may not READ, WRITE or lease it.
  bool remote_accessible = true;
  /// A blocks (paged) cache: what a CACHE_LEASE says (is_blocks).
  bool blocks = false;
  /// DEVICE placement (Python's CacheEntry.placement, the C++ API's CachePlacement::kDevice):
  /// NIXL asks CUDA whether its memory is a GPU's (nixl.h, MemoryKind) and registers it as
  /// VRAM if so; host placement is always DRAM.
  bool device = false;
};

/// Where each tensor of a cache lies in shareable memory (a sealed memfd of this process,
/// shm.h): its descriptor, inode and the tensor's offset in it; all empty when it does not.
/// Same-host readers asking for SHM get these (SHM_GRANT, CACHE_LEASE) instead of addresses
/// to read with cross-memory attach. The descriptors must stay open while the cache is filed.
struct ShmPlace {
  std::vector<int32_t> fds;
  std::vector<uint64_t> inos, offsets;
  bool shareable() const { return !fds.empty(); }
};

struct Entry {
  int64_t id = 0;
  Geometry geo;
  llm_datadist::CacheDesc desc;
  std::vector<uint64_t> addrs;                    // base of each tensor
  std::vector<std::unique_ptr<uint8_t[]>> owned;  // AllocateCache's memory; empty when registered
  std::shared_ptr<void> region;                   // AllocateCache's shared memory (shm::Region), or null
  CacheOptions opts;
  ShmPlace shm;
  int leases = 0;
  bool closing = false;
  bool id_held = true;     // filed under its id (false once deallocated: keys may still hold it)
  std::set<KeyId> keys;    // the keys bound to it
  bool has_model = false;  // bound to blocks_model (BindModel)
  uint64_t blocks_model = 0;
  /// Set once a reader leased the whole cache (LeaseCache); revoked and drained before the
  /// memory goes. A revoked one is replaced by a new one at the next lease.
  std::shared_ptr<lease::Fence> fence;
  /// Revoked fences a new one replaced (the cache was leased again while a copy under the old
  /// one may still run): those copies must end too before the memory goes. Dropped once drained.
  std::vector<std::shared_ptr<lease::Fence>> old_fences;
};

/// A CacheKey bound to one slot of a cache: which tensors were pulled through it (for
/// consumption) and which a read in flight reserved.
struct Binding {
  std::shared_ptr<Entry> entry;
  uint64_t slot = 0;
  std::vector<bool> pulled, reserved;  // per tensor
};

class Registry;

/// A lease on one cache: the absolute spans of one transfer. Pins the memory until Unpin or
/// destruction (which may let an unregister finish). A read through a consumable CacheKey
/// also holds a reservation of the tensors it names until Settle (destruction settles it as
/// failed).
class Lease {
 public:
  Lease(Registry *reg, std::shared_ptr<Entry> entry) : reg_(reg), entry_(std::move(entry)) {}
  ~Lease();
  Lease(const Lease &) = delete;
  Lease &operator=(const Lease &) = delete;
  const Entry &entry() const { return *entry_; }
  /// The owner wants the memory back (the cache is being unregistered, or deallocated with no
  /// key holding it): a same-host grant on it expires sooner.
  bool WantedBack() const;
  /// The server's verdict on a read: ok once its bytes were sent
  /// (a GRANT: when RELEASE says ok). ok commits the reservation: the tensors count as pulled
  /// and, once every tensor of the slot is, the req_id key is unbound (consumed: Bound says
  /// false, and a deallocated cache it held may be released). Not ok drops the reservation. Only the first call counts;
  /// a lease without a reservation (writes, cache ids, prefix keys, registered memory) ignores it without locking.
  /// Called by the thread that serves the request (a Lease is used by one thread at a time); takes the registry's mutex
  /// when there is a reservation, never blocks otherwise.
  void Settle(bool ok);
  /// The transfer no longer touches the memory but its verdict is
  /// still to come: the reservation stays until Settle. Idempotent; the destructor does it too.
  void Unpin();
  /// The absolute spans, tensor-major, expanded (one per tensor x span): filled only when the
  /// opener asked (Open's `expand`); else read them a part at a time (Span, Expand), so that a
  /// request of 4M expanded spans costs the owner its frame's size, not 16 bytes per expanded
  /// span (64 MiB) for as long as its reader takes.
  std::vector<iovec> iov;
  /// How many spans the transfer has (expanded: tensors x spans), whether or not `iov` holds them.
  size_t spans() const { return span_bases_.size() * span_offsets_.size(); }
  /// Span `k` (k < spans()) as `iov[k]` would hold it.
  iovec Span(size_t k) const {
    const size_t per = span_offsets_.size();
    return {reinterpret_cast<void *>(span_bases_[k / per] + span_offsets_[k % per]),
            static_cast<size_t>(span_lengths_[k % per])};
  }
  /// Appends spans [from, from + n) to `out` (n clipped to spans()).
  void Expand(size_t from, size_t n, std::vector<iovec> &out) const {
    for (size_t k = from, end = std::min(spans(), from + n); k < end; ++k) out.push_back(Span(k));
  }
  /// Per requested tensor, the absolute address its offsets count from (the slot's base, or
  /// the tensor's for blocks): what a same-host GRANT discloses. Empty for raw addresses.
  std::vector<uint64_t> bases;
  uint64_t nbytes = 0;

 private:
  friend class Registry;
  Registry *reg_;
  std::shared_ptr<Entry> entry_;
  bool pinned_ = true;  // counted in entry_->leases
  // A consuming read's reservation (Registry::Open): its binding, key and tensors.
  std::shared_ptr<Binding> binding_;
  KeyId key_;
  std::vector<uint32_t> tensors_;
  bool reserved_ = false;
  // The spans as the request gave them (Span): per tensor its absolute base, the offsets from
  // it and the lengths (raw addresses: one base, 0).
  std::vector<uint64_t> span_bases_, span_offsets_, span_lengths_;
};

/// What else must know of a cache's life (NIXL's registrations and leases, nixl.h). Each is
/// called without the registry's mutex, by the thread that made the change, after it (`added`)
/// or before the wait for its leases (`going`), one hook at a time and in the order of the
/// changes (the registry's hook mutex is held): a hook may block (a NIXL registration, a CUDA
/// query) without stalling Open, Hold or a lease's end, and may call the registry's state
/// calls (Open, Hold, Info, ...) but none that runs a hook (Add, File, Allocate, Remove,
/// Deallocate, Release, Released, UnbindKey, BindModel, UnbindModel, Clear, ForEach, SetHooks:
/// they would wait for it).
struct RegistryHooks {
  std::function<void(const Entry &)> added;  // a cache was filed
  /// The memory of `e` is wanted back (unregister, deallocate, its model id bound to another
  /// cache, Clear: null, every cache): leases held outside the registry are revoked now.
  std::function<void(const Entry *e)> going;
  std::function<void(const Entry &)> gone;  // no longer filed, nothing holds it: its memory may go
};

class Registry {
 public:
  /// Sets (or, with {}, clears) the hooks. Not blocking.
  void SetHooks(RegistryHooks hooks);
  /// `each` for every filed cache not being unregistered, then `then`, all under the hook mutex
  /// (no hook runs meanwhile: a cache filed or gone meanwhile has its hook called after
  /// `then`), not the registry's: the same rules as the hooks. Blocks while a hook runs.
  void ForEach(const std::function<void(const Entry &)> &each, const std::function<void()> &then);
  /// The C++ API's AllocateCache / RegisterKvCache: adds a cache under the next free id and
  /// returns it. `owned` is the memory AllocateCache made (may be empty), or `region` (the
  /// shared memory it made, held until the cache goes) with `shm` saying where each tensor
  /// lies in it. Not blocking.
  int64_t Add(const llm_datadist::CacheDesc &desc, const std::vector<uint64_t> &addrs,
              std::vector<std::unique_ptr<uint8_t[]>> owned, std::shared_ptr<void> region = nullptr,
              const ShmPlace &shm = {});
  /// Files a cache whose memory the caller keeps under the id `id` (> 0), with `opts` (tests,
  /// and embedders that number their caches). LLM_PARAM_INVALID for an id <= 0 or one in use
  /// (by a cache, or a deallocated one not yet released), and as the other Add for a bad
  /// desc or addresses. Blocks while the `added` hook runs.
  void Add(int64_t id, const llm_datadist::CacheDesc &desc, const std::vector<uint64_t> &addrs,
           const CacheOptions &opts);
  /// The same, for a cache described by its geometry (the Python package computes it; its
  /// dtype and shape are not needed to serve it). LLM_PARAM_INVALID for a geometry whose
  /// bytes do not split into its units, or addresses that are zero or wrap. Not blocking.
  /// `shm`: where its tensors lie in our shareable memory (none by default).
  void AddAs(int64_t id, const Geometry &geo, const std::vector<uint64_t> &addrs, const CacheOptions &opts,
             const ShmPlace &shm = {});
  /// The Python package's register / allocate (datadist.core.native): files a cache described
  /// by its geometry under the next free id and returns it, with its keys (`keys[i]` bound to
  /// slot `slots[i]`, checked as CheckKeys) and, when `model` is set, its BlocksCacheKey model
  /// id (as BindModel); all or nothing. LLM_PARAM_INVALID as AddAs and CheckKeys. Blocks while
  /// the hooks run (NIXL registers the cache; `model` may revoke the leases of the cache it
  /// named before), never under the registry's mutex.
  /// `region`: memory the entry keeps until it goes (a pool allocation: its pages go back then).
  int64_t File(const Geometry &geo, const std::vector<uint64_t> &addrs, const CacheOptions &opts, const ShmPlace &shm,
               const std::vector<KeyId> &keys, const std::vector<uint64_t> &slots, std::optional<uint64_t> model,
               std::shared_ptr<void> region = nullptr);
  /// The pool DEVICE (`device`) or HOST caches are allocated from (null: none), set by the
  /// embedder before it allocates (mem_pool_cfg, host_mem_pool_cfg); Clear drops both. Not
  /// blocking.
  void SetPool(bool device, std::shared_ptr<Pool> pool);
  std::shared_ptr<Pool> PoolOf(bool device);
  /// allocate_cache / allocate_blocks_cache: what nothing holds any more is released first
  /// (Release), the keys are checked (CheckKeys: a bad key is LLM_PARAM_INVALID, never an
  /// out-of-memory), the tensors carved from the pool of `device` (Pool::AllocateTensors, each
  /// on a page) and filed as File files them, `opts.allocated` set and its memfd told to
  /// same-host readers (ShmPlace); all or nothing. LLM_PARAM_INVALID without a pool for the
  /// placement; LLM_OUT_OF_MEMORY when the pool has no free run large enough. Blocks while the
  /// hooks run (NIXL registers the cache).
  int64_t Allocate(bool device, const Geometry &geo, CacheOptions opts, const std::vector<KeyId> &keys,
                   const std::vector<uint64_t> &slots, std::optional<uint64_t> model);
  /// The key rules of a filing, checked before the caller allocates memory for it (so a bad
  /// key is LLM_PARAM_INVALID, never an out-of-memory): every slot below `units`, no key given
  /// twice, none bound already. Not blocking.
  void CheckKeys(const std::vector<KeyId> &keys, const std::vector<uint64_t> &slots, uint64_t units);
  /// Whether `key` is bound to a cache now (false once a read consumed it). Not blocking.
  bool Bound(const KeyId &key);
  /// What a cache filed under `id` is (a copy, taken under the mutex): what the Python face
  /// plans with. LLM_KV_CACHE_NOT_EXIST for an unknown id (deallocated and unregistered ones
  /// included). Not blocking.
  struct Info {
    int64_t id = 0;
    Geometry geo;
    std::vector<uint64_t> addrs;
    CacheOptions opts;
    int leases = 0;  // transfers holding it now (peers', and Hold's)
  };
  Info Describe(int64_t id);
  /// Whether a cache is filed under `id` and not being unregistered: what a plan made for it
  /// needs (ids are never reused, a filed cache's geometry never changes). Not blocking.
  bool Filed(int64_t id);
  /// The ids filed now, ascending (tools and tests). Not blocking.
  std::vector<int64_t> Ids();
  /// Removes a cache once no lease holds it (waits up to `wait_s`, then LLM_TIMEOUT and the
  /// cache stays), with its keys and model id. Unknown ids: no-op. `owned` says which kind the caller may remove
  /// (memory this registry allocated vs not); the other kind is LLM_PARAM_INVALID. Blocks up to `wait_s`.
  void Remove(int64_t id, bool owned, double wait_s);
  /// The Python package's deallocate: the id no longer names the cache and its whole-cache
  /// leases are revoked; its keys (dropped too with `drop_keys`, as the facade asks for
  /// blocks caches, with the model id) keep serving it until they are consumed or unbound.
  /// Its memory goes at once when nothing holds it (Release). Unknown ids and caches not
  /// added as `allocated`: no-op. Blocks while the `going` and `gone` hooks run.
  void Deallocate(int64_t id, bool drop_keys);
  /// Releases the deallocated caches nothing holds any more (no key, no lease, no leased copy
  /// in flight): runs the `gone` hook of each (NIXL deregisters it), then drops them, so that
  /// the memory they keep (a pool allocation) goes back; each id becomes free for Add again.
  /// The registry calls it itself after Deallocate and UnbindKey and before Allocate; what a
  /// peer's read (the last key consumed) or a lease's end left releasable goes at the next of
  /// those (the fences of leased caches are polled here). Blocks while the hooks run.
  void Release();
  /// The ids Release freed since the last call, oldest first (at most the last 4096): tests
  /// and tools; it runs Release first. Blocks while the hooks run.
  std::vector<int64_t> Released();

  /// Binds `keys[i]` to slot `slots[i]` of cache `cache_id`, all or none: LLM_KV_CACHE_NOT_EXIST for an unknown cache;
  /// LLM_PARAM_INVALID for a slot out of range, a key given twice, or one already bound. Not
  /// blocking.
  void BindKeys(int64_t cache_id, const std::vector<KeyId> &keys, const std::vector<uint64_t> &slots);
  /// remove_cache_key: unbinds a key of an allocated cache; a deallocated cache it alone held
  /// is released (Release). Unknown keys and keys on registered memory: no-op (as the
  /// original). Blocks only while the `gone` hook runs.
  void UnbindKey(const KeyId &key);
  /// Model-map mode (the native engine turns it on before it adds caches): a BlocksCacheKey
  /// names the cache bound to its model id (BindModel) and nothing else. Off (the C++ API's
  /// rule): its model id is the cache id.
  void SetModelMap(bool on);
  /// register_blocks_cache / allocate_blocks_cache with a BlocksCacheKey: `model_id` names
  /// cache `cache_id` from now on; the last binding wins, and whole-cache leases taken through
  /// the model id on the cache it named before are revoked. LLM_KV_CACHE_NOT_EXIST for an
  /// unknown cache. Blocks while the `going` hook runs.
  void BindModel(uint64_t model_id, int64_t cache_id);
  /// Unbinds `model_id` (no-op when unbound), revoking leases taken through it. Blocks while
  /// the `going` hook runs.
  void UnbindModel(uint64_t model_id);
  /// EngineConfig.remote_cache_accessible (default true). False: peers' WRITEs and write
  /// leases by CacheKey, cache id or BlocksCacheKey are refused (LLM_PARAM_INVALID);
  /// writes by raw address (kind 4) stay allowed.
  void SetRemoteWrites(bool allowed);
  bool remote_writes() const { return remote_writes_; }

  /// A lease on a local cache for a local transfer (LLM_KV_CACHE_NOT_EXIST if unknown or being
  /// unregistered): Remove waits for it. Not blocking.
  std::unique_ptr<Lease> Hold(int64_t id);
  /// Owner side of a peer's READ: resolve, check
  /// servable, bounds-check every span, lease; a read through a req_id key of an allocated
  /// cache also reserves the tensors it names until Lease::Settle. LLM_KV_CACHE_NOT_EXIST for
  /// an unknown key or cache, one being unregistered, or tensors another read of that key
  /// reserved; LLM_PARAM_INVALID for a cache that is not remote accessible and anything that
  /// does not fit. Called on the server's threads; takes the mutex only.
  /// `expand`: fill the lease's `iov` (else the caller reads its spans with Lease::Span).
  std::unique_ptr<Lease> Open(const wire::Request &req, bool expand = true);
  /// Owner side of a peer's WRITE: as Open, never reserving or consuming, and refused
  /// (LLM_PARAM_INVALID) by key or cache id when SetRemoteWrites(false).
  std::unique_ptr<Lease> OpenWrite(const wire::Request &req, bool expand = true);
  /// Owner side of LEASE_REQUEST (write leases refused as OpenWrite refuses writes): the cache a kCacheId (b ignored)
  /// or kBlocksKey key names (resolved as Open does), its geometry and addresses, its memfds (ShmPlace) when the
  /// request has kFlagShm, is not a write and the cache is shareable, and its live fence. LLM_KV_CACHE_NOT_EXIST for an
  /// unknown cache or one being unregistered; LLM_PARAM_INVALID for one not remote accessible, or a write lease
  /// (kLeaseWrite) when SetRemoteWrites(false).
  wire::CacheLease LeaseCache(const wire::LeaseRequest &q);
  /// Revokes every cache's lease fence (the server stopped) and waits up to `wait_s` for
  /// the leased copies in flight. Returns how many fences are still held.
  int RevokeLeases(double wait_s);
  /// Drops everything (Finalize): caches, keys, model ids; waits up to `wait_s` for leases.
  /// Returns how many remain leased: those are kept (their memory, when this registry holds
  /// it, is never freed under a copy in flight: leaked at worst), and the embedder must keep
  /// the memory it gave mapped.
  int Clear(double wait_s);
  /// Waits up to `wait_s` for the caches Clear gave up on (a transfer still held them) and
  /// returns how many still are held: the Python face clears without waiting, lets go of its
  /// own asynchronous transfers' holds, then waits here. Blocks up to `wait_s`.
  int AwaitStuck(double wait_s);
  Registry() = default;
  Registry(const Registry &) = delete;
  Registry &operator=(const Registry &) = delete;
  ~Registry();

 private:
  friend class Lease;
  /// A checked entry, not filed yet (LLM_PARAM_INVALID for bad addresses or shm).
  static std::shared_ptr<Entry> Make(const Geometry &g, const llm_datadist::CacheDesc *desc,
                                     const std::vector<uint64_t> &addrs, const CacheOptions &opts, const ShmPlace &shm);
  void Insert(int64_t id, const Geometry &g, const llm_datadist::CacheDesc *desc, const std::vector<uint64_t> &addrs,
              const CacheOptions &opts, const ShmPlace &shm = {});
  void CheckKeysLocked(const std::vector<KeyId> &keys, const std::vector<uint64_t> &slots, uint64_t units,
                       const std::string &cache);
  void BindKeysLocked(const std::shared_ptr<Entry> &e, const std::vector<KeyId> &keys,
                      const std::vector<uint64_t> &slots);
  /// Binds `model_id` to `e`; returns the cache it named before (whose leases must be revoked:
  /// its fence is revoked here, the `going` hook is the caller's, outside the mutex), or null.
  std::shared_ptr<Entry> BindModelLocked(uint64_t model_id, const std::shared_ptr<Entry> &e);
  /// Runs a hook under hooks_mu_ (taken here: never call with mu_ held).
  void Going(const Entry *e);
  void End(Lease *l);
  void SettleLocked(Lease *l, bool ok);
  void UnpinLocked(Lease *l);
  bool Closing(const Entry *e);
  std::unique_ptr<Lease> OpenChecked(const wire::Request &req, bool read, bool expand);
  std::unique_ptr<Lease> OpenAddresses(const wire::Request &req, bool expand);
  /// Checks `req` against `e` (block addressing or slot `slot`) and leases it; a non-null
  /// `reserve` reserves the tensors of that binding of `key`. Lock held.
  std::unique_ptr<Lease> LeaseLocked(const std::shared_ptr<Entry> &e, const wire::Request &req, bool blocks,
                                     uint64_t slot, const std::shared_ptr<Binding> &reserve, const KeyId &key,
                                     bool expand);
  /// The entry a kCacheId or kBlocksKey key (id_or_a, model b) names, checked servable.
  std::shared_ptr<Entry> Named(uint8_t kind, uint64_t a, uint64_t b);
  void UnbindAll(Entry &e);
  /// Release with hooks_mu_ held by the caller.
  void ReleaseHooked();
  /// No leased copy of `e` in flight, under its fence or any fence it had before (meaningful
  /// once revoked); old fences found drained are dropped. Lock held; one non-blocking try each.
  static bool FencesDrained(Entry &e);
  /// Revokes `e`'s fence and waits (mu_ held by `lock`) until no transfer holds it and no
  /// leased copy is in flight, or the deadline passes (false).
  bool Drain(std::unique_lock<std::mutex> &lock, Entry &e, std::chrono::steady_clock::time_point deadline);
  // Lock order: hooks_mu_, then mu_. hooks_mu_ is held while a hook runs (and by the calls
  // that run hooks, around their change and its hook), never taken with mu_ held.
  std::mutex hooks_mu_;
  std::mutex mu_;
  std::condition_variable changed_;
  int64_t next_id_ = 1;
  std::map<int64_t, std::shared_ptr<Entry>> by_id_;
  std::map<KeyId, std::shared_ptr<Binding>> keys_;
  std::map<uint64_t, std::shared_ptr<Entry>> models_;
  std::vector<std::shared_ptr<Entry>> dropped_;  // deallocated, not yet released
  std::vector<int64_t> released_;                // Release's ids, for Released (bounded)
  std::shared_ptr<Pool> pools_[2];               // HOST, DEVICE
  std::vector<std::shared_ptr<Entry>> stuck_;    // still leased when Clear gave up on them
  bool model_map_ = false;
  std::atomic<bool> remote_writes_{true};
  RegistryHooks hooks_;
};

/// Every check of a READ / WRITE by cache id (kind 2: slot `b`) or BlocksCacheKey (kind 3)
/// against the geometry of the cache `id` it names, in the owner's order (docs/protocol.md,
/// "Spans"): tensor indexes, the span cap, repeated tensors, block size or batch index, span
/// bounds, layouts. Returns the byte offset of the unit the offsets count from (0 for
/// blocks). LLM_PARAM_INVALID. Used by the owner (Registry::Open) and by a reader holding a
/// lease on the whole cache (lease.h), so both refuse exactly the same requests.
uint64_t CheckRequest(const Geometry &g, uint64_t id, const wire::Request &req);
/// CheckRequest for a request whose key resolved elsewhere: block addressing (`blocks`) or
/// the batch slot `slot` (a CacheKey's bound slot), whatever req.kind and req.b say.
uint64_t CheckRequestAt(const Geometry &g, uint64_t id, const wire::Request &req, bool blocks, uint64_t slot);

/// Every span [offset, offset + length) must lie in [0, limit) (overflow-safe).
void CheckSpans(const std::vector<uint64_t> &offsets, const std::vector<uint64_t> &lengths, uint64_t limit);

}  // namespace datadist

#endif  // DATADIST_CPP_REGISTRY_H_
