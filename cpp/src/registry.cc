#include "registry.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "errors.h"
#include "lease.h"
#include "pool.h"

namespace datadist {
namespace {

using llm_datadist::LLM_KV_CACHE_NOT_EXIST;

// Bytes per element; 0 for types without a whole-byte size (refused).
uint64_t ItemSize(ge::DataType dt) {
  switch (dt) {
    case ge::DT_INT8:
    case ge::DT_UINT8:
    case ge::DT_BOOL:
    case ge::DT_QINT8:
    case ge::DT_QUINT8:
    case ge::DT_HIFLOAT8:
    case ge::DT_FLOAT8_E5M2:
    case ge::DT_FLOAT8_E4M3FN:
    case ge::DT_FLOAT8_E8M0:
    case ge::DT_DUAL_SUB_INT8:
    case ge::DT_DUAL_SUB_UINT8: return 1;
    case ge::DT_FLOAT16:
    case ge::DT_BF16:
    case ge::DT_INT16:
    case ge::DT_UINT16:
    case ge::DT_QINT16:
    case ge::DT_QUINT16: return 2;
    case ge::DT_FLOAT:
    case ge::DT_INT32:
    case ge::DT_UINT32:
    case ge::DT_QINT32:
    case ge::DT_COMPLEX32: return 4;
    case ge::DT_INT64:
    case ge::DT_UINT64:
    case ge::DT_DOUBLE:
    case ge::DT_COMPLEX64: return 8;
    case ge::DT_COMPLEX128: return 16;
    default: return 0;
  }
}

// A data type's GE name, for messages in the caller's units (Python: core/dtypes.py).
std::string DtypeName(int64_t code) {
  switch (code) {
    case ge::DT_FLOAT: return "DT_FLOAT";
    case ge::DT_FLOAT16: return "DT_FLOAT16";
    case ge::DT_BF16: return "DT_BF16";
    case ge::DT_INT8: return "DT_INT8";
    case ge::DT_UINT8: return "DT_UINT8";
    case ge::DT_INT16: return "DT_INT16";
    case ge::DT_UINT16: return "DT_UINT16";
    case ge::DT_INT32: return "DT_INT32";
    case ge::DT_UINT32: return "DT_UINT32";
    case ge::DT_INT64: return "DT_INT64";
    case ge::DT_UINT64: return "DT_UINT64";
    case ge::DT_DOUBLE: return "DT_DOUBLE";
    case ge::DT_BOOL: return "DT_BOOL";
    default: return "data type code " + std::to_string(code);
  }
}

// The lowest-level check of the layout tags (the only one): another dtype is
// always refused; for block addressing, another block shape too. 0 on either side passes.
void CheckLayouts(uint64_t mine, uint64_t theirs, bool blocks, int64_t id) {
  if (!mine || !theirs) return;
  if (mine >> 32 != theirs >> 32)
    Invalid("cache " + std::to_string(id) + " holds " + DtypeName(static_cast<int64_t>(mine >> 32) - 1) +
            ", the requester's cache " + DtypeName(static_cast<int64_t>(theirs >> 32) - 1) +
            ": refusing to move bytes that would be read as the wrong type");
  if (blocks && (theirs & 0xFFFFFFFFULL) && mine != theirs)
    Invalid("cache " + std::to_string(id) +
            " has another block shape than the requester's cache (same data type and block size, the dimensions "
            "differ)");
}

}  // namespace

// Declared in registry.h: "4096 DT_FLOAT16 elements (8192 bytes)" where the layout tag names a sized type; else bytes.
std::string InElements(uint64_t bytes, uint64_t layout) {
  std::string plain = std::to_string(bytes) + " bytes";
  if (!layout) return plain;
  int64_t code = static_cast<int64_t>(layout >> 32) - 1;
  // The tag is the peer's to send: a code past the enum's range is no type (and no cast).
  uint64_t item = code < 0 || code >= static_cast<int64_t>(ge::DT_MAX) ? 0 : ItemSize(static_cast<ge::DataType>(code));
  if (!item || bytes % item) return plain;
  return std::to_string(bytes / item) + " " + DtypeName(code) + " elements (" + plain + ")";
}

Geometry GeometryOf(const llm_datadist::CacheDesc &desc) {
  if (desc.num_tensors == 0) Invalid("num_tensors must be > 0");
  if (desc.shape.empty() || desc.shape.size() > 32) Invalid("cache shape must have 1 to 32 dims");
  uint64_t item = ItemSize(desc.data_type);
  if (item == 0) Invalid("data_type " + std::to_string(static_cast<int>(desc.data_type)) + " is not supported");
  unsigned __int128 bytes = item;
  for (int64_t d : desc.shape) {
    if (d <= 0) Invalid("shape dims must be > 0");
    bytes *= static_cast<uint64_t>(d);
    if (bytes >> 62) Invalid("cache tensor too large");
  }
  Geometry g;
  g.num_tensors = desc.num_tensors;
  g.tensor_bytes = static_cast<uint64_t>(bytes);
  g.units = static_cast<uint64_t>(desc.shape[0]);
  g.unit_bytes = g.tensor_bytes / g.units;
  g.layout = wire::LayoutTag(static_cast<int32_t>(desc.data_type),
                             std::vector<int64_t>(desc.shape.begin() + 1, desc.shape.end()));
  return g;
}

void CheckSpans(const std::vector<uint64_t> &offsets, const std::vector<uint64_t> &lengths, uint64_t limit) {
  if (offsets.size() != lengths.size()) Invalid("span arrays differ in length");
  for (size_t i = 0; i < offsets.size(); ++i) {
    // A span of 0 bytes moves nothing; its only use is to ask whether an address is ours.
    if (lengths[i] == 0) Invalid("span [" + std::to_string(offsets[i]) + ", +0) is empty: spans move >= 1 byte");
    if (lengths[i] > limit || offsets[i] > limit - lengths[i])
      Invalid("span [" + std::to_string(offsets[i]) + ", +" + std::to_string(lengths[i]) + ") lies outside the " +
              std::to_string(limit) + " bytes registered");
  }
}

uint64_t CheckRequest(const Geometry &g, uint64_t id, const wire::Request &req) {
  return CheckRequestAt(g, id, req, req.kind == wire::kBlocksKey, req.b);
}

uint64_t CheckRequestAt(const Geometry &g, uint64_t id, const wire::Request &req, bool blocks, uint64_t slot) {
  if ((req.flags & wire::kFlagWhole) && req.tensors.size() != g.num_tensors)
    Invalid("the requester's cache has " + std::to_string(req.tensors.size()) + " tensors, cache " +
            std::to_string(id) + " " + std::to_string(g.num_tensors) +
            ": a pull without layer ranges needs the same count on both sides");
  for (uint32_t t : req.tensors)
    if (t >= g.num_tensors)
      Invalid("tensor " + std::to_string(t) + " out of range: cache " + std::to_string(id) + " has " +
              std::to_string(g.num_tensors));
  if (static_cast<unsigned __int128>(req.tensors.size()) * req.offsets.size() > kMaxRequestSpans)
    Invalid("too many spans in one request (tensors x spans over " + std::to_string(kMaxRequestSpans) + ")");
  std::vector<bool> seen(g.num_tensors, false);
  for (uint32_t t : req.tensors) {
    if (seen[t]) Invalid("tensor " + std::to_string(t) + " named twice in one request");
    seen[t] = true;
  }
  uint64_t base = 0, limit = g.tensor_bytes;
  if (blocks) {
    if (req.unit_bytes && req.unit_bytes != g.unit_bytes)
      Invalid("block size mismatch: the requester's blocks hold " + InElements(req.unit_bytes, req.layout) +
              ", cache " + std::to_string(id) + "'s " + InElements(g.unit_bytes, g.layout));
    // A block out of range, in blocks as the destination side says it.
    for (size_t i = 0; i < req.offsets.size() && i < req.lengths.size(); ++i) {
      if (req.lengths[i] > limit || req.offsets[i] > limit - req.lengths[i]) {
        unsigned __int128 end = static_cast<unsigned __int128>(req.offsets[i]) + std::max<uint64_t>(req.lengths[i], 1);
        Invalid("src block " + std::to_string(static_cast<uint64_t>((end - 1) / g.unit_bytes)) +
                " out of range: cache " + std::to_string(id) + " has " + std::to_string(g.units) + " blocks");
      }
    }
  } else {
    if (slot >= g.units)
      Invalid("batch index " + std::to_string(slot) + " out of range: cache " + std::to_string(id) + " has " +
              std::to_string(g.units));
    base = slot * g.unit_bytes;
    limit = g.tensor_bytes - base;
  }
  CheckSpans(req.offsets, req.lengths, limit);
  CheckLayouts(g.layout, req.layout, blocks, static_cast<int64_t>(id));
  return base;
}

bool KeyOf(uint64_t req_id, uint64_t prefix_id, uint64_t model_id, KeyId *key) {
  if (req_id != UINT64_MAX) {
    *key = {req_id, model_id, false};
    return true;
  }
  if (prefix_id != UINT64_MAX) {
    *key = {prefix_id, model_id, true};
    return true;
  }
  return false;
}

namespace {

std::string KeyName(const KeyId &k) {
  return std::string(k.is_prefix ? "prefix_id=" : "req_id=") + std::to_string(k.value) +
         " model_id=" + std::to_string(k.model_id);
}

// What refuses a cache whatever the request.
void CheckServable(const Entry &e) {
  if (e.closing) Fail(LLM_KV_CACHE_NOT_EXIST, "cache " + std::to_string(e.id) + " is being unregistered");
  if (!e.opts.remote_accessible) Invalid("cache " + std::to_string(e.id) + " is not remote accessible");
}

// The refusal of writes by key or cache id (and of write leases) without remote writes.
const char *const kWritesRefused =
    "this owner runs without enable_remote_cache_accessible: writes by key or cache id are refused";

}  // namespace

Lease::~Lease() { reg_->End(this); }

bool Lease::WantedBack() const { return reg_->Closing(entry_.get()); }

void Lease::Settle(bool ok) {
  if (!reserved_) return;  // this lease's own state (one thread uses a lease): no lock for most reads
  std::lock_guard<std::mutex> lock(reg_->mu_);
  reg_->SettleLocked(this, ok);
}

void Lease::Unpin() {
  if (!pinned_) return;
  std::lock_guard<std::mutex> lock(reg_->mu_);
  reg_->UnpinLocked(this);
}

bool Registry::Closing(const Entry *e) {
  std::lock_guard<std::mutex> lock(mu_);
  return e->closing || (!e->id_held && e->keys.empty());
}

void Registry::End(Lease *l) {
  std::lock_guard<std::mutex> lock(mu_);
  SettleLocked(l, false);
  UnpinLocked(l);
}

void Registry::UnpinLocked(Lease *l) {
  if (!l->pinned_) return;
  l->pinned_ = false;
  --l->entry_->leases;
  changed_.notify_all();
}

// Commit or drop a consuming read's reservation (Lease::Settle).
void Registry::SettleLocked(Lease *l, bool ok) {
  if (!l->reserved_) return;
  l->reserved_ = false;
  Binding &b = *l->binding_;
  for (uint32_t t : l->tensors_) b.reserved[t] = false;
  Entry &e = *l->entry_;
  auto it = keys_.find(l->key_);
  if (!ok || !e.keys.count(l->key_) || it == keys_.end() || it->second != l->binding_) return;
  for (uint32_t t : l->tensors_) b.pulled[t] = true;
  if (std::all_of(b.pulled.begin(), b.pulled.end(), [](bool p) { return p; })) {
    keys_.erase(it);
    e.keys.erase(l->key_);  // consumed: a deallocated cache it held may be released now
  }
}

namespace {

// A ShmPlace names every tensor or none (LLM_PARAM_INVALID).
void CheckShm(const ShmPlace &shm, size_t tensors) {
  const size_t m = shm.fds.size();
  if ((m && m != tensors) || shm.inos.size() != m || shm.offsets.size() != m)
    Invalid("shared memory of " + std::to_string(m) + " tensors given for " + std::to_string(tensors));
}

}  // namespace

std::shared_ptr<Entry> Registry::Make(const Geometry &g, const llm_datadist::CacheDesc *desc,
                                      const std::vector<uint64_t> &addrs, const CacheOptions &opts,
                                      const ShmPlace &shm) {
  if (addrs.size() != g.num_tensors)
    Invalid(std::to_string(addrs.size()) + " addresses given for " + std::to_string(g.num_tensors) + " tensors");
  for (uint64_t a : addrs)
    if (a == 0) Invalid("tensor addresses must be non-zero");
  CheckShm(shm, addrs.size());
  auto e = std::make_shared<Entry>();
  e->geo = g;
  if (desc) e->desc = *desc;
  e->addrs = addrs;
  e->opts = opts;
  e->opts.device = opts.device || (desc && desc->placement == llm_datadist::CachePlacement::kDevice);
  e->shm = shm;
  return e;
}

int64_t Registry::Add(const llm_datadist::CacheDesc &desc, const std::vector<uint64_t> &addrs,
                      std::vector<std::unique_ptr<uint8_t[]>> owned, std::shared_ptr<void> region,
                      const ShmPlace &shm) {
  std::shared_ptr<Entry> e = Make(GeometryOf(desc), &desc, addrs, {}, shm);
  e->owned = std::move(owned);
  e->region = std::move(region);
  std::lock_guard<std::mutex> order(hooks_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    while (by_id_.count(next_id_)) ++next_id_;  // ids an embedder chose (the other Add)
    e->id = next_id_++;
    by_id_[e->id] = e;
  }
  if (hooks_.added) hooks_.added(*e);  // outside mu_: a NIXL registration stalls no Open
  return e->id;
}

void Registry::Add(int64_t id, const llm_datadist::CacheDesc &desc, const std::vector<uint64_t> &addrs,
                   const CacheOptions &opts) {
  Insert(id, GeometryOf(desc), &desc, addrs, opts);
}

namespace {

void CheckGeometry(const Geometry &geo, const std::vector<uint64_t> &addrs) {
  if (geo.num_tensors == 0 || geo.units == 0 || geo.tensor_bytes == 0 || geo.tensor_bytes % geo.units ||
      geo.unit_bytes != geo.tensor_bytes / geo.units)
    Invalid("a cache geometry must have tensors, units and bytes that split into them");
  for (uint64_t a : addrs)
    if (a + geo.tensor_bytes < a) Invalid("tensor addresses must not wrap the address space");
}

}  // namespace

void Registry::AddAs(int64_t id, const Geometry &geo, const std::vector<uint64_t> &addrs, const CacheOptions &opts,
                     const ShmPlace &shm) {
  CheckGeometry(geo, addrs);
  Insert(id, geo, nullptr, addrs, opts, shm);
}

void Registry::Insert(int64_t id, const Geometry &g, const llm_datadist::CacheDesc *desc,
                      const std::vector<uint64_t> &addrs, const CacheOptions &opts, const ShmPlace &shm) {
  if (id <= 0) Invalid("cache id " + std::to_string(id) + " must be > 0");
  std::shared_ptr<Entry> e = Make(g, desc, addrs, opts, shm);
  e->id = id;
  std::lock_guard<std::mutex> order(hooks_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    bool used = by_id_.count(id) != 0;
    for (const auto &d : dropped_) used = used || d->id == id;
    if (used) Invalid("cache id " + std::to_string(id) + " is in use");
    by_id_[id] = e;
  }
  if (hooks_.added) hooks_.added(*e);
}

int64_t Registry::File(const Geometry &geo, const std::vector<uint64_t> &addrs, const CacheOptions &opts,
                       const ShmPlace &shm, const std::vector<KeyId> &keys, const std::vector<uint64_t> &slots,
                       std::optional<uint64_t> model, std::shared_ptr<void> region) {
  CheckGeometry(geo, addrs);
  std::shared_ptr<Entry> e = Make(geo, nullptr, addrs, opts, shm);
  e->region = std::move(region);
  std::shared_ptr<Entry> displaced;
  std::lock_guard<std::mutex> order(hooks_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    CheckKeysLocked(keys, slots, geo.units, "the cache");  // before anything is filed: all or nothing
    while (by_id_.count(next_id_)) ++next_id_;
    e->id = next_id_++;
    by_id_[e->id] = e;
    BindKeysLocked(e, keys, slots);
    if (model) displaced = BindModelLocked(*model, e);
  }
  if (hooks_.added) hooks_.added(*e);
  if (displaced && hooks_.going) hooks_.going(displaced.get());
  return e->id;
}

void Registry::SetPool(bool device, std::shared_ptr<Pool> pool) {
  std::lock_guard<std::mutex> lock(mu_);
  pools_[device ? 1 : 0] = std::move(pool);
}

std::shared_ptr<Pool> Registry::PoolOf(bool device) {
  std::lock_guard<std::mutex> lock(mu_);
  return pools_[device ? 1 : 0];
}

int64_t Registry::Allocate(bool device, const Geometry &geo, CacheOptions opts, const std::vector<KeyId> &keys,
                           const std::vector<uint64_t> &slots, std::optional<uint64_t> model) {
  Release();  // pool memory nothing holds any more goes back first
  std::shared_ptr<Pool> pool = PoolOf(device);
  if (!pool)
    Invalid(std::string("no memory pool for ") + (device ? "DEVICE" : "HOST") + " placement: set " +
            (device ? "mem_pool_cfg" : "host_mem_pool_cfg"));
  CheckKeys(keys, slots, geo.units);
  CheckGeometry(geo, {});
  std::vector<uint64_t> addrs;
  ShmPlace place;
  std::shared_ptr<Pool::Allocation> memory = pool->AllocateTensors(geo.num_tensors, geo.tensor_bytes, &addrs, &place);
  opts.allocated = true;
  opts.device = device;
  return File(geo, addrs, opts, place, keys, slots, model, std::move(memory));  // freed if it throws
}

void Registry::CheckKeys(const std::vector<KeyId> &keys, const std::vector<uint64_t> &slots, uint64_t units) {
  std::lock_guard<std::mutex> lock(mu_);
  CheckKeysLocked(keys, slots, units, "the cache");
}

bool Registry::Bound(const KeyId &key) {
  std::lock_guard<std::mutex> lock(mu_);
  return keys_.count(key) != 0;
}

Registry::Info Registry::Describe(int64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end()) Fail(LLM_KV_CACHE_NOT_EXIST, "cache " + std::to_string(id) + " does not exist");
  const Entry &e = *it->second;
  return Info{e.id, e.geo, e.addrs, e.opts, e.leases};
}

