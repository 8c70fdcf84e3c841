// The facade: LlmDataDist's entry points. Checks arguments, builds plans, and turns every
// internal Error into the returned Status in one place (Guard). Never throws.
#include "llm_datadist/llm_datadist.h"

#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <utility>

#include "addr.h"
#include "auth.h"
#include "engine.h"
#include "errors.h"
#include "link.h"
#include "local.h"
#include "metrics.h"
#include "options.h"
#include "plan.h"
#include "pool.h"
#include "registry.h"
#include "server.h"
#include "session.h"
#include "tls.h"

namespace llm_datadist {

using datadist::Deadline;
using datadist::Error;
using datadist::Fail;
using datadist::Invalid;

namespace {

constexpr double kUnregisterWait = 30.0;  // s UnregisterKvCache waits for transfers in flight
constexpr double kFinalizeWait = 5.0;     // s Finalize waits for them

using datadist::LogEnabled;

// GetLastErrorMessage's text, per thread; SetLogCallback's callback, per process.
thread_local std::string t_last_error;
std::mutex g_log_mu;
LogCallback g_log_callback = nullptr;
void *g_log_user_data = nullptr;

const char *CodeName(Status code) {
  switch (code) {
    case LLM_SUCCESS: return "LLM_SUCCESS";
    case LLM_FAILED: return "LLM_FAILED";
    case ge::LLM_WAIT_PROC_TIMEOUT: return "LLM_WAIT_PROC_TIMEOUT";
    case ge::LLM_KV_CACHE_NOT_EXIST: return "LLM_KV_CACHE_NOT_EXIST";
    case ge::LLM_REPEAT_REQUEST: return "LLM_REPEAT_REQUEST";
    case ge::LLM_REQUEST_ALREADY_COMPLETED: return "LLM_REQUEST_ALREADY_COMPLETED";
    case ge::LLM_PARAM_INVALID: return "LLM_PARAM_INVALID";
    case ge::LLM_ENGINE_FINALIZED: return "LLM_ENGINE_FINALIZED";
    case ge::LLM_NOT_YET_LINK: return "LLM_NOT_YET_LINK";
    case ge::LLM_ALREADY_LINK: return "LLM_ALREADY_LINK";
    case ge::LLM_LINK_FAILED: return "LLM_LINK_FAILED";
    case ge::LLM_UNLINK_FAILED: return "LLM_UNLINK_FAILED";
    case ge::LLM_NOTIFY_PROMPT_UNLINK_FAILED: return "LLM_NOTIFY_PROMPT_UNLINK_FAILED";
    case ge::LLM_CLUSTER_NUM_EXCEED_LIMIT: return "LLM_CLUSTER_NUM_EXCEED_LIMIT";
    case ge::LLM_PROCESSING_LINK: return "LLM_PROCESSING_LINK";
    case ge::LLM_DEVICE_OUT_OF_MEMORY: return "LLM_DEVICE_OUT_OF_MEMORY";
    case ge::LLM_PREFIX_ALREADY_EXIST: return "LLM_PREFIX_ALREADY_EXIST";
    case ge::LLM_PREFIX_NOT_EXIST: return "LLM_PREFIX_NOT_EXIST";
    case ge::LLM_SEQ_LEN_OVER_LIMIT: return "LLM_SEQ_LEN_OVER_LIMIT";
    case ge::LLM_NO_FREE_BLOCK: return "LLM_NO_FREE_BLOCK";
    case ge::LLM_BLOCKS_OUT_OF_MEMORY: return "LLM_BLOCKS_OUT_OF_MEMORY";
    case ge::LLM_CACHE_INCOMPATIBLE: return "LLM_CACHE_INCOMPATIBLE";
    case ge::LLM_CACHE_KEY_ALREADY_EXIST: return "LLM_CACHE_KEY_ALREADY_EXIST";
    case ge::LLM_COPY_CACHE_FAILED: return "LLM_COPY_CACHE_FAILED";
    case ge::LLM_CACHE_ID_ALREADY_EXIST: return "LLM_CACHE_ID_ALREADY_EXIST";
    case ge::LLM_EXIST_LINK: return "LLM_EXIST_LINK";
    case ge::LLM_FEATURE_NOT_ENABLED: return "LLM_FEATURE_NOT_ENABLED";
    case ge::LLM_TIMEOUT: return "LLM_TIMEOUT";
    case ge::LLM_LINK_BUSY: return "LLM_LINK_BUSY";
    case ge::LLM_OUT_OF_MEMORY: return "LLM_OUT_OF_MEMORY";
    case datadist::kSuspectRemoteError: return "LLM_SUSPECT_REMOTE_ERROR";
    case datadist::kDeviceMemError: return "LLM_DEVICE_MEM_ERROR";
    default: return "status";
  }
}

// "1536" -> "1.5 KiB": the unit that keeps the number below 1024, one decimal.
std::string HumanBytes(uint64_t n) {
  static const char *const kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(n);
  int unit = -1;
  while (v >= 1024.0 && unit < 5) {
    v /= 1024.0;
    ++unit;
  }
  char buf[32];
  if (v == static_cast<double>(static_cast<uint64_t>(v)))
    std::snprintf(buf, sizeof buf, "%.0f %s", v, kUnits[unit < 0 ? 0 : unit]);
  else
    std::snprintf(buf, sizeof buf, "%.1f %s", v, kUnits[unit < 0 ? 0 : unit]);
  return buf;
}

// Every "<N> bytes" of 1024 or more in `text` gains its size in KiB / MiB / ... beside it
// ("1048576 bytes (1 MiB)"), unless a parenthesis follows already.
std::string WithReadableSizes(const std::string &text) {
  static const std::string kBytes = " bytes";
  std::string out;
  size_t i = 0;
  while (i < text.size()) {
    if (!std::isdigit(static_cast<unsigned char>(text[i])) ||
        (i > 0 && std::isalnum(static_cast<unsigned char>(text[i - 1])))) {
      out += text[i++];
      continue;
    }
    size_t end = i;
    while (end < text.size() && std::isdigit(static_cast<unsigned char>(text[end]))) ++end;
    out.append(text, i, end - i);
    const bool bytes =
        text.compare(end, kBytes.size(), kBytes) == 0 &&
        (end + kBytes.size() == text.size() || !std::isalnum(static_cast<unsigned char>(text[end + kBytes.size()])));
    if (bytes && end - i <= 19) {
      const uint64_t n = std::strtoull(text.c_str() + i, nullptr, 10);
      const size_t after = end + kBytes.size();
      out += kBytes;
      if (n >= 1024 && text.compare(after, 2, " (") != 0) out += " (" + HumanBytes(n) + ")";
      end = after;
    }
    i = end;
  }
  return out;
}

// The core writes a few hints in the Python API's words (its first face): the C++ caller
// reads this header's names instead. Each pair: Python's phrase, the C++ API's.
std::string InCppWords(std::string text) {
  static const std::pair<const char *, const char *> kPhrases[] = {
      {"LLMConfig.listen_ip_info = 'ip:port'", "llm.ListenIpInfo (OPTION_LISTEN_IP_INFO) = \"ip:port\" at Initialize"},
      {"its LLMConfig.listen_ip_info names", "its llm.ListenIpInfo (OPTION_LISTEN_IP_INFO) names"},
      {"enable_remote_cache_accessible", "llm.EnableRemoteCacheAccessible"},
  };
  for (const auto &phrase : kPhrases) {
    const std::string from = phrase.first;
    for (size_t at = text.find(from); at != std::string::npos; at = text.find(from, at + std::strlen(phrase.second)))
      text.replace(at, from.size(), phrase.second);
  }
  return WithReadableSizes(text);
}

// To the log callback, if one is set (SetLogCallback). Never throws.
void Tell(LogLevel level, const std::string &text) {
  LogCallback callback;
  void *user_data;
  {
    std::lock_guard<std::mutex> lock(g_log_mu);
    callback = g_log_callback;
    user_data = g_log_user_data;
  }
  if (callback != nullptr) callback(level, text.c_str(), user_data);
}

// A call of this API failed with `code` because of `why` (the core's words): the thread's
// last error, the log callback, and stderr with DATADIST_CPP_LOG. Never throws.
void Record(const char *func, Status code, const std::string &why) {
  try {
    char num[16];
    std::snprintf(num, sizeof num, "0x%X", code);
    t_last_error = std::string(func) + " failed (" + CodeName(code) + ", " + num + ")" +
                   (why.empty() ? std::string() : ": " + InCppWords(why));
    Tell(LogLevel::kError, t_last_error);
    if (LogEnabled()) std::fprintf(stderr, "[datadist] %s\n", t_last_error.c_str());
  } catch (const std::exception &) {  // out of memory: the code alone
  }
}

// Runs `fn`, turning whatever it throws into a status and `why`.
template <typename F>
Status Run(F &&fn, std::string &why) {
  try {
    fn();
    return LLM_SUCCESS;
  } catch (const Error &e) {
    why = e.what();
    return e.code();
  } catch (const std::bad_alloc &) {
    why = "out of memory";
    return LLM_OUT_OF_MEMORY;
  } catch (const std::exception &e) {
    why = e.what();
    return LLM_FAILED;
  }
}

// Every entry point: clears the thread's last error, runs `fn`, and records a failure.
template <typename F>
Status Guard(const char *func, F &&fn) {
  t_last_error.clear();
  std::string why;
  const Status s = Run(std::forward<F>(fn), why);
  if (s != LLM_SUCCESS) Record(func, s, why);
  return s;
}

// A call that succeeded has something to say (a link filed under another cluster id): the
// log callback, and stderr unless DATADIST_LINK_WARNINGS=0 (as a link's failure). Never throws.
void Warn(const std::string &text) {
  try {
    const std::string words = InCppWords(text);
    Tell(LogLevel::kWarning, words);
    const char *env = std::getenv("DATADIST_LINK_WARNINGS");
    if (env == nullptr || std::string(env) != "0") std::fprintf(stderr, "[datadist] warning: %s\n", words.c_str());
  } catch (const std::exception &) {
  }
}

const char *Find(const std::map<AscendString, AscendString> &options, const char *key) {
  auto it = options.find(AscendString(key));
  return it == options.end() ? nullptr : it->second.GetString();
}

// The options as the option table reads them (options.h): keys and values as text.
std::map<std::string, std::string> Strings(const std::map<AscendString, AscendString> &options) {
  std::map<std::string, std::string> out;
  for (const auto &kv : options) out[kv.first.GetString()] = kv.second.GetString();
  return out;
}

// JSON syntax (RFC 8259) of one value at `i`, nesting at most kMaxDepth deep; advances `i`.
class JsonScan {
 public:
  explicit JsonScan(const std::string &s) : s_(s) {}
  /// The whole text is one JSON object (whitespace around it allowed).
  bool IsObject() {
    Space();
    if (i_ >= s_.size() || s_[i_] != '{' || !Value(0)) return false;
    Space();
    return i_ == s_.size();
  }

