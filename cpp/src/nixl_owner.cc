#include <dirent.h>
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <set>
#include <sstream>

#include "errors.h"
#include "metrics.h"
#include "nixl.h"
#include "nixl_capi.h"
#include "threads.h"
#include "verify.h"

namespace datadist {
namespace nixl {

using namespace capi;  // NOLINT: the C API's table and types (nixl_capi.h)

// ------------------------------------------------------------------------------------ Owner

/// A NIXL lease on a whole cache, held for a reader connection until revoked or the
/// connection ends.
struct Owner::Held {
  uint64_t id = 0;
  std::unique_ptr<Lease> lease;
  const Entry *entry = nullptr;
  const void *conn_key = nullptr;
  Conn *conn = nullptr;  // valid while held_ lists it (DropConnection comes before its close)
  uint64_t cluster = 0;
  std::string token;
  std::shared_ptr<Agent> agent;
};

Owner::Owner(Registry *registry, uint64_t cluster_id) : registry_(registry), cluster_id_(cluster_id) {
  RegistryHooks hooks;
  hooks.added = [this](const Entry &e) { Added(e); };
  hooks.going = [this](const Entry *e) { Going(e); };
  hooks.gone = [this](const Entry &e) { Gone(e); };
  registry_->SetHooks(std::move(hooks));
}

Owner::~Owner() {
  registry_->SetHooks({});
  std::vector<RevokeThread> threads;
  {
    std::unique_lock<std::mutex> lock(mu_);
    closed_ = true;
    threads.swap(revokers_);
  }
  for (auto &t : threads) t.thread.join();
  std::map<uint64_t, std::shared_ptr<Held>> held;
  std::shared_ptr<Agent> agent;
  {
    std::lock_guard<std::mutex> lock(mu_);
    held.swap(held_);
    agent = std::move(agent_);
  }
  for (auto &kv : held) kv.second->agent->PumpRelease(false);
  held.clear();  // the registry's leases end here, outside mu_
}

void Owner::Configure(const ServeOptions &options, Revoker revoke, ReverseUp reverse_up) {
  std::lock_guard<std::mutex> lock(mu_);
  options_ = options;
  revoke_ = std::move(revoke);
  reverse_up_ = std::move(reverse_up);
}

void Owner::SetOptions(const ServeOptions &options) {
  std::lock_guard<std::mutex> lock(mu_);
  options_ = options;
}

std::string Owner::Refusal() {
  ServeOptions o;
  {
    std::lock_guard<std::mutex> lock(mu_);
    o = options_;
  }
  const bool writes = registry_->remote_writes();
  if (!o.serve) return "this owner does not serve NIXL (datadist.NixlServe / DATADIST_NIXL_SERVE)";
  if (!writes)
    return "this owner refuses remote writes (enable_remote_cache_accessible off) and NIXL registrations cannot be "
           "made read-only: it does not serve NIXL";
  if (o.whole_process) return "";
  return WholeProcessReach() +
         ": a NIXL peer could read and write this whole process; not without datadist.NixlAllowWholeProcessAccess "
         "(DATADIST_NIXL_ALLOW_WHOLE_PROCESS_ACCESS)";
}

std::shared_ptr<Agent> Owner::agent() {
  std::lock_guard<std::mutex> lock(mu_);
  return agent_;
}

std::shared_ptr<Agent> Owner::Serving() {
  const std::string why = Refusal();
  if (!why.empty()) Fail(llm_datadist::LLM_FEATURE_NOT_ENABLED, why);
  return Make([] {
    std::string load_why;
    return Load("", &load_why) ? std::string() : "NIXL is not available to this owner: " + load_why;
  });
}

std::shared_ptr<Agent> Owner::Reading() {
  try {
    return Make([] {
      std::string why;
      return Load("", &why) ? std::string() : "transport 'nixl' needs NIXL: pip install 'datadist[nixl]' (" + why + ")";
    });
  } catch (const Error &e) {
    Fail(llm_datadist::LLM_PARAM_INVALID, e.what());
  }
}

std::string Owner::ReaderRefusal() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (options_.whole_process) return "";
  }
  const std::string why = UncheckedTransports();
  if (why.empty()) return "";
  return why +
         ": the owner's UCX could reach this whole process; not without datadist.NixlAllowWholeProcessAccess "
         "(DATADIST_NIXL_ALLOW_WHOLE_PROCESS_ACCESS)";
}

bool Owner::Registers(const Entry &e, bool *is_private) {
  // A private cache is never registered by a process that serves NIXL (its registration
  // would be readable by whoever holds the metadata); one that does not (a reader: NIXL reads
  // only into registered memory) registers it marked private, and hands out no metadata.
  bool serve;
  {
    std::lock_guard<std::mutex> lock(mu_);
    serve = options_.serve;
  }
  *is_private = !e.opts.remote_accessible;
  return !(*is_private && serve);
}

