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

// ------------------------------------------------------------------------------------ Agent

struct Agent::Region {
  H dlist = nullptr;
  std::vector<uint64_t> addrs;
  uint64_t nbytes = 0;
  bool is_private = false;
  MemKind kind;
};

Agent::Agent(const std::string &name) : name_(name) {
  if (!Loaded()) Fail(llm_datadist::LLM_FEATURE_NOT_ENABLED, "NIXL is not loaded in the core");
  AgentConfig cfg{};
  cfg.enable_prog_thread = false;  // our pump progresses it, and only while a lease is open
  cfg.enable_listen_thread = false;
  cfg.thread_sync = kSyncStrict;
  try {
    Check(api.create_configured_agent(name_.c_str(), &cfg, &agent_), "agent creation");
    H mems = nullptr, params = nullptr;
    Check(api.get_plugin_params(agent_, "UCX", &mems, &params), "UCX plugin lookup");
    const Status s = api.create_backend(agent_, "UCX", params, &backend_);
    api.destroy_mem_list(mems);
    api.destroy_params(params);
    Check(s, "UCX backend creation");
    Check(api.create_opt_args(&opts_), "optional arguments");
    Check(api.opt_args_add_backend(opts_, backend_), "optional arguments");
    Check(api.create_notif_map(&notifs_), "notification map");
  } catch (...) {
    if (notifs_) api.destroy_notif_map(notifs_);
    if (opts_) api.destroy_opt_args(opts_);
    if (backend_) api.destroy_backend(backend_);
    if (agent_) api.destroy_agent(agent_);
    throw;
  }
}

Agent::~Agent() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
  }
  pump_cv_.notify_all();
  if (pump_.joinable()) pump_.join();
  std::vector<const void *> keys;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto &kv : regions_) keys.push_back(kv.first);
  }
  for (const void *k : keys) Deregister(k);
  for (void *x : stuck_)
    if (api.release_xfer_req(agent_, x) == kOk) api.destroy_xfer_req(x);
  for (auto &kv : remotes_) api.invalidate_remote_md(agent_, kv.first.c_str());
  api.destroy_notif_map(notifs_);
  api.destroy_opt_args(opts_);
  // The backend belongs to the agent, which releases it; destroy_backend then frees only the C
  // API's handle to it (1.5's nixl_capi_destroy_backend deletes the handle, nothing else).
  api.destroy_agent(agent_);
  api.destroy_backend(backend_);
}

uint64_t Agent::generation() {
  std::lock_guard<std::mutex> lock(mu_);
  return generation_;
}

void Agent::Register(const void *key, const std::vector<uint64_t> &addrs, uint64_t nbytes, bool is_private,
                     MemKind kind) {
  std::lock_guard<std::mutex> lock(mu_);
  if (regions_.count(key) || addrs.empty()) return;
  auto r = std::make_unique<Region>();
  const bool vram = kind.mem == wire::kMemVram;
  const uint64_t dev = vram ? kind.device : 0;
  Check(api.create_reg_dlist(vram ? kVram : kDram, &r->dlist, false), "descriptor list");
  for (uint64_t a : addrs) {
    const Status s = api.reg_dlist_add_desc(r->dlist, static_cast<uintptr_t>(a), nbytes, dev, nullptr, 0);
    if (s != kOk) {
      api.destroy_reg_dlist(r->dlist);
      Check(s, "descriptor");
    }
  }
  const Status s = api.register_mem(agent_, r->dlist, opts_);
  if (s != kOk) {
    api.destroy_reg_dlist(r->dlist);
    Fail(llm_datadist::LLM_FEATURE_NOT_ENABLED,
         std::string("NIXL cannot register ") +
             (vram ? "VRAM memory of CUDA device " + std::to_string(dev) : "DRAM memory") + " (status " +
             std::to_string(s) + ")");
  }
  r->addrs = addrs;
  r->nbytes = nbytes;
  r->is_private = is_private;
  r->kind = {vram ? wire::kMemVram : wire::kMemDram, static_cast<uint32_t>(dev)};
  for (uint64_t a : addrs) starts_.emplace(a, std::make_pair(a + nbytes, r->kind));
  private_ += is_private;
  regions_[key] = std::move(r);
  ++generation_;
}

