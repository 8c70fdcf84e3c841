// datadist's C++ API: the names, signatures, structs, enums, option keys and status codes of
// CANN's llm_datadist/llm_datadist.h, for ordinary Linux hosts (host memory, TCP). A program
// written against CANN's header compiles against this one and links with -lllm_datadist.
// Written for datadist (docs/cpp.md); not CANN's code.
#ifndef DATADIST_LLM_DATADIST_LLM_DATADIST_H_
#define DATADIST_LLM_DATADIST_LLM_DATADIST_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "external/ge_common/ge_api_error_codes.h"
#include "llm_datadist/llm_error_codes.h"

#ifdef FUNC_VISIBILITY
#define ASCEND_FUNC_VISIBILITY __attribute__((visibility("default")))
#else
#define ASCEND_FUNC_VISIBILITY
#endif

namespace llm_datadist {
namespace {
constexpr uint8_t kDefaultTensorNumPerLayer = 2U;
}
using Status = ge::Status;
using AscendString = ge::AscendString;
using DataType = ge::DataType;

// Option keys of Initialize / SetRole (they differ from the Python API's keys).
constexpr const char OPTION_LISTEN_IP_INFO[] = "llm.ListenIpInfo";               // "ip:port", "[ipv6]:port"
constexpr const char OPTION_DEVICE_ID[] = "llm.DeviceId";                        // accepted, unused
constexpr const char OPTION_SYNC_CACHE_WAIT_TIME[] = "llm.SyncKvCacheWaitTime";  // ms, default 1000
constexpr const char OPTION_BUF_POOL_CFG[] = "llm.BufPoolCfg";                   // accepted, unused
constexpr const char OPTION_ENABLE_SET_ROLE[] = "llm.EnableSwitchRole";          // accepted
constexpr const char OPTION_LOCAL_COMM_RES[] = "llm.LocalCommRes";       // checked when linking, as CANN (docs/cpp.md)
constexpr const char OPTION_TRANSFER_BACKEND[] = "llm.TransferBackend";  // "hixl" accepted
constexpr const char OPTION_GLOBAL_RESOURCE_CONFIG[] = "llm.GlobalResourceConfig";  // accepted
// datadist extras (not CANN's; the Python API's option keys too, docs/cpp.md).
// "1": every pull is checked end to end: the owner sends zlib's CRC-32 of what it read, this
// side compares it with what landed; a mismatch is LLM_SUSPECT_REMOTE_ERROR (ge's 507057)
// and consumes nothing. Unset: DATADIST_VERIFY_CHECKSUM; default "0".
constexpr const char OPTION_DATADIST_VERIFY_CHECKSUM[] = "datadist.VerifyChecksum";
// datadist extensions (not in CANN's header), the Python package's option keys: mutual TLS on
// every link, both ways (docs/cpp.md, docs/security.md). Paths of PEM files: this process's
// certificate, its key, and the CA that signs every peer's; all three or none (else
// DATADIST_TLS_CERT / DATADIST_TLS_KEY / DATADIST_TLS_CA). Initialize answers LLM_PARAM_INVALID
// for a file it cannot read or load, or some but not all of them, and LLM_FEATURE_NOT_ENABLED
// when the library was built without OpenSSL.
constexpr const char OPTION_DATADIST_TLS_CERT[] = "datadist.TlsCert";
constexpr const char OPTION_DATADIST_TLS_KEY[] = "datadist.TlsKey";
constexpr const char OPTION_DATADIST_TLS_CA[] = "datadist.TlsCa";
// datadist extensions: serving NIXL readers (docs/cpp.md, docs/security.md "The NIXL path"),
// the Python package's option keys. "1" / "0" (else DATADIST_NIXL_SERVE /
// DATADIST_NIXL_ALLOW_WHOLE_PROCESS_ACCESS; default "0"): serve NIXL (this process's agent
// metadata, NIXL grants and leases; needs remote cache access, which this library always
// allows), and allow it where a NIXL peer could reach the whole process (every UCX transport:
// docs/security.md). NIXL's C API is loaded at run time from OPTION_DATADIST_NIXL_LIBRARY (else
// DATADIST_NIXL_LIBRARY, else "libnixl_capi.so" on the loader's path; the nixl-cu12 wheel
// ships it); when it cannot be loaded, readers are refused (LLM_FEATURE_NOT_ENABLED, why).
constexpr const char OPTION_DATADIST_NIXL_SERVE[] = "datadist.NixlServe";
constexpr const char OPTION_DATADIST_NIXL_WHOLE_PROCESS[] = "datadist.NixlAllowWholeProcessAccess";
constexpr const char OPTION_DATADIST_NIXL_LIBRARY[] = "datadist.NixlLibrary";

// Status codes: the values of Python's datadist.LLMStatusCode. The LLM_* codes are
// llm_datadist/llm_error_codes.h's ge::LLM_* (one constant under both names, so code that uses
// both namespaces sees no ambiguity); LLM_SUCCESS / LLM_FAILED are this header's own.
constexpr Status LLM_SUCCESS = 0x0U;
constexpr Status LLM_FAILED = 0xFFFFFFFFU;
using ge::LLM_ALREADY_LINK;
using ge::LLM_CLUSTER_NUM_EXCEED_LIMIT;
using ge::LLM_DEVICE_OUT_OF_MEMORY;
using ge::LLM_EXIST_LINK;
using ge::LLM_FEATURE_NOT_ENABLED;
using ge::LLM_KV_CACHE_NOT_EXIST;
using ge::LLM_LINK_BUSY;
using ge::LLM_LINK_FAILED;
using ge::LLM_NOT_YET_LINK;
using ge::LLM_NOTIFY_PROMPT_UNLINK_FAILED;
using ge::LLM_OUT_OF_MEMORY;
using ge::LLM_PARAM_INVALID;
using ge::LLM_PROCESSING_LINK;
using ge::LLM_TIMEOUT;
using ge::LLM_UNLINK_FAILED;
using ge::LLM_WAIT_PROC_TIMEOUT;

// Element types, reachable both as ge::DT_* and llm_datadist::DT_*.
using ge::DT_BF16;
using ge::DT_BOOL;
using ge::DT_COMPLEX128;
using ge::DT_COMPLEX32;
using ge::DT_COMPLEX64;
using ge::DT_DOUBLE;
using ge::DT_DUAL;
using ge::DT_DUAL_SUB_INT8;
using ge::DT_DUAL_SUB_UINT8;
using ge::DT_FLOAT;
using ge::DT_FLOAT16;
using ge::DT_FLOAT4_E1M2;
using ge::DT_FLOAT4_E2M1;
using ge::DT_FLOAT6_E2M3;
using ge::DT_FLOAT6_E3M2;
using ge::DT_FLOAT8_E4M3FN;
using ge::DT_FLOAT8_E5M2;
using ge::DT_FLOAT8_E8M0;
using ge::DT_HIFLOAT8;
using ge::DT_INT16;
using ge::DT_INT2;
using ge::DT_INT32;
using ge::DT_INT4;
using ge::DT_INT64;
using ge::DT_INT8;
using ge::DT_QINT16;
using ge::DT_QINT32;
using ge::DT_QINT8;
using ge::DT_QUINT16;
using ge::DT_QUINT8;
using ge::DT_RESOURCE;
using ge::DT_STRING;
using ge::DT_STRING_REF;
using ge::DT_UINT1;
using ge::DT_UINT16;
using ge::DT_UINT2;
using ge::DT_UINT32;
using ge::DT_UINT64;
using ge::DT_UINT8;
using ge::DT_UNDEFINED;
using ge::DT_VARIANT;

struct IpInfo {
  AscendString ip;
  uint16_t port = 0U;
  uint8_t reserved[128];
};

struct ClusterInfo {
  uint64_t remote_cluster_id = 0U;
  int32_t remote_role_type = 0;
  std::vector<IpInfo> local_ip_infos;
  std::vector<IpInfo> remote_ip_infos;
  uint8_t reserved[128];
};

enum class LlmRole : int32_t { kPrompt = 1, kDecoder = 2, kMix = 3, kEnd };

/// Names a remote cache: the peer's cluster id, its cache id, and a batch index (dim 0).
struct CacheIndex {
  uint64_t cluster_id;
  int64_t cache_id;
  uint32_t batch_index;
  uint8_t reserved[128];
};

enum class CachePlacement : uint32_t {
  kHost = 0U,
  kDevice = 1U,
};

/// num_tensors tensors of one shape; dim 0 counts batch slots or blocks.
struct CacheDesc {
  CachePlacement placement = CachePlacement::kDevice;
  uint32_t num_tensors = 0U;
  DataType data_type = DT_UNDEFINED;
  std::vector<int64_t> shape;
  uint8_t reserved[128];
};

struct Cache {
  int64_t cache_id = -1;
  std::vector<uintptr_t> tensor_addrs;
  CacheDesc cache_desc;
  uint8_t reserved[128];
};

/// Layer ranges are inclusive pairs; {-1, -1} means all tensors. Layer l is tensors
/// l * tensor_num_per_layer .. (l + 1) * tensor_num_per_layer - 1.
struct KvCacheExtParam {
  std::pair<int32_t, int32_t> src_layer_range = {-1, -1};
  std::pair<int32_t, int32_t> dst_layer_range{-1, -1};
  uint8_t tensor_num_per_layer = kDefaultTensorNumPerLayer;
  uint8_t reserved[127];
};

struct RegisterCfg {
  uint8_t reserved[128] = {0};
};

/// datadist extension: one series of the process's transfer metrics (docs/cpp.md, "Metrics"),
/// the Python package's datadist.metrics() entry: what this process did with or for one peer.
struct TransferMetrics {
  /// "pull", "push" (this process asked the peer), "serve_read", "serve_write" (the peer asked
  /// this process), "serve_lease" (whole-cache leases granted; the reads under them are the
  /// reader's to count)
  std::string op;
  uint64_t cluster_id = 0U;  // the peer
  uint64_t transfers = 0U;   // ended, in any way
  uint64_t bytes = 0U;       // moved by those that succeeded
  double seconds = 0.0;      // their durations, summed
  /// (upper bound in seconds, transfers that took at most that long): cumulative, 10 us .. 100 s
  std::vector<std::pair<double, uint64_t>> latency_buckets;
  std::map<std::string, uint64_t> errors;  // failed transfers per status name ("LLM_TIMEOUT")
};

/// One instance per cluster id. Every method returns a Status and never throws; transfers
/// block until done or until llm.SyncKvCacheWaitTime passes (LLM_TIMEOUT). Thread-safe.
class ASCEND_FUNC_VISIBILITY LlmDataDist {
 public:
  LlmDataDist(uint64_t cluster_id, LlmRole role);
  ~LlmDataDist();