 private:
  static constexpr int kMaxDepth = 256;
  void Space() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
  }
  bool Lit(const char *word) {
    size_t n = std::strlen(word);
    if (s_.compare(i_, n, word) != 0) return false;
    i_ += n;
    return true;
  }
  bool Digits() {
    size_t from = i_;
    while (i_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_]))) ++i_;
    return i_ > from;
  }
  bool Number() {
    if (s_[i_] == '-') ++i_;
    if (i_ < s_.size() && s_[i_] == '0') {
      ++i_;
    } else if (!Digits()) {
      return false;
    }
    if (i_ < s_.size() && s_[i_] == '.' && (++i_, !Digits())) return false;
    if (i_ < s_.size() && (s_[i_] == 'e' || s_[i_] == 'E')) {
      ++i_;
      if (i_ < s_.size() && (s_[i_] == '+' || s_[i_] == '-')) ++i_;
      if (!Digits()) return false;
    }
    return true;
  }
  bool String() {
    ++i_;  // the opening quote
    while (i_ < s_.size()) {
      unsigned char c = static_cast<unsigned char>(s_[i_++]);
      if (c == '"') return true;
      if (c < 0x20) return false;
      if (c != '\\') continue;
      if (i_ >= s_.size()) return false;
      char e = s_[i_++];
      if (e == 'u') {
        for (int k = 0; k < 4; ++k, ++i_)
          if (i_ >= s_.size() || !std::isxdigit(static_cast<unsigned char>(s_[i_]))) return false;
      } else if (std::strchr("\"\\/bfnrt", e) == nullptr || e == '\0') {
        return false;
      }
    }
    return false;
  }
  bool Value(int depth) {
    Space();
    if (i_ >= s_.size() || depth > kMaxDepth) return false;
    char c = s_[i_];
    if (c == '"') return String();
    if (c == '{' || c == '[') {
      const char close = c == '{' ? '}' : ']';
      ++i_;
      Space();
      if (i_ < s_.size() && s_[i_] == close) return ++i_, true;
      for (;;) {
        if (c == '{') {
          Space();
          if (i_ >= s_.size() || s_[i_] != '"' || !String()) return false;
          Space();
          if (i_ >= s_.size() || s_[i_++] != ':') return false;
        }
        if (!Value(depth + 1)) return false;
        Space();
        if (i_ >= s_.size()) return false;
        if (s_[i_] == close) return ++i_, true;
        if (s_[i_++] != ',') return false;
      }
    }
    if (c == '-' || std::isdigit(static_cast<unsigned char>(c))) return Number();
    return Lit("true") || Lit("false") || Lit("null");
  }
  std::string s_;
  size_t i_ = 0;
};