void Agent::Deregister(const void *key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regions_.find(key);
  if (it == regions_.end()) return;
  std::unique_ptr<Region> r = std::move(it->second);
  regions_.erase(it);
  for (uint64_t a : r->addrs) {
    auto range = starts_.equal_range(a);
    for (auto s = range.first; s != range.second; ++s)
      if (s->second.first == a + r->nbytes) {
        starts_.erase(s);
        break;
      }
  }
  private_ -= r->is_private;
  ++generation_;
  const Status s = api.deregister_mem(agent_, r->dlist, opts_);
  if (s != kOk) Log("NIXL deregistration failed (status " + std::to_string(s) + ")");
  api.destroy_reg_dlist(r->dlist);
}

bool Agent::Registered(const void *key, MemKind *kind) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regions_.find(key);
  if (it == regions_.end()) return false;
  if (kind) *kind = it->second->kind;
  return true;
}

std::vector<Agent::Span> Agent::Spans() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Span> out;
  out.reserve(starts_.size());
  for (const auto &kv : starts_) out.push_back({kv.first, kv.second.first, kv.second.second});
  return out;
}

wire::NixlMd Agent::Metadata() {
  std::lock_guard<std::mutex> lock(mu_);
  if (private_)
    Fail(llm_datadist::LLM_FEATURE_NOT_ENABLED,
         "this process registered private memory with NIXL: it hands its NIXL metadata to no one");
  void *data = nullptr;
  size_t len = 0;
  Check(api.get_local_md(agent_, &data, &len), "metadata");
  wire::NixlMd md;
  md.agent = name_;
  md.generation = generation_;
  md.metadata.assign(static_cast<const char *>(data), len);
  std::free(data);
  return md;
}

std::string Agent::LoadRemote(const std::string &metadata) {
  char *name = nullptr;
  const Status s = api.load_remote_md(agent_, metadata.data(), metadata.size(), &name);
  if (s != kOk || name == nullptr)
    Fail(llm_datadist::LLM_LINK_FAILED, "NIXL refused the peer's metadata (status " + std::to_string(s) + ")");
  std::string out = name;
  std::free(name);
  std::lock_guard<std::mutex> lock(mu_);
  ++remotes_[out];
  return out;
}

void Agent::DropRemote(const std::string &name) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = remotes_.find(name);
    if (it == remotes_.end()) return;
    if (--it->second > 0) return;
    remotes_.erase(it);
  }
  (void)api.invalidate_remote_md(agent_, name.c_str());
}

bool Agent::Covers(const std::vector<iovec> &local, MemKind *kind) {
  constexpr int kLookBack = 8;  // registrations starting at or below a span looked at
  std::lock_guard<std::mutex> lock(mu_);
  bool first = true;
  for (const iovec &v : local) {
    const uint64_t a = reinterpret_cast<uintptr_t>(v.iov_base), n = v.iov_len;
    bool in = false;
    auto it = starts_.upper_bound(a);
    for (int i = 0; i < kLookBack && it != starts_.begin() && !in; ++i) {
      --it;
      const uint64_t size = it->second.first - it->first;
      in = a >= it->first && n <= size && a - it->first <= size - n;
    }
    if (!in) return false;
    // One transfer's local descriptors are of one memory kind (NIXL's descriptor list has one).
    if (!first && it->second.second != *kind) return false;
    *kind = it->second.second;
    first = false;
  }
  return true;
}