  Status Initialize(const std::map<AscendString, AscendString> &options);
  void Finalize();
  Status SetRole(LlmRole role, const std::map<AscendString, AscendString> &options = {});

  Status LinkLlmClusters(const std::vector<ClusterInfo> &clusters, std::vector<Status> &rets,
                         int32_t timeout_in_millis = 1000);
  Status UnlinkLlmClusters(const std::vector<ClusterInfo> &clusters, std::vector<Status> &rets,
                           int32_t timeout_in_millis = 1000, bool force_flag = false);
  /// datadist extra: why the last LinkLlmClusters to `remote_cluster_id` failed (its code is
  /// LLM_LINK_FAILED whatever the reason), empty when it has not failed since it last
  /// succeeded. Each failure is also told on stderr unless DATADIST_LINK_WARNINGS=0.
  AscendString LastLinkFailure(uint64_t remote_cluster_id) const;
  /// datadist extension: the process's transfer metrics, one entry per (op, peer) with a
  /// transfer counted (every instance in the process counts in the same place). Never blocks.
  Status GetMetrics(std::vector<TransferMetrics> &metrics) const;
  /// datadist extension: zeroes the process's transfer metrics (tests).
  static void ResetMetrics();
  /// datadist extension: the linked peer's own metrics, as the JSON it answers STATS with
  /// (docs/protocol.md): {"cluster_id", "role", "total", "links"}. Blocks up to the timeout;
  /// LLM_NOT_YET_LINK, LLM_TIMEOUT, LLM_LINK_FAILED, or a peer without STATS.
  Status GetPeerMetrics(uint64_t remote_cluster_id, std::string &json, int32_t timeout_in_millis = 1000);

