// NIXL's C API as the core calls it: the table of functions Load resolves (nixl_load.cc) and the
// types they take. Internal to the nixl_*.cc files (nixl.h is the core's interface); the one
// place NIXL's ABI is written down.
#ifndef DATADIST_CPP_NIXL_CAPI_H_
#define DATADIST_CPP_NIXL_CAPI_H_

#include <cstddef>
#include <cstdint>
#include <string>

namespace datadist {
namespace nixl {
namespace capi {

// ---- NIXL's C API, as declared by its Rust bindings' wrapper (src/bindings/rust/wrapper.h of
// ai-dynamo/nixl; nixl-cu12 1.5.1's libnixl_capi.so). Handles are opaque pointers; every call
// returns a status: 0 success, 1 in progress, negative an error.
using Status = int;
constexpr Status kOk = 0, kInProgress = 1;
constexpr int kDram = 0, kVram = 1;  // nixl_capi_mem_type_t: NIXL_CAPI_MEM_DRAM, NIXL_CAPI_MEM_VRAM
constexpr int kRead = 0;             // nixl_capi_xfer_op_t (kWrite = 1)
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
  Status (*post_xfer_req)(H, H, H);  // 0 done, 1 in progress
  Status (*get_xfer_status)(H, H);   // 0 done, 1 in progress
  Status (*release_xfer_req)(H, H);
  Status (*destroy_xfer_req)(H);
};

/// The table, filled by Load (nixl_load.cc) before any agent is made.
extern Api api;

/// Throws LLM_FEATURE_NOT_ENABLED naming `what` unless `s` is kOk.
void Check(Status s, const std::string &what);

}  // namespace capi
}  // namespace nixl
}  // namespace datadist

#endif  // DATADIST_CPP_NIXL_CAPI_H_
