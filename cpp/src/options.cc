// The option table and its parser (options.h).
#include "options.h"

#include <cctype>
#include <cstdlib>
#include <utility>

#include "errors.h"

namespace datadist {

namespace {

constexpr int64_t kInt32Max = 2147483647;

std::vector<OptionSpec> MakeTable() {
  std::vector<OptionSpec> t;
  auto add = [&t](OptionSpec s) { t.push_back(std::move(s)); };
  add({"datadist.Transport",
       "DATADIST_TRANSPORT",
       OptionKind::kEnum,
       {"auto", "tcp", "cma", "shm", "nixl"},
       0,
       0,
       "",
       "auto",
       "transport",
       "Force this process's data path: auto (same-host peers by shared memory or cross-memory attach, others "
       "by TCP), tcp, cma, shm or nixl (needs the datadist[nixl] extra). tcp and nixl neither use nor serve the "
       "local channel.",
       "unknown transport '{value}' in {name}; use auto, tcp, cma, shm or nixl"});
  add({"datadist.NixlServe",
       "DATADIST_NIXL_SERVE",
       OptionKind::kBool,
       {},
       0,
       0,
       "",
       "0",
       "nixl_serve",
       "Serve NIXL readers (our NIXL metadata, grants and leases). Off unless set: NIXL being installed is not "
       "consent. Needs enable_remote_cache_accessible and, where UCX may use transports whose memory keys "
       "nothing checks, nixl_allow_whole_process_access."});
  add({"datadist.NixlAllowWholeProcessAccess",
       "DATADIST_NIXL_ALLOW_WHOLE_PROCESS_ACCESS",
       OptionKind::kBool,
       {},
       0,
       0,
       "",
       "0",
       "nixl_allow_whole_process_access",
       "Allow NIXL where UCX may carry it over transports whose memory keys the hardware does not check (tcp, "
       "shared memory, cma): there a NIXL peer can read and write any address of this process. Set it only "
       "among processes that trust each other fully."});
  add({"datadist.NixlLibrary",
       "DATADIST_NIXL_LIBRARY",
       OptionKind::kPath,
       {},
       0,
       0,
       "",
       "",
       "",
       "NIXL's C API library (libnixl_capi.so) to load; unset: the nixl-cu12 wheel's (Python), else the "
       "loader's search path."});
  add({"datadist.AuthSecret",
       "DATADIST_AUTH_SECRET",
       OptionKind::kSecret,
       {},
       0,
       0,
       "",
       "",
       "auth_secret",
       "A shared secret every linked peer must prove (challenge and response; it never crosses the wire). "
       "Unset: none."});
  add({"datadist.VerifyChecksum",
       "DATADIST_VERIFY_CHECKSUM",
       OptionKind::kBool,
       {},
       0,
       0,
       "",
       "0",
       "verify_checksum",
       "Check every pull end to end with a CRC-32 of the source spans (about one extra read of the bytes on "
       "each side)."});
  add({"datadist.AllowPtrace",
       "DATADIST_ALLOW_PTRACE",
       OptionKind::kBool,
       {},
       0,
       0,
       "",
       "1",
       "allow_ptrace",
       "Under Yama ptrace_scope=1, let same-user readers attach to this process for cross-memory attach "
       "(PR_SET_PTRACER_ANY, set once such a reader asks, undone at finalize). 0: never; they fall back to "
       "shared memory or a stream path."});
  add({"datadist.TlsCert",
       "DATADIST_TLS_CERT",
       OptionKind::kPath,
       {},
       0,
       0,
       "",
       "",
       "tls_cert_file",
       "This process's TLS certificate (PEM). With the key and the CA every connection runs mutual TLS; the "
       "three go together."});
  add({"datadist.TlsKey",
       "DATADIST_TLS_KEY",
       OptionKind::kPath,
       {},
       0,
       0,
       "",
       "",
       "tls_key_file",
       "The key of the TLS certificate (PEM)."});
  add({"datadist.TlsCa",
       "DATADIST_TLS_CA",
       OptionKind::kPath,
       {},
       0,
       0,
       "",
       "",
       "tls_ca_file",
       "The CA that signs every peer's certificate (PEM)."});
  add({"datadist.MaxConnections",
       "DATADIST_MAX_CONNECTIONS",
       OptionKind::kInt,
       {},
       1,
       65535,
       "",
       "256",
       "max_connections",
       "Inbound connections a listening process serves at once (a link takes two: control and reverse "
       "channel); more are refused with LLM_LINK_FAILED."});
  add({"datadist.MaxConnectionsPerPeer",
       "DATADIST_MAX_CONNECTIONS_PER_PEER",
       OptionKind::kInt,
       {},
       1,
       65535,
       "",
       "64",
       "max_connections_per_peer",
       "Of those, how many may come from one peer (IP address, or uid on this host)."});
  OptionSpec sync{"llm.SyncKvCacheWaitTime",
                  "",
                  OptionKind::kInt,
                  {},
                  1,
                  kInt32Max,
                  "ms",
                  "1000",
                  "",
                  "Milliseconds a pull or push may take (LLMConfig.sync_kv_timeout)."};
  sync.empty_is_value = true;
  add(sync);
  return t;
}

std::string Replace(std::string text, const std::string &what, const std::string &with) {
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + with.size()))
    text.replace(at, what.size(), with);
  return text;
}