std::shared_ptr<Agent> Owner::Make(const std::function<std::string()> &unavailable) {
  if (std::shared_ptr<Agent> a = agent()) return a;
  std::lock_guard<std::mutex> creating(create_mu_);
  if (std::shared_ptr<Agent> a = agent()) return a;
  const std::string missing = unavailable();
  if (!missing.empty()) Fail(llm_datadist::LLM_FEATURE_NOT_ENABLED, missing);
  std::ostringstream name;
  name << "datadist-" << cluster_id_ << "-" << getpid() << "-" << std::hex
       << (reinterpret_cast<uintptr_t>(this) & 0xffffffff);
  auto a = std::make_shared<Agent>(name.str());
  // Every servable cache, then published: under the registry's hook mutex, so none filed
  // meanwhile is missed (Added registers those once agent_ is set).
  registry_->ForEach([&](const Entry &e) { Register(*a, e); },
                     [&] {
                       std::lock_guard<std::mutex> lock(mu_);
                       agent_ = a;
                     });
  return a;
}

void Owner::Register(Agent &a, const Entry &e) {
  bool is_private = false;
  if (!Registers(e, &is_private)) return;
  // A cache NIXL cannot register is not served by NIXL (a grant or lease of it is refused,
  // and a reader cannot read into it); the others are.
  try {
    a.Register(&e, e.addrs, e.geo.tensor_bytes, is_private, MemoryKind(e.addrs, e.opts.device));
  } catch (const Error &err) {
    Log(std::string("cache ") + std::to_string(e.id) + " not registered with NIXL: " + err.what());
  }
}

void Owner::Added(const Entry &e) {
  if (std::shared_ptr<Agent> a = agent()) Register(*a, e);
}

void Owner::Gone(const Entry &e) {
  if (std::shared_ptr<Agent> a = agent()) a->Deregister(&e);
}

void Owner::Going(const Entry *e) {
  std::vector<std::shared_ptr<Held>> doomed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++epoch_;
    for (auto &kv : held_)
      if (e == nullptr || kv.second->entry == e) doomed.push_back(kv.second);
  }
  if (doomed.empty()) return;
  StartRevoking(std::move(doomed));
  if (e == nullptr) return;  // RevokeAll waits for every revoker itself
  // The change that doomed them (deallocate, a model id bound anew, unregister) returns only
  // once each reader gave its lease back or had its connection shut down (docs/transports.md:
  // a pull after it fails as on the other paths): bounded by the revoke's own wait.
  std::unique_lock<std::mutex> lock(mu_);
  revoked_.wait_for(lock, std::chrono::duration<double>(revoke_wait_ + 1.0), [&] {
    for (const auto &kv : held_)
      if (kv.second->entry == e) return false;
    return true;
  });
}

void Owner::StartRevoking(std::vector<std::shared_ptr<Held>> doomed) {
  // One thread per reader connection, all at once: a reader that answers each revoke just in
  // time cannot make another run out of time.
  std::map<const void *, std::vector<uint64_t>> by_reader;
  for (auto &h : doomed) by_reader[h->conn_key].push_back(h->id);
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return;
  // Revokers that finished are joined (each set its flag as its last step).
  for (auto it = revokers_.begin(); it != revokers_.end();) {
    if (*it->done) {
      it->thread.join();
      it = revokers_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto &kv : by_reader) {
    ++revoking_;
    auto done = std::make_shared<std::atomic<bool>>(false);
    revokers_.push_back({std::thread([this, ids = kv.second, done] {
                           EnterCoreThread("datadist-revoke");
                           RevokeReader(ids, done);
                         }),
                         done});
  }
}

void Owner::SetRevokeWait(double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  revoke_wait_ = seconds;
}

void Owner::RevokeReader(std::vector<uint64_t> ids, const std::shared_ptr<std::atomic<bool>> &done) {
  Deadline deadline;
  {
    std::lock_guard<std::mutex> lock(mu_);
    deadline = After(revoke_wait_);
  }
  for (uint64_t id : ids) {
    std::shared_ptr<Held> h;
    Revoker revoke;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = held_.find(id);
      if (it != held_.end()) h = it->second;
      revoke = revoke_;
    }
    if (!h) continue;  // its connection ended meanwhile
    try {
      if (!revoke) Fail(llm_datadist::LLM_LINK_FAILED, "no way to reach the reader's reverse channel");
      if (Clock::now() >= deadline) Fail(llm_datadist::LLM_TIMEOUT, "the revoke's time is spent");
      revoke(h->cluster, h->token, id, deadline);
    } catch (const std::exception &err) {
      // Not given back in time (or its reverse channel is gone): its connection is shut down,
      // which ends its leases; its reads under them then fail.
      Log("NIXL lease " + std::to_string(id) + " of cluster " + std::to_string(h->cluster) + " not given back (" +
          err.what() + "): its connection is shut down");
      std::lock_guard<std::mutex> lock(mu_);
      if (held_.count(id) && h->conn) h->conn->Shutdown();
    }
    End(id);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    --revoking_;
    revoked_.notify_all();
  }
  *done = true;
}

