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
#include "verify.h"

namespace datadist {
namespace nixl {

using namespace capi;  // NOLINT: the C API's table and types (nixl_capi.h)

// ------------------------------------------------------------------------------------ ReadPath

/// A lease on a whole remote cache, as the reader holds it (NIXL_LEASED): reads under it need
/// no request until the owner revokes it.
struct ReadPath::Held {
  wire::NixlLeased info;
  Geometry geo;
  LeaseKey key;
  int reading = 0;  // reads under it in flight (mu_)
  bool revoked = false;
};

namespace {

uint64_t IovTotal(const std::vector<iovec> &v) {
  uint64_t n = 0;
  for (const iovec &x : v) n += x.iov_len;
  return n;
}

/// The source (destination) spans of a request: per requested tensor its base, then every
/// (offset, length), tensor-major as everywhere.
std::vector<iovec> Spans(const std::vector<uint64_t> &bases, const wire::Request &req) {
  std::vector<iovec> out;
  out.reserve(bases.size() * req.offsets.size());
  for (uint64_t b : bases)
    for (size_t j = 0; j < req.offsets.size(); ++j)
      out.push_back(
          {reinterpret_cast<void *>(static_cast<uintptr_t>(b + req.offsets[j])), static_cast<size_t>(req.lengths[j])});
  return out;
}

std::string Bytes(const std::vector<iovec> &v) {
  std::string s;
  s.reserve(v.size() * 16);
  for (const iovec &x : v) {
    const uint64_t p[2] = {reinterpret_cast<uintptr_t>(x.iov_base), x.iov_len};
    s.append(reinterpret_cast<const char *>(p), sizeof p);
  }
  return s;
}

}  // namespace

void ReadPath::Connect(Channel &ch, Deadline deadline) {
  std::vector<uint8_t> payload;
  const wire::Header h = ch.call(
      wire::kNixlMdRequest, [](uint32_t rid) { return wire::EncodeEmpty(wire::kNixlMdRequest, rid); }, payload,
      deadline);
  if (h.type != wire::kNixlMd) {
    ch.close();
    ProtocolViolation("expected NIXL_MD");
  }
  wire::NixlMd md;
  try {
    md = wire::DecodeNixlMd(payload);
  } catch (const Error &) {
    ch.close();
    throw;
  }
  const std::string name = agent_->LoadRemote(md.metadata);
  if (name != md.agent) {
    agent_->DropRemote(name);
    ProtocolViolation("NIXL metadata names agent '" + name + "', not '" + md.agent + "'");
  }
  if (!remote_.empty()) {
    Forget();
    agent_->DropRemote(remote_);
  }
  remote_ = name;
  generation_ = md.generation;
}

void ReadPath::Refresh(Channel &ch, const std::string &agent, uint64_t generation, Deadline deadline) {
  if (agent != remote_ || generation > generation_) Connect(ch, deadline);
}

void ReadPath::Transfer(int op, Channel &ch, const std::vector<iovec> &local, const std::vector<iovec> &remote,
                        MemKind remote_kind, Deadline deadline) {
  MemKind local_kind;
  if (!agent_->Covers(local, &local_kind)) Invalid("the local cache is not registered with NIXL");
  // Both sides' registration generations: a kept transfer never outlives the registrations it
  // was made against (a cache unregistered and another registered at its address).
  std::string key = std::to_string(op) + "|" + remote_ + "|" + std::to_string(generation_) + "|" +
                    std::to_string(agent_->generation()) + "|" + std::to_string(remote_kind.mem) + "|" +
                    std::to_string(remote_kind.device) + "|" + Bytes(local) + "|" + Bytes(remote);
  void *x = nullptr;
  for (auto it = handles_.begin(); it != handles_.end(); ++it)
    if (it->first == key) {
      x = it->second;
      handles_.erase(it);
      break;
    }
  if (x == nullptr) x = agent_->Prepare(op, remote_, local, local_kind, remote, remote_kind);
  try {
    agent_->Run(x, deadline, ch.peer_gone);  // released there when it fails
  } catch (...) {
    Forget();  // a broken transfer may have broken the connection behind the kept ones
    throw;
  }
  handles_.emplace_front(std::move(key), x);
  while (handles_.size() > kHandles) {
    agent_->Release(handles_.back().second);
    handles_.pop_back();
  }
}

void ReadPath::Forget() {
  for (auto &kv : handles_) agent_->Release(kv.second);
  handles_.clear();
}

void ReadPath::Covered(const std::vector<iovec> &local) {
  MemKind kind;
  if (!agent_->Covers(local, &kind)) Invalid("the local cache is not registered with NIXL");
}

void ReadPath::Read(Channel &ch, const wire::Request &req, const std::vector<iovec> &local, Deadline deadline) {
  Covered(local);  // before the owner is asked anything: the connection stays as it is
  std::shared_ptr<Held> held = LeaseFor(ch, req, deadline);
  if (held) {
    bool usable;
    {
      std::lock_guard<std::mutex> lock(mu_);
      usable = !held->revoked;
      held->reading += usable;
    }
    if (usable) {
      struct Done {
        ReadPath *p;
        Held *h;
        ~Done() {
          std::lock_guard<std::mutex> lock(p->mu_);
          --h->reading;
          p->cv_.notify_all();
        }
      } done{this, held.get()};
      ReadLeased(ch, *held, req, local, deadline);
      return;
    }
  }
  ReadGranted(ch, req, local, deadline);
  wired_ = true;
}

std::shared_ptr<ReadPath::Held> ReadPath::LeaseFor(Channel &ch, const wire::Request &req, Deadline deadline) {
  if (!wired_ || !lease_ok_ || (req.flags & wire::kFlagChecksum) ||
      (req.kind != wire::kCacheId && req.kind != wire::kBlocksKey))
    return nullptr;
  const LeaseKey key{req.kind, req.kind == wire::kCacheId ? req.a : req.b};
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = leases_.find(key);
    if (it != leases_.end() && !it->second->revoked) return it->second;
    if (it != leases_.end()) leases_.erase(it);
    asking_ = true;
    revoked_early_.clear();
  }
  struct Asked {  // revokes of ids we were not told of are forgotten from here on
    ReadPath *p;
    ~Asked() {
      std::lock_guard<std::mutex> lock(p->mu_);
      p->asking_ = false;
      p->revoked_early_.clear();
    }
  } asked{this};
  wire::NixlLease q;
  q.kind = req.kind;
  q.a = req.kind == wire::kCacheId ? req.a : 0;
  q.b = req.kind == wire::kBlocksKey ? req.b : 0;
  q.unit_bytes = req.kind == wire::kBlocksKey ? req.unit_bytes : 0;
  std::vector<uint8_t> payload;
  wire::Header h;
  try {
    h = ch.call(
        wire::kNixlLease, [&q](uint32_t rid) { return wire::EncodeNixlLease(q, rid); }, payload, deadline);
  } catch (const Error &e) {
    // No reverse channel at the owner, or memory not registered with NIXL (FEATURE_NOT_ENABLED),
    // or the cache is going (KV_CACHE_NOT_EXIST): a request says what holds.
    if (e.code() == llm_datadist::LLM_FEATURE_NOT_ENABLED) {
      lease_ok_ = false;
      return nullptr;
    }
    if (e.code() == llm_datadist::LLM_KV_CACHE_NOT_EXIST) return nullptr;
    throw;
  }
  wire::NixlLeased l;
  try {
    if (h.type != wire::kNixlLeased) ProtocolViolation("expected NIXL_LEASED");
    l = wire::DecodeNixlLeased(payload);
    if (l.addrs.empty()) ProtocolViolation("a NIXL lease of no tensor");
  } catch (const Error &) {
    ch.close();
    throw;
  }
  auto held = std::make_shared<Held>();
  held->geo.num_tensors = static_cast<uint32_t>(l.addrs.size());
  held->geo.tensor_bytes = l.tensor_bytes;
  held->geo.units = l.units;
  held->geo.unit_bytes = l.unit_bytes;
  held->geo.layout = l.layout;
  if (l.units == 0 || l.tensor_bytes == 0 || l.tensor_bytes % l.units || l.unit_bytes != l.tensor_bytes / l.units ||
      l.addrs.size() > UINT32_MAX) {
    ch.close();
    ProtocolViolation("a NIXL lease with an impossible geometry");
  }
  Refresh(ch, l.agent, l.generation, deadline);
  held->info = std::move(l);
  held->key = key;
  std::lock_guard<std::mutex> lock(mu_);
  if (revoked_early_.count(held->info.lease_id)) return nullptr;  // revoked while on its way
  leases_[key] = held;
  lease_ids_[held->info.lease_id] = held;
  return held;
}

void ReadPath::ReadLeased(Channel &ch, Held &held, const wire::Request &req, const std::vector<iovec> &local,
                          Deadline deadline) {
  // The owner's checks of a NIXL_READ, made against the lease's geometry (registry.h).
  const bool blocks = held.info.blocks;
  const uint64_t base = CheckRequestAt(held.geo, held.info.lease_id, req, blocks, blocks ? 0 : req.b);
  std::vector<uint64_t> bases;
  bases.reserve(req.tensors.size());
  for (uint32_t t : req.tensors) bases.push_back(held.info.addrs[t] + base);
  const std::vector<iovec> src = Spans(bases, req);
  if (IovTotal(src) != IovTotal(local)) Invalid("the destination spans do not match the source spans");
  try {
    Transfer(0, ch, local, src, {held.info.mem, held.info.device}, deadline);
    if (Clock::now() > deadline)  // NIXL may copy within the post (UCX cma)
      Fail(llm_datadist::LLM_TIMEOUT, "the NIXL read under the lease ended past the deadline");
    if (ch.peer_gone())
      // The owner shut the connection down: it gave up waiting for us to give a revoked lease
      // back, and may have reused the memory we just read.
      Fail(llm_datadist::LLM_LINK_FAILED, "the owner dropped the connection during a leased NIXL read");
  } catch (...) {
    ch.close();  // the owner drops our leases with it; the link reconnects
    throw;
  }
}

void ReadPath::ReadGranted(Channel &ch, const wire::Request &req, const std::vector<iovec> &local, Deadline deadline) {
  wire::Request q = req;
  q.flags = req.flags & (wire::kFlagChecksum | wire::kFlagWhole);
  std::vector<uint8_t> payload;
  const wire::Header h = ch.call(
      wire::kNixlRead, [&q](uint32_t rid) { return wire::EncodeRequest(wire::kNixlRead, q, rid); }, payload, deadline);
  wire::NixlGrant g;
  try {
    if (h.type != wire::kNixlGrant) ProtocolViolation("expected NIXL_GRANT");
    g = wire::DecodeNixlGrant(payload);
    if (g.bases.size() != req.tensors.size()) ProtocolViolation("a NIXL_GRANT that does not match the request");
  } catch (const Error &) {
    ch.close();
    throw;
  }
  bool ok = false;
  auto release = [&] {
    if (ch.closed()) return;
    try {
      ch.send([&](uint32_t rid) { return wire::EncodeRelease({g.lease_id, ok}, rid); }, deadline);
    } catch (const Error &) {
      if (ok) throw;
    }
  };
  try {
    wire::Checksum ck;
    const bool checked = q.flags & wire::kFlagChecksum;
    if (checked) {
      std::vector<uint8_t> more;
      const wire::Header c = ch.answer(more, deadline);
      try {
        ck = verify::Expect(c, more);
      } catch (const Error &) {
        ch.close();
        throw;
      }
    }
    Refresh(ch, g.agent, g.generation, deadline);
    const std::vector<iovec> src = Spans(g.bases, req);
    if (IovTotal(src) != IovTotal(local)) ProtocolViolation("the grant does not match the request");
    Transfer(0, ch, local, src, {g.mem, g.device}, deadline);
    if (checked) {
      const std::string why = verify::Compare(ck, local);
      if (!why.empty()) verify::Mismatch(why);
    }
    ok = true;
  } catch (...) {
    try {
      release();
    } catch (...) {
    }
    throw;
  }
  release();
}

void ReadPath::Write(Channel &ch, const wire::Request &req, const std::vector<iovec> &local, Deadline deadline) {
  Covered(local);
  std::vector<uint8_t> payload;
  wire::Request q = req;
  q.flags = 0;
  const wire::Header h = ch.call(
      wire::kNixlWrite, [&q](uint32_t rid) { return wire::EncodeRequest(wire::kNixlWrite, q, rid); }, payload,
      deadline);
  wire::NixlGrant g;
  try {
    if (h.type != wire::kNixlGrant) ProtocolViolation("expected NIXL_GRANT");
    g = wire::DecodeNixlGrant(payload);
    if (g.bases.size() != req.tensors.size()) ProtocolViolation("a NIXL_GRANT that does not match the push");
  } catch (const Error &) {
    ch.close();
    throw;
  }
  bool ok = false;
  try {
    Refresh(ch, g.agent, g.generation, deadline);
    const std::vector<iovec> dst = Spans(g.bases, req);
    if (IovTotal(dst) != IovTotal(local)) ProtocolViolation("the grant does not match the push");
    Transfer(1, ch, local, dst, {g.mem, g.device}, deadline);
    ok = true;
  } catch (...) {
    if (!ch.closed()) {
      try {
        ch.send([&](uint32_t rid) { return wire::EncodeRelease({g.lease_id, false}, rid); }, deadline);
      } catch (const Error &) {
      }
    }
    throw;
  }
  ch.send([&](uint32_t rid) { return wire::EncodeRelease({g.lease_id, ok}, rid); }, deadline);
}

bool ReadPath::Revoke(uint64_t lease_id, double wait) {
  const Deadline end = After(wait);
  std::unique_lock<std::mutex> lock(mu_);
  auto it = lease_ids_.find(lease_id);
  if (it == lease_ids_.end()) {
    // Its NIXL_LEASED may still be on its way: remembered only while we wait for one, and
    // boundedly (a revoke of an id we never asked for changes nothing).
    if (asking_ && revoked_early_.size() < kEarlyRevokes) revoked_early_.insert(lease_id);
    return true;
  }
  std::shared_ptr<Held> held = it->second;
  lease_ids_.erase(it);
  held->revoked = true;
  auto k = leases_.find(held->key);
  if (k != leases_.end() && k->second == held) leases_.erase(k);
  return cv_.wait_until(lock, end, [&] { return held->reading == 0; });
}

size_t ReadPath::leases() {
  std::lock_guard<std::mutex> lock(mu_);
  return leases_.size();
}

void ReadPath::Close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto &kv : lease_ids_) kv.second->revoked = true;
    leases_.clear();
    lease_ids_.clear();
  }
  Forget();
  if (!remote_.empty()) {
    agent_->DropRemote(remote_);
    remote_.clear();
  }
}

}  // namespace nixl
}  // namespace datadist