bool Registry::Filed(int64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_id_.find(id);
  return it != by_id_.end() && !it->second->closing;
}

std::vector<int64_t> Registry::Ids() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> out;
  for (const auto &kv : by_id_) out.push_back(kv.first);
  return out;
}

void Registry::ForEach(const std::function<void(const Entry &)> &each, const std::function<void()> &then) {
  std::lock_guard<std::mutex> order(hooks_mu_);  // no hook runs meanwhile
  std::vector<std::shared_ptr<Entry>> live;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto &kv : by_id_)
      if (!kv.second->closing) live.push_back(kv.second);
  }
  for (auto &e : live) each(*e);
  then();
}

void Registry::SetHooks(RegistryHooks hooks) {
  std::lock_guard<std::mutex> order(hooks_mu_);
  hooks_ = std::move(hooks);
}

void Registry::Going(const Entry *e) {
  std::lock_guard<std::mutex> order(hooks_mu_);
  if (hooks_.going) hooks_.going(e);
}

void Registry::CheckKeysLocked(const std::vector<KeyId> &keys, const std::vector<uint64_t> &slots, uint64_t units,
                               const std::string &cache) {
  if (keys.size() != slots.size())
    Invalid(std::to_string(keys.size()) + " keys given with " + std::to_string(slots.size()) + " slots");
  std::set<KeyId> seen;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (slots[i] >= units)
      Invalid("slot " + std::to_string(slots[i]) + " out of range: " + cache + " has " + std::to_string(units));
    if (!seen.insert(keys[i]).second) Invalid("duplicate cache keys");
    if (keys_.count(keys[i])) Invalid("cache key " + KeyName(keys[i]) + " is already bound");
  }
}