void Owner::End(uint64_t id) {
  std::shared_ptr<Held> h;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = held_.find(id);
    if (it == held_.end()) return;
    h = std::move(it->second);
    held_.erase(it);
    revoked_.notify_all();  // Going may wait for this lease
  }
  h->agent->PumpRelease(false);
  h.reset();  // the registry's lease ends here (its mutex), outside ours
}

void Owner::DropConnection(const void *conn_key) {
  std::vector<std::shared_ptr<Held>> ended;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = held_.begin(); it != held_.end();) {
      if (it->second->conn_key == conn_key) {
        ended.push_back(std::move(it->second));
        it = held_.erase(it);
        revoked_.notify_all();
      } else {
        ++it;
      }
    }
  }
  for (auto &h : ended) h->agent->PumpRelease(false);
}

void Owner::RevokeAll() {
  Going(nullptr);
  std::unique_lock<std::mutex> lock(mu_);
  revoked_.wait_for(lock, std::chrono::duration<double>(revoke_wait_ + 1.0), [this] { return revoking_ == 0; });
}

size_t Owner::leases() {
  std::lock_guard<std::mutex> lock(mu_);
  return held_.size();
}

wire::NixlLeased Owner::OpenLease(const void *conn_key, Conn *conn, uint64_t cluster, const std::string &token,
                                  const wire::NixlLease &q) {
  const Clock::time_point asked = Clock::now();
  try {
    std::shared_ptr<Agent> a = Serving();
    ReverseUp up;
    uint64_t epoch;
    size_t mine = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      up = reverse_up_;
      epoch = epoch_;
      for (auto &kv : held_) mine += kv.second->conn_key == conn_key;
    }
    // The reverse channel of this very connection (the token it echoed): a connection that
    // only claims the reader's cluster id gets no lease revoked on another's channel.
    if (token.empty() || !up || !up(cluster, token))
      Fail(llm_datadist::LLM_FEATURE_NOT_ENABLED,
           "no reverse channel from this reader to revoke a lease on: read by request");
    if (mine >= kMaxLeasesPerPeer)
      Fail(llm_datadist::LLM_FEATURE_NOT_ENABLED,
           "this reader holds " + std::to_string(mine) + " NIXL leases already: read by request");
    // Resolved and checked as a read of the whole cache: its first byte (spans of 0 bytes are refused).
    wire::Request whole;
    whole.kind = q.kind;
    whole.a = q.kind == wire::kCacheId ? q.a : 0;
    whole.b = q.kind == wire::kBlocksKey ? q.b : 0;
    whole.unit_bytes = q.unit_bytes;
    whole.tensors = {0};
    whole.offsets = {0};
    whole.lengths = {1};
    auto h = std::make_shared<Held>();
    h->lease = registry_->Open(whole);
    const Entry &e = h->lease->entry();
    MemKind kind;
    if (!a->Registered(&e, &kind))
      Fail(llm_datadist::LLM_FEATURE_NOT_ENABLED, "the cache is not registered with NIXL on the owner");
    h->entry = &e;
    h->conn_key = conn_key;
    h->conn = conn;
    h->cluster = cluster;
    h->token = token;
    h->agent = a;
    wire::NixlLeased l;
    bool moved = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // A cache went (or a model id moved) while we resolved: this one may be it.
      moved = closed_ || epoch != epoch_;
      if (!moved) {
        l.lease_id = next_lease_++;
        h->id = l.lease_id;
        held_[h->id] = h;
      }
    }
    if (moved)
      Fail(llm_datadist::LLM_KV_CACHE_NOT_EXIST, "cache " + std::to_string(e.id) + " is going: read by request");
    a->PumpAcquire(false);  // a lease is asked for only after a completed NIXL read
    l.agent = a->name();
    l.generation = a->generation();
    l.mem = kind.mem;
    l.device = kind.device;
    l.blocks = q.kind == wire::kBlocksKey;
    l.tensor_bytes = e.geo.tensor_bytes;
    l.unit_bytes = e.geo.unit_bytes;
    l.units = e.geo.units;
    l.layout = e.geo.layout;
    l.addrs = e.addrs;
    metrics::RecordSince(metrics::Op::kServeLease, cluster, 0, asked, llm_datadist::LLM_SUCCESS);
    return l;
  } catch (const Error &err) {
    metrics::RecordSince(metrics::Op::kServeLease, cluster, 0, asked, err.code());
    throw;
  }
}

}  // namespace nixl
}  // namespace datadist