void CheckRole(LlmRole role) {
  if (role != LlmRole::kPrompt && role != LlmRole::kDecoder && role != LlmRole::kMix)
    Invalid("role must be kPrompt, kDecoder or kMix");
}

}  // namespace

class LlmDataDist::LlmDataDistImpl {
 public:
  // One worker for asynchronous transfers, never started: CANN's C++ API has none.
  LlmDataDistImpl(uint64_t cluster_id, LlmRole role)
      : session_(cluster_id, static_cast<int32_t>(role), 1), engine_(session_.engine()) {}

  void Initialize(const std::map<AscendString, AscendString> &options) {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_ == kUp) return;  // as CANN: already initialized is a success
    CheckRole(static_cast<LlmRole>(engine_.role()));
    // Every datadist.* option and llm.SyncKvCacheWaitTime, with their environment
    // variables: the option table's one parser, as the Python package's init (options.h).
    const datadist::Options parsed = datadist::ParseOptions(Strings(options), datadist::ProcessEnv());
    sync_timeout_s_ = static_cast<double>(parsed.sync_timeout_ms) / 1000.0;
    hixl_ = false;
    if (const char *v = Find(options, OPTION_TRANSFER_BACKEND)) {
      std::string s = v;
      if (!s.empty() && s != "hixl" && s != "tcp")
        Invalid(std::string(OPTION_TRANSFER_BACKEND) + " must be 'hixl' (accepted; datadist moves bytes over TCP)");
      hixl_ = s == "hixl";
    }
    // CANN's HIXL engine parses OPTION_GLOBAL_RESOURCE_CONFIG at Initialize
    // (HixlOptions::ParseGlobalResourceConfig): empty, or a JSON object. Its fields tune HIXL.
    const char *grc = Find(options, OPTION_GLOBAL_RESOURCE_CONFIG);
    if (hixl_ && grc != nullptr && *grc && !JsonScan(grc).IsObject())
      Invalid(std::string(OPTION_GLOBAL_RESOURCE_CONFIG) + " must be a JSON object, got '" + grc + "'");
    datadist::EngineOptions opts = datadist::ToEngineOptions(parsed);
    verify_ = parsed.verify;
    if (!parsed.tls.empty()) opts.tls = datadist::tls::Context::Load(parsed.tls);
    if (opts.nixl.serve || opts.nixl.read) {
      std::string why;
      // A reader without NIXL fails at Open (LLM_PARAM_INVALID, what to install); an owner
      // tells its readers why when they ask.
      if (!datadist::nixl::Load(parsed.nixl_library.empty() ? "libnixl_capi.so" : parsed.nixl_library, &why) &&
          !opts.nixl.read)
        datadist::Log("serving NIXL asked for, but " + why);
    }
    engine_.Open(opts);
    // Accepted as CANN does; checked when linking, as CANN's default backend parses it then
    // (Engine::SetLocalCommRes). HIXL reads another format there (its endpoint list, version
    // "1.3": hixl's EndpointGenerator), which describes NICs datadist does not use.
    const char *comm_res = Find(options, OPTION_LOCAL_COMM_RES);
    engine_.SetLocalCommRes(comm_res != nullptr && !hixl_, comm_res ? comm_res : "");
    listening_.clear();
    if (const char *v = Find(options, OPTION_LISTEN_IP_INFO)) StartListening(v);
    state_ = kUp;
  }

  void Finalize() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      bool up = state_ == kUp;
      state_ = kDown;
      if (!up) return;
    }
    session_.Close(kFinalizeWait);
  }

  // As CANN's LLMLinkManager::SwitchRole: refused while any link is up (ours, or a peer's to
  // us); with a listen address, listen there (already there: nothing to do); without one,
  // stop listening, whatever the role.
  void SetRole(LlmRole role, const std::map<AscendString, AscendString> &options) {
    std::lock_guard<std::mutex> lock(mu_);
    CheckUp();
    CheckRole(role);
    if (engine_.HasLinks()) Fail(LLM_EXIST_LINK, "cannot switch role while links exist: unlink them first");
    if (const char *v = Find(options, OPTION_LISTEN_IP_INFO)) {
      if (!engine_.listening() || listening_ != v) StartListening(v);
    } else if (engine_.listening()) {
      engine_.StopListening();
      listening_.clear();
    }
    engine_.set_role(static_cast<int32_t>(role));
  }

  // As CANN's LLMLinkManager::LinkClusters / UnlinkClusters: one code per cluster appended to
  // `rets` (what it held stays), and the last failure as the overall code.
  /// The per-cluster codes go to `rets`; `why` says why each that failed did ("" if none).
  Status Link(const std::vector<ClusterInfo> &clusters, std::vector<Status> &rets, int32_t timeout_ms,
              std::string &why) {
    CheckArgs(clusters, timeout_ms);
    // This API's own refusals per cluster, then the rest linked at once by the session.
    std::vector<datadist::Outcome> outcomes(clusters.size());
    std::vector<datadist::Peer> peers;
    std::vector<size_t> linked;  // index in `clusters` of each peer
    for (size_t i = 0; i < clusters.size(); ++i) {
      const ClusterInfo &c = clusters[i];
      const uint64_t id = c.remote_cluster_id;
      if (c.remote_ip_infos.size() != 1) {  // as CANN's LinkMsgHandler::LinkCluster, in this cluster's code
        outcomes[i] = {LLM_PARAM_INVALID, "cluster " + std::to_string(id) + " needs exactly one remote ip info, got " +
                                              std::to_string(c.remote_ip_infos.size())};
        continue;
      }
      if (id == engine_.cluster_id()) {
        outcomes[i] = {LLM_LINK_FAILED, "cannot link to our own cluster id"};
        continue;
      }
      const IpInfo &ip = c.remote_ip_infos.front();
      peers.push_back({id, ip.ip.GetString(), ip.port});
      linked.push_back(i);
    }
    // CANN's LinkMsgHandler::LinkCluster files the link under the cluster id the peer reports
    // (AddEntity(peer_exchange_info.cluster_id)), never comparing it with the one passed: a
    // caller that passed another id finds no link under it (LLM_NOT_YET_LINK). HIXL files it
    // under the id passed (here: it must match).
    const std::vector<datadist::Outcome> done = session_.LinkMany(peers, datadist::After(timeout_ms / 1000.0), !hixl_);
    for (size_t k = 0; k < done.size(); ++k) outcomes[linked[k]] = done[k];
    for (size_t k = 0; k < done.size(); ++k) TellLink(peers[k], done[k]);
    std::vector<Status> codes;
    std::vector<std::string> whys;
    for (const auto &o : outcomes) {
      codes.push_back(o.code);
      whys.push_back(o.why);
    }
    rets.insert(rets.end(), codes.begin(), codes.end());
    why = EachWhy(clusters, codes, whys);
    return Overall(codes);
  }

  // A link's failure on stderr (the engine keeps the reason, LastLinkFailure; it is told here,
  // in this API's words), or a link filed under another id than asked (said, not refused).
  void TellLink(const datadist::Peer &p, const datadist::Outcome &o) {
    if (o.code == LLM_LINK_FAILED) {
      const std::string told = engine_.LastLinkFailure(p.cluster_id);
      const char *env = std::getenv("DATADIST_LINK_WARNINGS");
      if (told.find(o.why) != std::string::npos && (env == nullptr || std::string(env) != "0"))
        std::fprintf(stderr, "[datadist] warning: %s\n", InCppWords(told).c_str());
    }
    if (o.code == LLM_SUCCESS && o.filed != p.cluster_id) {
      const std::string f = std::to_string(o.filed), asked = std::to_string(p.cluster_id);
      Warn("LinkLlmClusters: the listener at " + datadist::FormatHostPort(p.host, p.port) + " answered as cluster " +
           f + ", not the remote_cluster_id " + asked + " asked for; linked as CANN does, under cluster " + f +
           ": name " + f + " in CacheIndex::cluster_id and UnlinkLlmClusters (transfers naming cluster " + asked +
           " answer LLM_NOT_YET_LINK), or fix ClusterInfo::remote_cluster_id");
    }
  }

  /// As Link. CANN's LinkMsgHandler::UnlinkCluster without force dials the peer's listener,
  /// so it needs exactly one remote ip info (HIXL's UnlinkCluster needs none); the session
  /// unlinks both ends (Session::UnlinkMany).
  Status Unlink(const std::vector<ClusterInfo> &clusters, std::vector<Status> &rets, int32_t timeout_ms, bool force,
                std::string &why) {
    CheckArgs(clusters, timeout_ms);
    std::vector<datadist::Outcome> outcomes(clusters.size());
    std::vector<datadist::Peer> peers;
    std::vector<size_t> asked;  // index in `clusters` of each peer
    for (size_t i = 0; i < clusters.size(); ++i) {
      const ClusterInfo &c = clusters[i];
      if (!hixl_ && !force && c.remote_ip_infos.size() != 1) {
        outcomes[i] = {LLM_PARAM_INVALID, "unlink without force needs exactly one remote ip info for cluster " +
                                              std::to_string(c.remote_cluster_id)};
        continue;
      }
      datadist::Peer p{c.remote_cluster_id, "", 0};
      if (c.remote_ip_infos.size() == 1) {
        p.host = c.remote_ip_infos[0].ip.GetString();
        p.port = c.remote_ip_infos[0].port;
      }
      peers.push_back(p);
      asked.push_back(i);
    }
    datadist::UnlinkRule rule;
    rule.force = force;
    rule.hixl = hixl_;
    const std::vector<datadist::Outcome> done = session_.UnlinkMany(peers, datadist::After(timeout_ms / 1000.0), rule);
    for (size_t k = 0; k < done.size(); ++k) outcomes[asked[k]] = done[k];
    std::vector<Status> codes;
    std::vector<std::string> whys;
    for (const auto &o : outcomes) {
      codes.push_back(o.code);
      whys.push_back(o.why);
    }
    rets.insert(rets.end(), codes.begin(), codes.end());
    why = EachWhy(clusters, codes, whys);
    return Overall(codes);
  }

  // "cluster 5 (LLM_LINK_FAILED): why; cluster 6 ...": each failed cluster's reason.
  static std::string EachWhy(const std::vector<ClusterInfo> &clusters, const std::vector<Status> &codes,
                             const std::vector<std::string> &whys) {
    std::string out;
    for (size_t i = 0; i < clusters.size(); ++i)
      if (codes[i] != LLM_SUCCESS)
        out += (out.empty() ? "" : "; ") + std::string("cluster ") + std::to_string(clusters[i].remote_cluster_id) +
               " (" + CodeName(codes[i]) + "): " + whys[i];
    return out;
  }

  void Register(const CacheDesc &desc, const std::vector<uint64_t> &addrs, int64_t &cache_id) {
    CheckUpLocked();
    cache_id = engine_.registry().Add(desc, addrs, {});
  }

  void Unregister(int64_t cache_id) {
    CheckUpLocked();
    engine_.registry().Remove(cache_id, false, kUnregisterWait);
  }

  void Allocate(const CacheDesc &desc, Cache &cache) {
    CheckUpLocked();
    datadist::Geometry g = datadist::GeometryOf(desc);
    // The allocator Python's pools use (pool.h), a pool the size of this cache: one sealed
    // memfd, its tensors page-aligned in it; a same-host reader maps it and copies with
    // memcpy (shm.h). The memory goes with the cache (Registry::Remove).
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    const uint64_t step = (g.tensor_bytes + page - 1) / page * page;
    if (step < g.tensor_bytes || (g.num_tensors && step > UINT64_MAX / g.num_tensors))
      Fail(LLM_OUT_OF_MEMORY,
           "cannot allocate " + std::to_string(g.num_tensors) + " x " + std::to_string(g.tensor_bytes) + " bytes");
    std::vector<uint64_t> addrs;
    datadist::ShmPlace shared;
    std::shared_ptr<datadist::Pool::Allocation> memory;
    try {
      auto pool = datadist::Pool::Create("datadist-cache", step * g.num_tensors, 12);
      memory = pool->AllocateTensors(g.num_tensors, g.tensor_bytes, &addrs, &shared);
    } catch (const datadist::Error &e) {
      Fail(desc.placement == CachePlacement::kDevice ? LLM_DEVICE_OUT_OF_MEMORY : LLM_OUT_OF_MEMORY, e.what());
    }
    int64_t id = engine_.registry().Add(desc, addrs, {}, memory, shared);
    cache.cache_id = id;
    cache.cache_desc = desc;
    cache.tensor_addrs.assign(addrs.begin(), addrs.end());
  }

  void Deallocate(int64_t cache_id) {
    CheckUpLocked();
    engine_.registry().Remove(cache_id, true, kUnregisterWait);
  }

  void PullCache(const CacheIndex &src, const Cache &dst, uint32_t batch_index, int64_t size,
                 const KvCacheExtParam &ext) {
    CheckUpLocked();
    CheckRemote(src);
    if (size != -1 && size <= 0) Invalid("size must be -1 or > 0");
    datadist::CheckExtParam(ext, false);  // before the local cache is looked up, as CANN
    auto lease = engine_.registry().Hold(dst.cache_id);
    const datadist::Geometry &g = lease->entry().geo;
    datadist::Plan plan;
    datadist::PairTensors(plan, g.num_tensors, ext, false);
    datadist::PlanSlot(plan, g, batch_index, size);
    auto req = Request(plan, static_cast<uint64_t>(src.cache_id), src.batch_index, g.layout & ~0xFFFFFFFFULL);
    if (verify_) req.flags |= datadist::wire::kFlagChecksum;
    Move(false, src.cluster_id, std::move(req), plan, *lease);
  }

  void PullBlocks(const CacheIndex &src, const Cache &dst, const std::vector<uint64_t> &src_blocks,
                  const std::vector<uint64_t> &dst_blocks, const KvCacheExtParam &ext) {
    CheckUpLocked();
    CheckRemote(src);
    if (src.batch_index != 0) Invalid("src_cache_index.batch_index must be 0 for PullKvBlocks");
    // As CANN's LLMDataDistV2::PullBlocks: the two lists must match in length, so an empty
    // dst_blocks (blocks into a contiguous cache) is LLM_PARAM_INVALID there too.
    if (dst_blocks.empty()) {
      if (src_blocks.empty()) Invalid("src_blocks and dst_blocks are both empty");
      Invalid("src_blocks has " + std::to_string(src_blocks.size()) + " entries but dst_blocks is empty");
    }
    datadist::CheckExtParam(ext, false);
    auto lease = engine_.registry().Hold(dst.cache_id);
    const datadist::Geometry &g = lease->entry().geo;
    datadist::Plan plan;
    datadist::PairTensors(plan, g.num_tensors, ext, false);
    // Empty src_blocks: the remote slot 0 split into blocks (as Python's pull_blocks from a
    // CacheKeyByIdAndIndex). Otherwise absolute blocks, named as slot 0 of the cache.
    if (src_blocks.empty()) {
      std::vector<uint64_t> remote(dst_blocks.size());
      for (uint64_t i = 0; i < remote.size(); ++i) remote[i] = i;
      datadist::PlanBlocks(plan, g, remote, dst_blocks);
    } else {
      datadist::PlanBlocks(plan, g, src_blocks, dst_blocks);  // read in place, not copied
    }
    auto req = Request(plan, static_cast<uint64_t>(src.cache_id), 0, g.layout);
    if (verify_) req.flags |= datadist::wire::kFlagChecksum;
    Move(false, src.cluster_id, std::move(req), plan, *lease);
  }

  void PushCache(const Cache &src, const CacheIndex &dst, uint32_t src_batch_index, int64_t size,
                 const KvCacheExtParam &ext) {
    CheckUpLocked();
    CheckRemote(dst, false);
    if (size != -1) Invalid("PushKvCache supports size -1 only (as CANN)");
    datadist::CheckExtParam(ext, true);
    auto lease = engine_.registry().Hold(src.cache_id);
    const datadist::Geometry &g = lease->entry().geo;
    datadist::Plan plan;
    datadist::PairTensors(plan, g.num_tensors, ext, true);
    datadist::PlanSlot(plan, g, src_batch_index, size);
    auto req = Request(plan, static_cast<uint64_t>(dst.cache_id), dst.batch_index, g.layout & ~0xFFFFFFFFULL);
    Move(true, dst.cluster_id, std::move(req), plan, *lease);
  }

  void PushBlocks(const Cache &src, const CacheIndex &dst, const std::vector<uint64_t> &src_blocks,
                  const std::vector<uint64_t> &dst_blocks, const KvCacheExtParam &ext) {
    CheckUpLocked();
    CheckRemote(dst, false);
    if (src_blocks.empty()) Invalid("src_blocks must not be empty");
    if (dst.batch_index != 0) Invalid("dst_cache_index.batch_index must be 0 for PushKvBlocks");
    datadist::CheckExtParam(ext, true);
    auto lease = engine_.registry().Hold(src.cache_id);
    const datadist::Geometry &g = lease->entry().geo;
    datadist::Plan plan;
    datadist::PairTensors(plan, g.num_tensors, ext, true);
    datadist::PlanBlocks(plan, g, dst_blocks, src_blocks);
    auto req = Request(plan, static_cast<uint64_t>(dst.cache_id), 0, g.layout);
    Move(true, dst.cluster_id, std::move(req), plan, *lease);
  }

  void CopyCache(const Cache &src, const Cache &dst, uint32_t src_batch, uint32_t dst_batch, uint64_t offset,
                 int64_t size) {
    CheckUpLocked();
    // Planned, held, checked and copied by the session, as Python's copy_cache (PlanSlotCopy).
    datadist::CopySide s, d;
    s.cache_id = src.cache_id;
    d.cache_id = dst.cache_id;
    session_.CopySlot(s, d, src_batch, dst_batch, offset, size);
  }

  void CopyBlocks(const Cache &src, const Cache &dst, const std::vector<uint64_t> &src_blocks,
                  const std::vector<std::vector<uint64_t>> &dst_blocks_list) {
    CheckUpLocked();
    // Translation only: each destination list pairs with src_blocks, the lists one after
    // another as one list of pairs; the session plans it as Python's copy_blocks and
    // swap_blocks (PlanBlockCopy: a destination block named twice, in one list or two, is
    // refused, and within one cache a block both read and written; docs/compatibility.md).
    std::vector<uint64_t> from, to;
    for (const auto &list : dst_blocks_list) {
      if (list.size() != src_blocks.size())
        Invalid("every destination block list must match src_blocks in length (" + std::to_string(list.size()) +
                " and " + std::to_string(src_blocks.size()) + ")");
      from.insert(from.end(), src_blocks.begin(), src_blocks.end());
      to.insert(to.end(), list.begin(), list.end());
    }
    datadist::CopySide s, d;
    s.cache_id = src.cache_id;
    d.cache_id = dst.cache_id;
    session_.CopyBlocks(s, d, from, to);
  }

 private:
  enum State { kNew, kUp, kDown };

  void CheckUp() const {
    if (state_ == kDown)
      Fail(LLM_FAILED, "this LlmDataDist was finalized (Finalize ran): call Initialize again, or use a new one");
    if (state_ != kUp) Fail(LLM_FAILED, "not initialized: call Initialize first");
  }
  void CheckUpLocked() {
    std::lock_guard<std::mutex> lock(mu_);
    CheckUp();
  }
  void CheckArgs(const std::vector<ClusterInfo> &clusters, int32_t timeout_ms) {
    CheckUpLocked();
    if (timeout_ms <= 0) Invalid("timeout must be > 0 ms");
    if (clusters.empty()) Invalid("clusters must not be empty");
    for (const auto &c : clusters)
      for (const auto *infos : {&c.remote_ip_infos, &c.local_ip_infos})
        for (const IpInfo &ip : *infos)
          if (!datadist::IsIpLiteral(ip.ip.GetString()))
            Invalid("cluster " + std::to_string(c.remote_cluster_id) + ": '" + ip.ip.GetString() +
                    "' is not an IPv4 or IPv6 address (an IPv6 ip is bare: '::1')");
  }
  // CANN refuses a pull from our own cluster id (LLMDataDistV2::PullCache); it has no such rule
  // for pushes (they find no link). A remote cache id CANN does not know, -1 included, is the
  // owner's LLM_KV_CACHE_NOT_EXIST, once a link exists (the id crosses the wire as uint64).
  void CheckRemote(const CacheIndex &idx, bool pull = true) {
    if (pull && idx.cluster_id == engine_.cluster_id()) Invalid("data can not be pulled from our own cluster");
  }
  static Status Overall(const std::vector<Status> &rets) {
    Status last = LLM_SUCCESS;
    for (Status s : rets)
      if (s != LLM_SUCCESS) last = s;
    return last;
  }
  Deadline Deadline_() const { return datadist::After(sync_timeout_s_); }

  void StartListening(const char *text) {
    std::string host;
    uint16_t port = 0;
    datadist::ParseHostPort(text, host, port);
    engine_.Listen(host, port);
    listening_ = text;
  }

 public:
  std::string LastLinkFailure(uint64_t id) { return InCppWords(engine_.LastLinkFailure(id)); }

  void PeerMetrics(uint64_t id, std::string &json, int32_t timeout_ms) {
    CheckUpLocked();
    if (timeout_ms <= 0) Invalid("timeout_in_millis must be > 0");
    json = engine_.PeerStats(id, datadist::After(timeout_ms / 1000.0));
  }

 private:
  /// A pull (write false) or push of `plan` on the link to `cluster` within the sync deadline
  /// (Session::Transfer: the request cap, the local spans' check, the link, the metrics).
  void Move(bool write, uint64_t cluster, datadist::wire::Request req, const datadist::Plan &plan,
            const datadist::Lease &local) {
    session_.Transfer(write, cluster, std::move(req), plan, local.entry().geo, local.entry().addrs, Deadline_());
  }

  datadist::wire::Request Request(const datadist::Plan &plan, uint64_t cache_id, uint64_t slot, uint64_t layout) {
    datadist::wire::Request r;
    r.kind = datadist::wire::kCacheId;
    r.a = cache_id;
    r.b = slot;
    r.layout = layout;
    r.tensors = plan.remote_tensors;
    r.offsets = plan.remote_offsets;
    r.lengths = plan.lengths;
    if (plan.whole) r.flags |= datadist::wire::kFlagWhole;
    return r;
  }

  std::mutex mu_;  // guards state_ and listening_
  State state_ = kNew;
  double sync_timeout_s_ = 1.0;
  bool hixl_ = false;          // OPTION_TRANSFER_BACKEND is "hixl": its unlink and option rules
  bool verify_ = false;        // OPTION_DATADIST_VERIFY_CHECKSUM: pulls ask for the owner's CRC-32
  std::string listening_;      // the OPTION_LISTEN_IP_INFO the engine listens at
  datadist::Session session_;  // the core: every rule below the argument checks
  datadist::Engine &engine_;   // session_.engine()
};