void Registry::BindKeysLocked(const std::shared_ptr<Entry> &e, const std::vector<KeyId> &keys,
                              const std::vector<uint64_t> &slots) {
  for (size_t i = 0; i < keys.size(); ++i) {
    auto b = std::make_shared<Binding>();
    b->entry = e;
    b->slot = slots[i];
    b->pulled.assign(e->geo.num_tensors, false);
    b->reserved.assign(e->geo.num_tensors, false);
    keys_[keys[i]] = b;
    e->keys.insert(keys[i]);
  }
}

void Registry::BindKeys(int64_t cache_id, const std::vector<KeyId> &keys, const std::vector<uint64_t> &slots) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_id_.find(cache_id);
  if (it == by_id_.end()) Fail(LLM_KV_CACHE_NOT_EXIST, "cache " + std::to_string(cache_id) + " does not exist");
  CheckKeysLocked(keys, slots, it->second->geo.units, "cache " + std::to_string(cache_id));
  BindKeysLocked(it->second, keys, slots);
}

void Registry::UnbindKey(const KeyId &key) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = keys_.find(key);
    if (it != keys_.end() && it->second->entry->opts.allocated) {
      it->second->entry->keys.erase(key);
      keys_.erase(it);
      changed_.notify_all();
    }
  }
  Release();  // a deallocated cache this key alone held (or a peer's read consumed) goes now
}