void *Agent::Prepare(int op, const std::string &remote_agent, const std::vector<iovec> &local, MemKind local_kind,
                     const std::vector<iovec> &remote, MemKind remote_kind) {
  // Each side's descriptor list has that side's registered memory kind, each descriptor its
  // device id (0 for DRAM), as the registrations NIXL looks them up in.
  auto type = [](MemKind k) { return k.mem == wire::kMemVram ? kVram : kDram; };
  auto dev = [](MemKind k) { return k.mem == wire::kMemVram ? static_cast<uint64_t>(k.device) : uint64_t{0}; };
  H l = nullptr, r = nullptr, req = nullptr;
  Status s = api.create_xfer_dlist(type(local_kind), &l, false);
  if (s == kOk) s = api.create_xfer_dlist(type(remote_kind), &r, false);
  for (const iovec &v : local)
    if (s == kOk) s = api.xfer_dlist_add_desc(l, reinterpret_cast<uintptr_t>(v.iov_base), v.iov_len, dev(local_kind));
  for (const iovec &v : remote)
    if (s == kOk) s = api.xfer_dlist_add_desc(r, reinterpret_cast<uintptr_t>(v.iov_base), v.iov_len, dev(remote_kind));
  if (s == kOk) s = api.create_xfer_req(agent_, op, l, r, remote_agent.c_str(), &req, opts_);
  if (l) api.destroy_xfer_dlist(l);
  if (r) api.destroy_xfer_dlist(r);
  if (s != kOk || req == nullptr)
    Fail(llm_datadist::LLM_LINK_FAILED, std::string("NIXL cannot prepare the ") + (op == kRead ? "READ" : "WRITE") +
                                            " (status " + std::to_string(s) + ")");
  ++prepared_;
  return req;
}

void Agent::Run(void *xfer, Deadline deadline, const std::function<bool()> &peer_gone) {
  constexpr unsigned kLookEvery = 64;  // polls between two looks at the clock and the peer
  Status s = api.post_xfer_req(agent_, xfer, opts_);
  for (unsigned polls = 1; s == kInProgress; ++polls) {
    if (polls % kLookEvery == 0) {
      if (Clock::now() > deadline) {
        Release(xfer);
        Fail(llm_datadist::LLM_TIMEOUT, "NIXL transfer did not complete before the deadline");
      }
      if (peer_gone()) {
        Release(xfer);
        Fail(llm_datadist::LLM_LINK_FAILED, "the owner went away during a NIXL transfer");
      }
    }
    s = api.get_xfer_status(agent_, xfer);
  }
  if (s != kOk) {
    Release(xfer);
    Fail(llm_datadist::LLM_LINK_FAILED, "NIXL transfer failed (status " + std::to_string(s) + ")");
  }
}

void Agent::Release(void *xfer) {
  if (api.release_xfer_req(agent_, xfer) == kOk) {
    api.destroy_xfer_req(xfer);
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  stuck_.push_back(xfer);  // NIXL could not cancel it yet: retried when the agent goes
}

void Agent::PumpAcquire(bool fresh) {
  std::lock_guard<std::mutex> lock(mu_);
  ++users_;
  fresh_ += fresh;
  if (!pump_.joinable() && !closed_)
    pump_ = std::thread([this] {
      EnterCoreThread("datadist-nixl");
      Pump();
    });
  pump_cv_.notify_all();
}

void Agent::PumpRelease(bool fresh) {
  std::lock_guard<std::mutex> lock(mu_);
  users_ -= users_ > 0;
  fresh_ -= fresh && fresh_ > 0;
}

size_t Agent::pump_users() {
  std::lock_guard<std::mutex> lock(mu_);
  return users_;
}

size_t Agent::pump_fresh() {
  std::lock_guard<std::mutex> lock(mu_);
  return fresh_;
}

void Agent::Progress() {
  // NIXL in strict sync mode serialises this with our other calls; the notifications
  // themselves are not used.
  if (api.get_notifs(agent_, notifs_, opts_) == kOk) api.notif_map_clear(notifs_);
}

void Agent::Pump() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    pump_cv_.wait(lock, [this] { return closed_ || users_ > 0; });  // idle: no beat, no CPU
    if (closed_) return;
    const double beat = fresh_ ? kPumpFast : kPumpSlow;
    lock.unlock();
    Progress();  // progresses the backend's worker
    usleep(static_cast<useconds_t>(beat * 1e6));
    lock.lock();
  }
}

}  // namespace nixl
}  // namespace datadist