LlmDataDist::LlmDataDist(uint64_t cluster_id, LlmRole role) : impl_(new LlmDataDistImpl(cluster_id, role)) {}

LlmDataDist::~LlmDataDist() { impl_->Finalize(); }

Status LlmDataDist::Initialize(const std::map<AscendString, AscendString> &options) {
  return Guard("Initialize", [&] { impl_->Initialize(options); });
}

void LlmDataDist::Finalize() {
  (void)Guard("Finalize", [&] { impl_->Finalize(); });
}

Status LlmDataDist::SetRole(LlmRole role, const std::map<AscendString, AscendString> &options) {
  return Guard("SetRole", [&] { impl_->SetRole(role, options); });
}

Status LlmDataDist::LinkLlmClusters(const std::vector<ClusterInfo> &clusters, std::vector<Status> &rets,
                                    int32_t timeout_in_millis) {
  Status overall = LLM_SUCCESS;
  std::string why;
  Status s = Guard("LinkLlmClusters", [&] { overall = impl_->Link(clusters, rets, timeout_in_millis, why); });
  if (s != LLM_SUCCESS) return s;
  if (overall != LLM_SUCCESS) Record("LinkLlmClusters", overall, why);
  return overall;
}

AscendString LlmDataDist::LastLinkFailure(uint64_t remote_cluster_id) const {
  try {
    return AscendString(impl_->LastLinkFailure(remote_cluster_id).c_str());
  } catch (const std::exception &) {  // bad_alloc: never throws, as every method here
    return AscendString();
  }
}