void Registry::SetModelMap(bool on) {
  std::lock_guard<std::mutex> lock(mu_);
  model_map_ = on;
}

void Registry::SetRemoteWrites(bool allowed) { remote_writes_ = allowed; }

std::shared_ptr<Entry> Registry::BindModelLocked(uint64_t model_id, const std::shared_ptr<Entry> &e) {
  std::shared_ptr<Entry> &slot = models_[model_id];
  std::shared_ptr<Entry> displaced;
  if (slot && slot != e) {
    if (slot->fence) slot->fence->Revoke();  // leases through the model id named the old cache
    slot->has_model = false;
    displaced = slot;
  }
  slot = e;
  slot->has_model = true;
  slot->blocks_model = model_id;
  return displaced;
}

void Registry::BindModel(uint64_t model_id, int64_t cache_id) {
  std::lock_guard<std::mutex> order(hooks_mu_);
  std::shared_ptr<Entry> displaced;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_id_.find(cache_id);
    if (it == by_id_.end()) Fail(LLM_KV_CACHE_NOT_EXIST, "cache " + std::to_string(cache_id) + " does not exist");
    displaced = BindModelLocked(model_id, it->second);
  }
  if (displaced && hooks_.going) hooks_.going(displaced.get());
}

void Registry::UnbindModel(uint64_t model_id) {
  std::lock_guard<std::mutex> order(hooks_mu_);
  std::shared_ptr<Entry> e;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = models_.find(model_id);
    if (it == models_.end()) return;
    e = it->second;
    if (e->fence) e->fence->Revoke();
    e->has_model = false;
    models_.erase(it);
  }
  if (hooks_.going) hooks_.going(e.get());
}