[[noreturn]] void Bad(const OptionSpec &spec, const std::string &raw, const std::string &where) {
  std::string msg = spec.bad;
  if (msg.empty()) {
    switch (spec.kind) {
      case OptionKind::kBool: msg = "{name} must be 0 or 1, got '{value}'"; break;
      case OptionKind::kInt:
        msg = "{name} must be an integer in [" + std::to_string(spec.lo) + ", " + std::to_string(spec.hi) + "]" +
              (*spec.unit ? std::string(" (") + spec.unit + ")" : std::string()) + ", got '{value}'";
        break;
      case OptionKind::kEnum: {
        std::string list;
        for (const auto &v : spec.values) list += (list.empty() ? "" : ", ") + v;
        msg = "{name} must be one of " + list + ", got '{value}'";
        break;
      }
      default: msg = "{name}: bad value '{value}'";
    }
  }
  Invalid(Replace(Replace(msg, "{name}", where), "{value}", raw));
}

std::string Lower(std::string s) {
  for (char &c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

const char *KindName(OptionKind kind) {
  switch (kind) {
    case OptionKind::kBool: return "bool";
    case OptionKind::kInt: return "int";
    case OptionKind::kEnum: return "enum";
    case OptionKind::kString: return "str";
    case OptionKind::kPath: return "path";
    case OptionKind::kSecret: return "secret";
  }
  return "str";
}

const char *SourceName(OptionValue::Source source) {
  switch (source) {
    case OptionValue::Source::kOption: return "option";
    case OptionValue::Source::kEnv: return "env";
    default: return "default";
  }
}

const std::vector<OptionSpec> &OptionTable() {
  static const std::vector<OptionSpec> table = MakeTable();
  return table;
}

const OptionSpec *FindOption(const std::string &key) {
  for (const auto &spec : OptionTable())
    if (key == spec.key) return &spec;
  return nullptr;
}

Env ProcessEnv() {
  return [](const std::string &name, std::string *value) {
    const char *v = std::getenv(name.c_str());
    if (v == nullptr) return false;
    *value = v;
    return true;
  };
}

Env MapEnv(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const std::string &name, std::string *value) {
    auto it = vars.find(name);
    if (it == vars.end()) return false;
    *value = it->second;
    return true;
  };
}

Env NoEnv() {
  return [](const std::string &, std::string *) { return false; };
}

std::string OptionValue::Text() const {
  switch (kind) {
    case OptionKind::kBool: return b ? "1" : "0";
    case OptionKind::kInt: return std::to_string(i);
    default: return s;
  }
}

OptionValue CheckValue(const OptionSpec &spec, const std::string &raw, const std::string &where) {
  OptionValue v;
  v.kind = spec.kind;
  switch (spec.kind) {
    case OptionKind::kBool:
      // The original's LLMUtils::ParseFlag: "1" or "0" and nothing else ("true" is a typo a
      // safety setting must not guess at).
      if (raw != "0" && raw != "1") Bad(spec, raw, where);
      v.b = raw == "1";
      break;
    case OptionKind::kInt: {
      // ASCII digits only (no sign, no space), at most 18 of them before the range check.
      if (raw.empty() || raw.size() > 18 || raw.find_first_not_of("0123456789") != std::string::npos)
        Bad(spec, raw, where);
      const int64_t n = std::stoll(raw);
      if (n < spec.lo || n > spec.hi) Bad(spec, raw, where);
      v.i = n;
      break;
    }
    case OptionKind::kEnum: {
      const std::string low = Lower(raw);
      bool found = false;
      for (const auto &allowed : spec.values) found = found || allowed == low;
      if (!found) Bad(spec, raw, where);
      v.s = low;
      break;
    }
    default: v.s = raw;
  }
  return v;
}

Options ParseOptions(const std::map<std::string, std::string> &options, const Env &env) {
  Options out;
  for (const auto &spec : OptionTable()) {
    OptionValue v;
    auto it = options.find(spec.key);
    std::string raw;
    if (it != options.end() && (!it->second.empty() || spec.empty_is_value)) {
      v = CheckValue(spec, it->second, spec.key);
      v.source = OptionValue::Source::kOption;
    } else if (*spec.env && env(spec.env, &raw) && !raw.empty()) {
      v = CheckValue(spec, raw, std::string(spec.env) + " (" + spec.key + ")");
      v.source = OptionValue::Source::kEnv;
    } else {
      v = CheckValue(spec, spec.def, std::string(spec.key) + " (its default)");
      v.source = OptionValue::Source::kDefault;
    }
    out.values[spec.key] = v;
  }
  const auto &val = out.values;
  out.transport = val.at("datadist.Transport").s;
  out.nixl_serve = val.at("datadist.NixlServe").b;
  out.nixl_whole_process = val.at("datadist.NixlAllowWholeProcessAccess").b;
  out.nixl_library = val.at("datadist.NixlLibrary").s;
  out.secret = val.at("datadist.AuthSecret").s;
  out.verify = val.at("datadist.VerifyChecksum").b;
  out.allow_ptrace = val.at("datadist.AllowPtrace").b;
  out.tls = {val.at("datadist.TlsCert").s, val.at("datadist.TlsKey").s, val.at("datadist.TlsCa").s};
  out.max_conns = static_cast<size_t>(val.at("datadist.MaxConnections").i);
  out.max_per_peer = static_cast<size_t>(val.at("datadist.MaxConnectionsPerPeer").i);
  out.sync_timeout_ms = val.at("llm.SyncKvCacheWaitTime").i;
  if (!out.tls.empty() && (out.tls.cert.empty() || out.tls.key.empty() || out.tls.ca.empty()))
    Invalid(
        "TLS needs a certificate, its key and a CA file together (datadist.TlsCert, datadist.TlsKey, "
        "datadist.TlsCa)");
  return out;
}

void ApplyTransport(const std::string &transport, EngineOptions *engine) {
  engine->same_host = transport != "tcp" && transport != "nixl";
  engine->shm = transport != "cma";
  engine->shm_forced = transport == "shm";
  engine->nixl.read = transport == "nixl";
}

EngineOptions ToEngineOptions(const Options &options) {
  EngineOptions e;
  e.secret = options.secret;
  e.allow_ptrace = options.allow_ptrace;
  e.max_conns = options.max_conns;
  e.max_per_peer = options.max_per_peer;
  e.nixl.serve = options.nixl_serve;
  e.nixl.whole_process = options.nixl_whole_process;
  ApplyTransport(options.transport, &e);
  return e;
}

}  // namespace datadist