Status LlmDataDist::GetMetrics(std::vector<TransferMetrics> &metrics) const {
  return Guard("GetMetrics", [&] {
    std::vector<TransferMetrics> out;
    for (const datadist::metrics::Series &s : datadist::metrics::Snapshot()) {
      TransferMetrics m;
      m.op = datadist::metrics::OpName(s.op);
      m.cluster_id = s.cluster_id;
      m.transfers = s.transfers;
      m.bytes = s.bytes;
      m.seconds = s.seconds();
      uint64_t cumulative = 0;
      for (size_t i = 0; i < datadist::metrics::kBuckets; ++i) {
        cumulative += s.counts[i];
        m.latency_buckets.emplace_back(static_cast<double>(datadist::metrics::kBucketNs[i]) / 1e9, cumulative);
      }
      m.errors.insert(s.errors.begin(), s.errors.end());
      out.push_back(std::move(m));
    }
    metrics.swap(out);
  });
}

void LlmDataDist::ResetMetrics() { datadist::metrics::Reset(); }

const char *GetLastErrorMessage() { return t_last_error.c_str(); }

void SetLogCallback(LogCallback callback, void *user_data) {
  std::lock_guard<std::mutex> lock(g_log_mu);
  g_log_callback = callback;
  g_log_user_data = user_data;
}

