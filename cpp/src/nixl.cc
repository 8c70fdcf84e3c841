#include "nixl.h"

#include <dirent.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <set>
#include <sstream>
#include <unistd.h>

#include "errors.h"
#include "metrics.h"
#include "verify.h"

namespace datadist {
namespace nixl {
namespace {

// ---- NIXL's C API, as declared by its Rust bindings' wrapper (src/bindings/rust/wrapper.h of
// ai-dynamo/nixl; nixl-cu12 1.5.1's libnixl_capi.so). Handles are opaque pointers; every call
// returns a status: 0 success, 1 in progress, negative an error.
using Status = int;
constexpr Status kOk = 0, kInProgress = 1;
constexpr int kDram = 0, kVram = 1;  // nixl_capi_mem_type_t: NIXL_CAPI_MEM_DRAM, NIXL_CAPI_MEM_VRAM
constexpr int kRead = 0;  // nixl_capi_xfer_op_t (kWrite = 1)
constexpr unsigned kSyncStrict = 1;  // nixl_capi_thread_sync_t
/// nixl_capi_agent_config_t (its field order and types are the ABI).
struct AgentConfig {
  bool enable_prog_thread;
  bool enable_listen_thread;
  int listen_port;
  unsigned thread_sync;
  uint64_t pthr_delay_us;
  uint64_t lthr_delay_us;
  bool capture_telemetry;
};
using H = void *;

/// The functions we call, resolved once (Load). The one place NIXL's symbols are named.
struct Api {
  Status (*create_configured_agent)(const char *, const AgentConfig *, H *);
  Status (*destroy_agent)(H);
  Status (*get_plugin_params)(H, const char *, H *, H *);
  Status (*destroy_mem_list)(H);
  Status (*destroy_params)(H);
  Status (*create_backend)(H, const char *, H, H *);
  Status (*destroy_backend)(H);
  Status (*create_opt_args)(H *);
  Status (*destroy_opt_args)(H);
  Status (*opt_args_add_backend)(H, H);
  // (mem type, out, sorted): older versions take two arguments and ignore the third
  Status (*create_reg_dlist)(int, H *, bool);
  Status (*destroy_reg_dlist)(H);
  // (list, addr, len, dev, metadata, metadata len): older versions ignore the last two
  Status (*reg_dlist_add_desc)(H, uintptr_t, size_t, uint64_t, const void *, size_t);
  Status (*register_mem)(H, H, H);
  Status (*deregister_mem)(H, H, H);
  Status (*get_local_md)(H, void **, size_t *);  // malloc'd: free()
  Status (*create_notif_map)(H *);
  Status (*destroy_notif_map)(H);
  Status (*get_notifs)(H, H, H);
  Status (*notif_map_clear)(H);
  Status (*load_remote_md)(H, const void *, size_t, char **);  // the name strdup'd: free()
  Status (*invalidate_remote_md)(H, const char *);
  // (mem type, out, sorted): older versions take two arguments and ignore the third
  Status (*create_xfer_dlist)(int, H *, bool);
  Status (*destroy_xfer_dlist)(H);
  Status (*xfer_dlist_add_desc)(H, uintptr_t, size_t, uint64_t);
  Status (*create_xfer_req)(H, int, H, H, const char *, H *, H);
  Status (*post_xfer_req)(H, H, H);     // 0 done, 1 in progress
  Status (*get_xfer_status)(H, H);      // 0 done, 1 in progress
  Status (*release_xfer_req)(H, H);
  Status (*destroy_xfer_req)(H);
};

Api api;
std::mutex load_mu;
int loaded = 0;  // 0: not tried, 1: loaded, -1: failed
std::string load_why;

template <typename F>
bool Sym(void *lib, const char *name, F &slot, std::string *missing) {
  void *p = dlsym(lib, name);
  if (p == nullptr) {
    *missing += std::string(missing->empty() ? "" : ", ") + name;
    return false;
  }
  slot = reinterpret_cast<F>(p);
  return true;
}

void Check(Status s, const std::string &what) {
  if (s != kOk) Fail(llm_datadist::LLM_FEATURE_NOT_ENABLED, "NIXL " + what + " failed (status " + std::to_string(s) + ")");
}

// UCX transports whose remote accesses the hardware checks against a registration's memory key,
// and those that serve no remote access at all (the same set as core/nixl_wheel.py's KEY_CHECKED_TLS).
const std::set<std::string> kKeyCheckedTls = {
    "ib", "rc", "rc_v", "rc_x", "rc_verbs", "rc_mlx5", "dc", "dc_x", "dc_mlx5", "ud", "ud_v",
    "ud_x", "ud_verbs", "ud_mlx5", "cuda_copy", "rocm_copy", "gdr_copy"};
constexpr const char *kRdmaDevices = "/sys/class/infiniband";
constexpr const char *kSoftwareRma =
    "UCX's software RMA emulation (ucp/rma/rma_sw.c) serves a PUT or GET at any address a peer names, with no key, "
    "on every transport that carries active messages, RDMA verbs included";

bool HasRdmaDevice() {
  DIR *d = opendir(kRdmaDevices);
  if (d == nullptr) return false;
  bool any = false;
  while (dirent *ent = readdir(d))
    if (std::strcmp(ent->d_name, ".") != 0 && std::strcmp(ent->d_name, "..") != 0) any = true;
  closedir(d);
  return any;
}

std::string Trim(const std::string &s) {
  const size_t a = s.find_first_not_of(" \t\n\r");
  if (a == std::string::npos) return "";
  return s.substr(a, s.find_last_not_of(" \t\n\r") - a + 1);
}

// ---- The CUDA runtime, asked where a device-placed cache's memory lies.
// cudaPointerAttributes since CUDA 11: {type, device,
// devicePointer, hostPointer}; type 2 is cudaMemoryTypeDevice, 3 cudaMemoryTypeManaged.
struct CudaPointerAttributes {
  int type;
  int device;
  void *device_pointer;
  void *host_pointer;
};
constexpr int kCudaDevice = 2, kCudaManaged = 3;
struct Cudart {
  int (*pointer_attributes)(CudaPointerAttributes *, const void *) = nullptr;
  int (*last_error)() = nullptr;
};

/// The runtime named by kCudartEnv, else the first of the usual sonames that loads; null where
/// none does. Loaded locally (RTLD_LOCAL: it never stands in for NIXL's own CUDA calls), once
/// per name, and kept.
const Cudart *CudaRuntime() {
  static std::mutex mu;
  static std::map<std::string, Cudart> loaded_by_name;  // a name that did not load: no function
  const char *env = std::getenv(kCudartEnv);
  const std::vector<std::string> names =
      env && *env ? std::vector<std::string>{env}
                  : std::vector<std::string>{"libcudart.so", "libcudart.so.12", "libcudart.so.13"};
  std::lock_guard<std::mutex> lock(mu);
  for (const std::string &name : names) {
    auto it = loaded_by_name.find(name);
    if (it == loaded_by_name.end()) {
      Cudart rt;
      if (void *lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL)) {
        rt.pointer_attributes =
            reinterpret_cast<decltype(rt.pointer_attributes)>(dlsym(lib, "cudaPointerGetAttributes"));
        rt.last_error = reinterpret_cast<decltype(rt.last_error)>(dlsym(lib, "cudaGetLastError"));
        if (!rt.pointer_attributes || !rt.last_error) {
          Log("the CUDA runtime " + name + " lacks cudaPointerGetAttributes: device caches are NIXL DRAM");
          rt = Cudart();
        }
      }
      it = loaded_by_name.emplace(name, rt).first;
    }
    if (it->second.pointer_attributes) return &it->second;
  }
  return nullptr;
}

}  // namespace

bool CudaDevice(uint64_t addr, uint32_t *device) {
  const Cudart *rt = CudaRuntime();
  if (rt == nullptr) return false;
  CudaPointerAttributes attrs{};
  if (rt->pointer_attributes(&attrs, reinterpret_cast<const void *>(static_cast<uintptr_t>(addr))) != 0) {
    rt->last_error();  // clears the error CUDA keeps for the thread
    return false;
  }
  if ((attrs.type != kCudaDevice && attrs.type != kCudaManaged) || attrs.device < 0) return false;
  *device = static_cast<uint32_t>(attrs.device);
  return true;
}

MemKind MemoryKind(const std::vector<uint64_t> &addrs, bool device_placed) {
  MemKind out;
  if (!device_placed || addrs.empty()) return out;
  size_t on_device = 0;
  for (size_t i = 0; i < addrs.size(); ++i) {
    uint32_t dev = 0;
    const bool gpu = CudaDevice(addrs[i], &dev);
    if (gpu && on_device && dev != out.device)
      Fail(llm_datadist::LLM_FEATURE_NOT_ENABLED, "the cache's tensors lie on CUDA devices " +
                                                      std::to_string(out.device) + " and " + std::to_string(dev) +
                                                      ": one NIXL registration is on one device");
    if (gpu) {
      out.mem = wire::kMemVram;
      out.device = dev;
      ++on_device;
    }
  }
  if (on_device != 0 && on_device != addrs.size())
    Fail(llm_datadist::LLM_FEATURE_NOT_ENABLED,
         "the cache's tensors lie partly in GPU memory, partly in host memory: one NIXL registration has one memory "
         "kind");
  return out;
}

bool Load(const std::string &path, std::string *why) {
  std::lock_guard<std::mutex> lock(load_mu);
  if (loaded == 0 && path.empty()) {
    if (why) *why = "no NIXL library was handed to the core (pip install nixl-cu12)";
    return false;
  }
  if (loaded == 0) {
    // Where the RDMA user libraries are installed but the host has no RDMA device, UCX's ib
    // module crashes the process at exit (as core/nixl_wheel.py's _skip_unusable_ib also says): kept out,
    // unless the user chose UCX_MODULES.
    if (std::getenv("UCX_MODULES") == nullptr && !HasRdmaDevice()) setenv("UCX_MODULES", "^ib", 0);
    void *lib = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (lib == nullptr) {
      const char *err = dlerror();
      load_why = "cannot load NIXL's C API (" + path + "): " + (err ? err : "dlopen failed");
      loaded = -1;
    } else {
      std::string missing;
      bool ok = true;
      ok &= Sym(lib, "nixl_capi_create_configured_agent", api.create_configured_agent, &missing);
      ok &= Sym(lib, "nixl_capi_destroy_agent", api.destroy_agent, &missing);
      ok &= Sym(lib, "nixl_capi_get_plugin_params", api.get_plugin_params, &missing);
      ok &= Sym(lib, "nixl_capi_destroy_mem_list", api.destroy_mem_list, &missing);
      ok &= Sym(lib, "nixl_capi_destroy_params", api.destroy_params, &missing);
      ok &= Sym(lib, "nixl_capi_create_backend", api.create_backend, &missing);
      ok &= Sym(lib, "nixl_capi_destroy_backend", api.destroy_backend, &missing);
      ok &= Sym(lib, "nixl_capi_create_opt_args", api.create_opt_args, &missing);
      ok &= Sym(lib, "nixl_capi_destroy_opt_args", api.destroy_opt_args, &missing);
      ok &= Sym(lib, "nixl_capi_opt_args_add_backend", api.opt_args_add_backend, &missing);
      ok &= Sym(lib, "nixl_capi_create_reg_dlist", api.create_reg_dlist, &missing);
      ok &= Sym(lib, "nixl_capi_destroy_reg_dlist", api.destroy_reg_dlist, &missing);
      ok &= Sym(lib, "nixl_capi_reg_dlist_add_desc", api.reg_dlist_add_desc, &missing);
      ok &= Sym(lib, "nixl_capi_register_mem", api.register_mem, &missing);
      ok &= Sym(lib, "nixl_capi_deregister_mem", api.deregister_mem, &missing);
      ok &= Sym(lib, "nixl_capi_get_local_md", api.get_local_md, &missing);
      ok &= Sym(lib, "nixl_capi_create_notif_map", api.create_notif_map, &missing);
      ok &= Sym(lib, "nixl_capi_destroy_notif_map", api.destroy_notif_map, &missing);
      ok &= Sym(lib, "nixl_capi_get_notifs", api.get_notifs, &missing);
      ok &= Sym(lib, "nixl_capi_notif_map_clear", api.notif_map_clear, &missing);
      ok &= Sym(lib, "nixl_capi_load_remote_md", api.load_remote_md, &missing);
      ok &= Sym(lib, "nixl_capi_invalidate_remote_md", api.invalidate_remote_md, &missing);
      ok &= Sym(lib, "nixl_capi_create_xfer_dlist", api.create_xfer_dlist, &missing);
      ok &= Sym(lib, "nixl_capi_destroy_xfer_dlist", api.destroy_xfer_dlist, &missing);
      ok &= Sym(lib, "nixl_capi_xfer_dlist_add_desc", api.xfer_dlist_add_desc, &missing);
      ok &= Sym(lib, "nixl_capi_create_xfer_req", api.create_xfer_req, &missing);
      ok &= Sym(lib, "nixl_capi_post_xfer_req", api.post_xfer_req, &missing);
      ok &= Sym(lib, "nixl_capi_get_xfer_status", api.get_xfer_status, &missing);
      ok &= Sym(lib, "nixl_capi_release_xfer_req", api.release_xfer_req, &missing);
      ok &= Sym(lib, "nixl_capi_destroy_xfer_req", api.destroy_xfer_req, &missing);
      if (ok) {
        loaded = 1;
      } else {
        load_why = "NIXL's C API (" + path + ") lacks " + missing;
        loaded = -1;  // the library stays loaded: NIXL does not expect to be unloaded
      }
    }
  }
  if (loaded < 0 && why) *why = load_why;
  return loaded > 0;
}

bool Loaded() {
  std::lock_guard<std::mutex> lock(load_mu);
  return loaded > 0;
}

std::string UncheckedTransports() {
  const char *env = std::getenv("UCX_TLS");
  const std::string raw = Trim(env ? env : "");
  if (raw.empty()) return "UCX_TLS is not set: UCX may use tcp and shared-memory transports";
  if (raw[0] == '^') return "UCX_TLS=" + raw + " excludes transports instead of naming them";
  std::string bad;
  std::stringstream names(raw);
  for (std::string t; std::getline(names, t, ',');) {
    t = Trim(t);
    while (!t.empty() && t[0] == '\\') t.erase(0, 1);
    std::transform(t.begin(), t.end(), t.begin(), [](unsigned char c) { return std::tolower(c); });
    if (!kKeyCheckedTls.count(t)) bad += (bad.empty() ? "" : ", ") + t;
  }
  if (!bad.empty()) return "UCX_TLS=" + raw + " names " + bad + ", whose memory keys nothing checks";
  if (!HasRdmaDevice()) return std::string("no RDMA device on this host (") + kRdmaDevices + " is empty)";
  return "";
}

std::string WholeProcessReach() {
  std::string why = UncheckedTransports();
  return why.empty() ? kSoftwareRma : why;
}

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
  // The backend belongs to the agent, which releases it.
  api.destroy_agent(agent_);
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
         std::string("NIXL cannot register ") + (vram ? "VRAM memory of CUDA device " + std::to_string(dev) : "DRAM memory") +
             " (status " + std::to_string(s) + ")");
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
  if (!pump_.joinable() && !closed_) pump_ = std::thread([this] { Pump(); });
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
  return why + ": the owner's UCX could reach this whole process; not without datadist.NixlAllowWholeProcessAccess "
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
  name << "datadist-" << cluster_id_ << "-" << getpid() << "-" << std::hex << (reinterpret_cast<uintptr_t>(this) & 0xffffffff);
  auto a = std::make_shared<Agent>(name.str());
  // Every servable cache, then published: under the registry's mutex, so none filed meanwhile
  // is missed (Added registers those once agent_ is set).
  registry_->ForEach([&](const Entry &e) {
    if (!e.closing) Register(*a, e);
  }, [&] {
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
  if (!doomed.empty()) StartRevoking(std::move(doomed));
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
    revokers_.push_back({std::thread([this, ids = kv.second, done] { RevokeReader(ids, done); }), done});
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
      Log("NIXL lease " + std::to_string(id) + " of cluster " + std::to_string(h->cluster) +
          " not given back (" + err.what() + "): its connection is shut down");
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
      Fail(llm_datadist::LLM_FEATURE_NOT_ENABLED, "no reverse channel from this reader to revoke a lease on: read by request");
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
    if (moved) Fail(llm_datadist::LLM_KV_CACHE_NOT_EXIST, "cache " + std::to_string(e.id) + " is going: read by request");
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

namespace datadist {
namespace nixl {

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
      out.push_back({reinterpret_cast<void *>(static_cast<uintptr_t>(b + req.offsets[j])),
                     static_cast<size_t>(req.lengths[j])});
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
  const wire::Header h = ch.call(wire::kNixlMdRequest, [](uint32_t rid) { return wire::EncodeEmpty(wire::kNixlMdRequest, rid); },
                                 payload, deadline);
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
    h = ch.call(wire::kNixlLease, [&q](uint32_t rid) { return wire::EncodeNixlLease(q, rid); }, payload, deadline);
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
  const wire::Header h =
      ch.call(wire::kNixlRead, [&q](uint32_t rid) { return wire::EncodeRequest(wire::kNixlRead, q, rid); }, payload, deadline);
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
  const wire::Header h =
      ch.call(wire::kNixlWrite, [&q](uint32_t rid) { return wire::EncodeRequest(wire::kNixlWrite, q, rid); }, payload, deadline);
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