// The entry's keys and model id go. Lock held.
void Registry::UnbindAll(Entry &e) {
  for (const KeyId &k : e.keys) keys_.erase(k);
  e.keys.clear();
  if (e.has_model) {
    auto it = models_.find(e.blocks_model);
    if (it != models_.end() && it->second.get() == &e) models_.erase(it);
    e.has_model = false;
  }
}

void Registry::Deallocate(int64_t id, bool drop_keys) {
  std::lock_guard<std::mutex> order(hooks_mu_);
  std::shared_ptr<Entry> e;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_id_.find(id);
    if (it == by_id_.end() || !it->second->opts.allocated) return;
    e = it->second;
    by_id_.erase(it);
    e->id_held = false;
    if (e->fence) e->fence->Revoke();  // leases by cache id (or model id) end with the id
    if (drop_keys) UnbindAll(*e);
    dropped_.push_back(e);
    changed_.notify_all();
  }
  if (hooks_.going) hooks_.going(e.get());
  ReleaseHooked();  // with no key and no lease holding it, its memory goes now
}

void Registry::Release() {
  std::lock_guard<std::mutex> order(hooks_mu_);
  ReleaseHooked();
}

void Registry::ReleaseHooked() {
  std::vector<std::shared_ptr<Entry>> freed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto free = [&](const std::shared_ptr<Entry> &e) {
      if (!e->keys.empty() || e->leases || !FencesDrained(*e)) return false;
      freed.push_back(e);
      return true;
    };
    dropped_.erase(std::remove_if(dropped_.begin(), dropped_.end(), free), dropped_.end());
    for (const auto &e : freed) released_.push_back(e->id);
    constexpr size_t kKept = 4096;
    if (released_.size() > kKept)
      released_.erase(released_.begin(), released_.end() - static_cast<std::ptrdiff_t>(kKept));
  }
  for (const auto &e : freed)
    if (hooks_.gone) hooks_.gone(*e);  // before the memory goes (NIXL deregisters it)
  freed.clear();                       // the last holders: a pool allocation's pages go back to its pool here
}