Status LlmDataDist::GetPeerMetrics(uint64_t remote_cluster_id, std::string &json, int32_t timeout_in_millis) {
  return Guard("GetPeerMetrics", [&] { impl_->PeerMetrics(remote_cluster_id, json, timeout_in_millis); });
}

Status LlmDataDist::UnlinkLlmClusters(const std::vector<ClusterInfo> &clusters, std::vector<Status> &rets,
                                      int32_t timeout_in_millis, bool force_flag) {
  Status overall = LLM_SUCCESS;
  std::string why;
  Status s =
      Guard("UnlinkLlmClusters", [&] { overall = impl_->Unlink(clusters, rets, timeout_in_millis, force_flag, why); });
  if (s != LLM_SUCCESS) return s;
  if (overall != LLM_SUCCESS) Record("UnlinkLlmClusters", overall, why);
  return overall;
}

Status LlmDataDist::AllocateCache(const CacheDesc &cache_desc, Cache &cache) {
  return Guard("AllocateCache", [&] { impl_->Allocate(cache_desc, cache); });
}

Status LlmDataDist::DeallocateCache(int64_t cache_id) {
  return Guard("DeallocateCache", [&] { impl_->Deallocate(cache_id); });
}

Status LlmDataDist::PullKvCache(const CacheIndex &src_cache_index, const Cache &dst_cache, uint32_t batch_index,
                                int64_t size, const KvCacheExtParam &ext_param) {
  return Guard("PullKvCache", [&] { impl_->PullCache(src_cache_index, dst_cache, batch_index, size, ext_param); });
}