  Status AllocateCache(const CacheDesc &cache_desc, Cache &cache);
  Status DeallocateCache(int64_t cache_id);

  Status PullKvCache(const CacheIndex &src_cache_index, const Cache &dst_cache, uint32_t batch_index = 0U,
                     int64_t size = -1, const KvCacheExtParam &ext_param = {});
  Status PullKvBlocks(const CacheIndex &src_cache_index, const Cache &dst_cache,
                      const std::vector<uint64_t> &src_blocks, const std::vector<uint64_t> &dst_blocks,
                      const KvCacheExtParam &ext_param = {});

  Status CopyKvCache(const Cache &src_cache, const Cache &dst_cache, uint32_t src_batch_index = 0U,
                     uint32_t dst_batch_index = 0U, uint64_t offset = 0U, int64_t size = -1);
  Status CopyKvBlocks(const Cache &src_cache, const Cache &dst_cache, const std::vector<uint64_t> &src_blocks,
                      const std::vector<std::vector<uint64_t>> &dst_blocks_list);

  Status PushKvCache(const Cache &src_cache, const CacheIndex &dst_cache_index, uint32_t src_batch_index = 0U,
                     int64_t size = -1, const KvCacheExtParam &ext_param = {});
  Status PushKvBlocks(const Cache &src_cache, const CacheIndex &dst_cache_index,
                      const std::vector<uint64_t> &src_blocks, const std::vector<uint64_t> &dst_blocks,
                      const KvCacheExtParam &ext_param = {});