std::vector<int64_t> Registry::Released() {
  Release();
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> out;
  out.swap(released_);
  return out;
}

void Registry::Remove(int64_t id, bool owned, double wait_s) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                         std::chrono::duration<double>(wait_s));
  std::shared_ptr<Entry> e;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_id_.find(id);
    if (it == by_id_.end()) return;
    e = it->second;
    if ((e->owned.empty() && !e->region) == owned)
      Invalid(owned ? "cache " + std::to_string(id) + " was registered, not allocated: use UnregisterKvCache"
                    : "cache " + std::to_string(id) + " was allocated, not registered: use DeallocateCache");
    e->closing = true;  // no new lease from here on
  }
  Going(e.get());  // NIXL's leases revoked, outside mu_
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!Drain(lock, *e, deadline)) {
      e->closing = false;  // its fence stays revoked: the next lease gets a new one
      Fail(llm_datadist::LLM_TIMEOUT,
           "cache " + std::to_string(id) + " is still being transferred; it stays registered");
    }
    auto it = by_id_.find(id);
    if (it == by_id_.end() || it->second != e) return;  // a concurrent Remove or Clear took it
    by_id_.erase(it);
    e->id_held = false;
    UnbindAll(*e);
  }
  std::lock_guard<std::mutex> order(hooks_mu_);
  if (hooks_.gone) hooks_.gone(*e);
}

bool Registry::FencesDrained(Entry &e) {
  e.old_fences.erase(std::remove_if(e.old_fences.begin(), e.old_fences.end(),
                                    [](const std::shared_ptr<lease::Fence> &f) { return f->Drained(); }),
                     e.old_fences.end());
  return e.old_fences.empty() && (!e.fence || e.fence->Drained());
}

bool Registry::Drain(std::unique_lock<std::mutex> &lock, Entry &e, std::chrono::steady_clock::time_point deadline) {
  if (e.fence) e.fence->Revoke();  // no leased copy starts from now on
  if (!changed_.wait_until(lock, deadline, [&] { return e.leases == 0; })) return false;
  // Locked leased copies in flight (writes, reads from a mapping of our memfds) hold the
  // fence's shared lock (another process's, so no condition tells us): the exclusive lock is
  // tried every 200 us until the deadline. A lock-free read in flight finds the byte set after
  // its copy and is not reported done (lease.h).
  while (!FencesDrained(e)) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    changed_.wait_for(lock, std::chrono::microseconds(200));
  }
  return true;
}

int Registry::RevokeLeases(double wait_s) {
  std::unique_lock<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<lease::Fence>> fences;
  for (auto &kv : by_id_)
    if (kv.second->fence) {
      kv.second->fence->Revoke();
      fences.push_back(kv.second->fence);
    }
  for (auto &kv : by_id_) fences.insert(fences.end(), kv.second->old_fences.begin(), kv.second->old_fences.end());
  const auto deadline =
      std::chrono::steady_clock::now() +
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(wait_s));
  int held = 0;
  for (auto &f : fences) {
    while (!f->Drained() && std::chrono::steady_clock::now() < deadline)
      changed_.wait_for(lock, std::chrono::microseconds(200));
    held += f->Drained() ? 0 : 1;
  }
  return held;
}

std::shared_ptr<Entry> Registry::Named(uint8_t kind, uint64_t a, uint64_t b) {
  std::shared_ptr<Entry> e;
  if (kind == wire::kBlocksKey && model_map_) {
    auto it = models_.find(b);
    if (it == models_.end())
      Fail(LLM_KV_CACHE_NOT_EXIST, "no blocks cache registered for model_id=" + std::to_string(b) +
                                       " (the owner must register_blocks_cache with BlocksCacheKey(its cluster id, " +
                                       std::to_string(b) + "))");
    e = it->second;
  } else {
    // kind 2 names cache id a; kind 3 a BlocksCacheKey's model_id b, which the C++ API (it
    // has no model ids) resolves as its cache id.
    const uint64_t id = kind == wire::kBlocksKey ? b : a;
    auto it = by_id_.find(static_cast<int64_t>(id));
    if (id > static_cast<uint64_t>(INT64_MAX) || it == by_id_.end())
      Fail(LLM_KV_CACHE_NOT_EXIST, "cache " + std::to_string(id) + " does not exist");
    e = it->second;
  }
  CheckServable(*e);
  return e;
}

