#include <dirent.h>
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "errors.h"
#include "metrics.h"
#include "nixl.h"
#include "nixl_capi.h"
#include "verify.h"

namespace datadist {
namespace nixl {

namespace capi {

Api api;

void Check(Status s, const std::string &what) {
  if (s != kOk)
    Fail(llm_datadist::LLM_FEATURE_NOT_ENABLED, "NIXL " + what + " failed (status " + std::to_string(s) + ")");
}

}  // namespace capi

using namespace capi;  // NOLINT: the C API's table and types (nixl_capi.h)

namespace {

std::mutex load_mu;
int loaded = 0;  // 0: not tried, 1: loaded, -1: failed
std::string load_why;
std::string loaded_version;

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

// UCX transports whose remote accesses the hardware checks against a registration's memory key,
// and those that serve no remote access at all (the same set as core/nixl_wheel.py's KEY_CHECKED_TLS).
const std::set<std::string> kKeyCheckedTls = {"ib",       "rc",      "rc_v",      "rc_x",      "rc_verbs", "rc_mlx5",
                                              "dc",       "dc_x",    "dc_mlx5",   "ud",        "ud_v",     "ud_x",
                                              "ud_verbs", "ud_mlx5", "cuda_copy", "rocm_copy", "gdr_copy"};
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

/// "1.5.1" -> {1, 5, 1}; false unless it starts with three dot-separated numbers (a suffix
/// such as ".post1" or "rc1" after them is ignored).
bool ParseVersion(const std::string &text, int out[3]) {
  size_t pos = 0;
  for (int i = 0; i < 3; ++i) {
    if (i > 0) {
      if (pos >= text.size() || text[pos] != '.') return false;
      ++pos;
    }
    const size_t start = pos;
    long v = 0;
    while (pos < text.size() && std::isdigit(static_cast<unsigned char>(text[pos])) && pos - start < 6)
      v = v * 10 + (text[pos++] - '0');
    if (pos == start) return false;
    out[i] = static_cast<int>(v);
  }
  return true;
}

bool Before(const int a[3], const int b[3]) { return std::lexicographical_compare(a, a + 3, b, b + 3); }

std::string Dirname(const std::string &path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
}

std::string Basename(const std::string &path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

bool EndsWith(const std::string &s, const std::string &tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

/// The path the dynamic loader opened for `lib` (a bare soname resolves on its search path):
/// the file that holds one of its functions; `asked` when that cannot be told.
std::string LoadedPath(void *lib, const std::string &asked) {
  Dl_info info{};
  void *sym = dlsym(lib, "nixl_capi_create_configured_agent");
  if (sym != nullptr && dladdr(sym, &info) != 0 && info.dli_fname != nullptr && *info.dli_fname) return info.dli_fname;
  return asked;
}

}  // namespace

std::string WheelVersion(const std::string &library) {
  char *real = realpath(library.c_str(), nullptr);
  if (real == nullptr) return "";
  const std::string folder = Dirname(real);
  free(real);
  // The module the wheel installs: .nixl_cu12.mesonpy.libs (meson-python), nixl_cu12.libs
  // (auditwheel), or the package folder nixl_cu12 itself.
  std::string module = Basename(folder);
  if (!module.empty() && module[0] == '.') module.erase(0, 1);
  for (const char *suffix : {".mesonpy.libs", ".libs"})
    if (EndsWith(module, suffix)) {
      module.erase(module.size() - std::strlen(suffix));
      break;
    }
  if (module.empty()) return "";
  const std::string site = Dirname(folder);
  DIR *d = opendir(site.c_str());
  if (d == nullptr) return "";
  std::string version;
  while (dirent *ent = readdir(d)) {
    const std::string name = ent->d_name;
    if (name.compare(0, module.size() + 1, module + "-") != 0 || !EndsWith(name, ".dist-info")) continue;
    std::ifstream meta(site + "/" + name + "/METADATA");
    for (std::string line; std::getline(meta, line);) {
      if (line.empty()) break;  // the headers end at the first empty line
      if (line.compare(0, 9, "Version: ") == 0) {
        version = Trim(line.substr(9));
        break;
      }
    }
    if (!version.empty()) break;
  }
  closedir(d);
  return version;
}

std::string VersionRefusal(const std::string &version) {
  int v[3], lo[3], end[3];
  ParseVersion(kMinVersion, lo);
  ParseVersion(kEndVersion, end);
  const std::string range = std::string(">= ") + kMinVersion + ", < " + kEndVersion;
  if (!ParseVersion(version, v))
    return "NIXL's version " + (version.empty() ? std::string("is unknown") : "'" + version + "' is not a version") +
           ": the core calls NIXL's C API only in the releases it was written against (" + range + ")";
  if (Before(v, lo) || !Before(v, end))
    return "NIXL " + version + " is outside the releases whose C API the core was written against (" + range +
           "): its C API (the header of NIXL's Rust bindings) is not a stable ABI; pip install 'nixl-cu12" + range +
           "'";
  return "";
}

namespace {

/// Why the NIXL C API library at `where` is not a release the core calls ("" when it is);
/// `version` gets its version.
std::string CheckVersion(const std::string &where, std::string *version) {
  const char *stated = std::getenv(kVersionEnv);
  *version = stated && *stated ? stated : WheelVersion(where);
  if (version->empty())
    return "cannot tell the version of NIXL's C API at " + where + ": no nixl wheel's dist-info beside it (for a " +
           "NIXL not installed from the nixl-cu12 wheel, set " + kVersionEnv + " to its version)";
  const std::string why = VersionRefusal(*version);
  return why.empty() ? "" : why + " (" + where + ")";
}

}  // namespace

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
    // The version first: a path is checked before the library is loaded at all; a bare name
    // (found on the loader's search path) once loaded, where the loader found it.
    std::string version, refused;
    const bool named = path.find('/') == std::string::npos;
    if (!named) refused = CheckVersion(path, &version);
    void *lib = refused.empty() ? dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL) : nullptr;
    if (lib != nullptr && named) refused = CheckVersion(LoadedPath(lib, path), &version);
    if (!refused.empty()) {
      load_why = refused;
      loaded = -1;  // a library loaded by name stays loaded (NIXL does not expect to be unloaded), never called
    } else if (lib == nullptr) {
      const char *err = dlerror();
      load_why = "cannot load NIXL's C API (" + path + "): " + (err ? err : "dlopen failed");
      loaded = -1;
    } else {
      loaded_version = version;
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

std::string LoadedVersion() {
  std::lock_guard<std::mutex> lock(load_mu);
  return loaded > 0 ? loaded_version : "";
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

}  // namespace nixl
}  // namespace datadist