  Status RegisterKvCache(const CacheDesc &cache_desc, const std::vector<uint64_t> &addrs, const RegisterCfg &cfg,
                         int64_t &cache_id);
  Status UnregisterKvCache(int64_t cache_id);

 private:
  class LlmDataDistImpl;
  std::unique_ptr<LlmDataDistImpl> impl_;
};

// datadist extensions (not in CANN's header; docs/cpp.md, "Why a call failed"): the reason
// behind a returned Status, in this header's words (option keys such as llm.ListenIpInfo /
// OPTION_LISTEN_IP_INFO, never the Python API's names), sizes in bytes with KiB / MiB / GiB
// beside them. Without them a caller sees the code alone (or sets DATADIST_CPP_LOG=1 for
// stderr).

/// Why the last LlmDataDist call on this thread failed: "<Method> failed (<code name>, <code
/// in hex>): <reason>"; "" when it succeeded. Every LlmDataDist method that returns a Status
/// (and Finalize) clears it when it starts and fills it when it returns a code other than
/// LLM_SUCCESS (LinkLlmClusters and
/// UnlinkLlmClusters name each cluster that failed, with its code). The pointer stays valid
/// until this thread's next LlmDataDist call. Never blocks, never fails.
ASCEND_FUNC_VISIBILITY const char *GetLastErrorMessage();

/// How serious a message given to the log callback is.
enum class LogLevel : int32_t { kInfo = 0, kWarning = 1, kError = 2 };
/// Receives datadist's messages for the application's own log: kError, every failed call's
/// text (as GetLastErrorMessage); kWarning, what a call that succeeded has to say (a link
/// filed under another cluster id than the one asked for). Called on the thread that has the
/// message (LinkLlmClusters' links run on threads of their own), possibly on several at once;
/// `message` is valid during the call only. It must not call LlmDataDist methods.
using LogCallback = void (*)(LogLevel level, const char *message, void *user_data);
/// Sets the process's log callback (nullptr: none, the default) and the pointer passed back
/// to it. Thread-safe; a message being delivered may still reach the previous callback.
ASCEND_FUNC_VISIBILITY void SetLogCallback(LogCallback callback, void *user_data = nullptr);
}  // namespace llm_datadist

#endif  // DATADIST_LLM_DATADIST_LLM_DATADIST_H_