wire::CacheLease Registry::LeaseCache(const wire::LeaseRequest &q) {
  if (q.kind != wire::kCacheId && q.kind != wire::kBlocksKey)
    Invalid("a cache lease names a cache by id or BlocksCacheKey");
  std::lock_guard<std::mutex> lock(mu_);
  if ((q.flags & wire::kLeaseWrite) && !remote_writes_) Invalid(kWritesRefused);
  Entry &e = *Named(q.kind, q.a, q.b);
  if (!e.fence || e.fence->revoked()) {
    // A revoked fence (an unregister that timed out, the model id bound to another cache) may
    // still be held by a copy that started before the revocation, reading memory that is still
    // registered: it is kept (old_fences) and drained too before the memory goes.
    if (e.fence) e.old_fences.push_back(std::move(e.fence));
    FencesDrained(e);  // drops the old ones no copy holds any more
    e.fence = std::make_shared<lease::Fence>();
  }
  wire::CacheLease l;
  l.cache_id = static_cast<uint64_t>(e.id);
  l.tensor_bytes = e.geo.tensor_bytes;
  l.units = e.geo.units;
  l.is_blocks = e.opts.blocks;  // C++ API caches carry no paged flag; the layout tag says the block shape
  l.layout = e.geo.layout;
  l.fence_fd = e.fence->fd();
  l.fence_ino = e.fence->ino();
  l.addrs = e.addrs;
  if ((q.flags & wire::kFlagShm) && !(q.flags & wire::kLeaseWrite) && e.shm.shareable()) {
    l.shm_fds = e.shm.fds;  // a lease to write goes by cross-memory attach (Python's)
    l.shm_inos = e.shm.inos;
    l.shm_offsets = e.shm.offsets;
  }
  return l;
}

int Registry::Clear(double wait_s) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                         std::chrono::duration<double>(wait_s));
  std::vector<std::shared_ptr<Entry>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto &kv : by_id_) {
      kv.second->closing = true;
      all.push_back(kv.second);
    }
    by_id_.clear();
    for (auto &e : dropped_) {  // deallocated, still held by keys or leases
      e->closing = true;
      all.push_back(e);
    }
    dropped_.clear();
    for (auto &e : all) {
      e->id_held = false;
      e->keys.clear();
      e->has_model = false;
    }
    keys_.clear();
    models_.clear();
    // the pools go once their last allocation does (a cache still leased keeps its pool mapped)
    pools_[0].reset();
    pools_[1].reset();
  }
  Going(nullptr);
  int busy = 0;
  {
    std::unique_lock<std::mutex> lock(mu_);
    for (auto &e : all) {
      if (!Drain(lock, *e, deadline)) {
        ++busy;
        stuck_.push_back(e);  // a copy may still be in flight: its memory must not go
      }
    }
    // those an earlier Clear gave up on, drained since, may go now
    stuck_.erase(std::remove_if(stuck_.begin(), stuck_.end(),
                                [](const std::shared_ptr<Entry> &e) { return e->leases == 0 && FencesDrained(*e); }),
                 stuck_.end());
  }
  std::lock_guard<std::mutex> order(hooks_mu_);
  for (auto &e : all)
    if (hooks_.gone) hooks_.gone(*e);  // drained or given up on: finalize deregisters it either way
  return busy;
}

int Registry::AwaitStuck(double wait_s) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                         std::chrono::duration<double>(wait_s));
  std::unique_lock<std::mutex> lock(mu_);
  int held = 0;
  for (auto &e : stuck_)
    if (!Drain(lock, *e, deadline)) ++held;
  stuck_.erase(std::remove_if(stuck_.begin(), stuck_.end(),
                              [](const std::shared_ptr<Entry> &e) { return e->leases == 0 && FencesDrained(*e); }),
               stuck_.end());
  return held;
}

Registry::~Registry() {
  // A copy still in flight in another process may read an entry's memory (the registry's
  // own, AllocateCache's): leaked rather than freed under it.
  for (auto &e : stuck_)
    if (e->leases != 0 || !FencesDrained(*e)) new std::shared_ptr<Entry>(std::move(e));
}

std::unique_ptr<Lease> Registry::Hold(int64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end() || it->second->closing)
    Fail(LLM_KV_CACHE_NOT_EXIST, "cache " + std::to_string(id) + " does not exist");
  ++it->second->leases;
  return std::make_unique<Lease>(this, it->second);
}

std::unique_ptr<Lease> Registry::Open(const wire::Request &req, bool expand) { return OpenChecked(req, true, expand); }

std::unique_ptr<Lease> Registry::OpenWrite(const wire::Request &req, bool expand) {
  return OpenChecked(req, false, expand);
}