Status LlmDataDist::PullKvBlocks(const CacheIndex &src_cache_index, const Cache &dst_cache,
                                 const std::vector<uint64_t> &src_blocks, const std::vector<uint64_t> &dst_blocks,
                                 const KvCacheExtParam &ext_param) {
  return Guard("PullKvBlocks",
               [&] { impl_->PullBlocks(src_cache_index, dst_cache, src_blocks, dst_blocks, ext_param); });
}

Status LlmDataDist::CopyKvCache(const Cache &src_cache, const Cache &dst_cache, uint32_t src_batch_index,
                                uint32_t dst_batch_index, uint64_t offset, int64_t size) {
  return Guard("CopyKvCache",
               [&] { impl_->CopyCache(src_cache, dst_cache, src_batch_index, dst_batch_index, offset, size); });
}

Status LlmDataDist::CopyKvBlocks(const Cache &src_cache, const Cache &dst_cache,
                                 const std::vector<uint64_t> &src_blocks,
                                 const std::vector<std::vector<uint64_t>> &dst_blocks_list) {
  return Guard("CopyKvBlocks", [&] { impl_->CopyBlocks(src_cache, dst_cache, src_blocks, dst_blocks_list); });
}

Status LlmDataDist::PushKvCache(const Cache &src_cache, const CacheIndex &dst_cache_index, uint32_t src_batch_index,
                                int64_t size, const KvCacheExtParam &ext_param) {
  return Guard("PushKvCache", [&] { impl_->PushCache(src_cache, dst_cache_index, src_batch_index, size, ext_param); });
}

Status LlmDataDist::PushKvBlocks(const Cache &src_cache, const CacheIndex &dst_cache_index,
                                 const std::vector<uint64_t> &src_blocks, const std::vector<uint64_t> &dst_blocks,
                                 const KvCacheExtParam &ext_param) {
  return Guard("PushKvBlocks",
               [&] { impl_->PushBlocks(src_cache, dst_cache_index, src_blocks, dst_blocks, ext_param); });
}

Status LlmDataDist::RegisterKvCache(const CacheDesc &cache_desc, const std::vector<uint64_t> &addrs,
                                    const RegisterCfg &cfg, int64_t &cache_id) {
  (void)cfg;
  return Guard("RegisterKvCache", [&] { impl_->Register(cache_desc, addrs, cache_id); });
}

Status LlmDataDist::UnregisterKvCache(int64_t cache_id) {
  return Guard("UnregisterKvCache", [&] { impl_->Unregister(cache_id); });
}

}  // namespace llm_datadist