std::unique_ptr<Lease> Registry::OpenChecked(const wire::Request &req, bool read, bool expand) {
  // Writes without remote writes: refused before anything is resolved
  if (!read && req.kind != wire::kAddress && !remote_writes_) Invalid(kWritesRefused);
  if (req.kind == wire::kAddress) return OpenAddresses(req, expand);
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_ptr<Entry> e;
  std::shared_ptr<Binding> binding;
  KeyId key;
  if (req.kind == wire::kCacheKey) {
    // a = req_id, b = model_id, c = prefix_id (docs/protocol.md, "Spans")
    auto it = KeyOf(req.a, req.c, req.b, &key) ? keys_.find(key) : keys_.end();
    if (it == keys_.end())
      Fail(LLM_KV_CACHE_NOT_EXIST, "no cache bound to req_id=" + std::to_string(req.a) +
                                       " prefix_id=" + std::to_string(req.c) + " model_id=" + std::to_string(req.b) +
                                       " (the owner must allocate or register it with that CacheKey; a successful "
                                       "pull consumes it)");
    binding = it->second;
    e = binding->entry;
    CheckServable(*e);
    const bool consumable = read && e->opts.allocated && !key.is_prefix;
    return LeaseLocked(e, req, false, binding->slot, consumable ? binding : nullptr, key, expand);
  }
  e = Named(req.kind, req.a, req.b);
  return LeaseLocked(e, req, req.kind == wire::kBlocksKey, req.b, nullptr, key, expand);
}

std::unique_ptr<Lease> Registry::LeaseLocked(const std::shared_ptr<Entry> &e, const wire::Request &req, bool blocks,
                                             uint64_t slot, const std::shared_ptr<Binding> &reserve, const KeyId &key,
                                             bool expand) {
  const uint64_t base = CheckRequestAt(e->geo, static_cast<uint64_t>(e->id), req, blocks, slot);
  if (reserve) {  // a consuming read: one at a time per tensor
    for (uint32_t t : req.tensors)
      if (reserve->reserved[t])
        Fail(LLM_KV_CACHE_NOT_EXIST, "req_id=" + std::to_string(req.a) + " model_id=" + std::to_string(req.b) +
                                         " is being read by another request: one read consumes it");
  }
  auto lease = std::make_unique<Lease>(this, e);
  ++e->leases;
  if (reserve) {
    for (uint32_t t : req.tensors) reserve->reserved[t] = true;
    lease->binding_ = reserve;
    lease->key_ = key;
    lease->tensors_ = req.tensors;
    lease->reserved_ = true;
  }
  uint64_t per_tensor = 0;
  for (uint64_t l : req.lengths) per_tensor += l;  // each <= tensor_bytes, at most 2^24 of them
  lease->nbytes = per_tensor * req.tensors.size();
  for (uint32_t t : req.tensors) lease->bases.push_back(e->addrs[t] + base);
  lease->span_bases_ = lease->bases;
  lease->span_offsets_ = req.offsets;
  lease->span_lengths_ = req.lengths;
  if (expand) {
    lease->iov.reserve(lease->spans());
    lease->Expand(0, lease->spans(), lease->iov);
  }
  return lease;
}

std::unique_ptr<Lease> Registry::OpenAddresses(const wire::Request &req, bool expand) {
  if (req.tensors.size() != 1 || req.tensors[0] != 0) Invalid("an address write names exactly one pseudo-tensor, 0");
  if (req.lengths.empty() || req.offsets.size() != req.lengths.size()) Invalid("an address write needs spans");
  if (req.offsets.size() > kMaxRequestSpans)
    Invalid("too many spans in one request (over " + std::to_string(kMaxRequestSpans) + ")");
  // Every refusal for where the addresses point (nothing there, a cache being unregistered, a
  // span leaving the tensor, a span of 0 bytes) is this one answer: a peer, never given our
  // addresses, cannot tell "no memory here" from "memory here, refused" (no address oracle).
  const char *const refused =
      "the addresses do not lie inside one tensor of a remote-accessible registered cache (spans of >= 1 byte)";
  for (uint64_t n : req.lengths)
    if (n == 0) Invalid(refused);
  uint64_t first = *std::min_element(req.offsets.begin(), req.offsets.end());
  std::lock_guard<std::mutex> lock(mu_);
  for (auto &kv : by_id_) {
    const std::shared_ptr<Entry> &e = kv.second;
    // The first remote-accessible cache, not being unregistered,
    // with a tensor holding the lowest address.
    if (e->closing || !e->opts.remote_accessible) continue;
    for (uint64_t a : e->addrs) {
      if (a <= first && first - a < e->geo.tensor_bytes) {
        std::vector<uint64_t> rel(req.offsets.size());
        for (size_t i = 0; i < rel.size(); ++i) rel[i] = req.offsets[i] - a;  // below a wraps and fails
        try {
          CheckSpans(rel, req.lengths, e->geo.tensor_bytes);
        } catch (const Error &) {
          Invalid(refused);
        }
        auto lease = std::make_unique<Lease>(this, e);
        ++e->leases;
        for (uint64_t n : req.lengths) lease->nbytes += n;
        lease->span_bases_ = {0};  // the offsets are absolute addresses
        lease->span_offsets_ = req.offsets;
        lease->span_lengths_ = req.lengths;
        if (expand) lease->Expand(0, lease->spans(), lease->iov);
        return lease;
      }
    }
  }
  Invalid(refused);
}

}  // namespace datadist
