// The option table: every init option both faces read (the C++ API's LlmDataDist::Initialize
// and the Python package's LLMDataDist.init, through the binding), its environment variable,
// its kind and accepted values, its default and the message for a bad value. One parser,
// ParseOptions, reads a face's options and the environment through it; neither face parses
// these keys on its own (issue 36). The table is also what `_core.options()` shows Python:
// LLMConfig's datadist extras and `datadist info` are generated from it.
//
// Rules, the same for every key (docs/compatibility.md, "Options"):
// - an option given wins over its environment variable, which wins over the default; an
//   option or variable set to "" is unset (except where the table says "empty is a value");
// - a bool is "1" or "0", nothing else (as the original's LLMUtils::ParseFlag);
// - an int is ASCII digits only, in the table's range;
// - an enum is one of the table's values, compared lower-cased;
// - a bad value is LLM_PARAM_INVALID with the table's message, naming the option, or the
//   variable it came from, and the value.
// Keys the table does not hold are not looked at here.
//
// Who calls: llm_datadist.cc's Initialize and the binding's parse_options / open, once per
// init. Pure: reads the environment through the Env it is given, opens nothing, never blocks.
#ifndef DATADIST_CPP_OPTIONS_H_
#define DATADIST_CPP_OPTIONS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "engine.h"
#include "tls.h"

namespace datadist {

enum class OptionKind { kBool, kInt, kEnum, kString, kPath, kSecret };

/// "bool", "int", "enum", "str", "path", "secret" (what `_core.options()` shows).
const char *KindName(OptionKind kind);

/// One row of the table.
struct OptionSpec {
  const char *key;  // the option key, e.g. "datadist.MaxConnections"
  const char *env;  // its environment variable, "" when none
  OptionKind kind;
  std::vector<std::string> values;  // kEnum: the accepted values (lower case)
  int64_t lo = 0, hi = 0;           // kInt: the accepted range, both ends included
  const char *unit = "";            // kInt: what the number counts ("ms"), "" for a count
  const char *def;                  // the default, as text
  const char *attr;                 // the LLMConfig property generated for it ("" for none)
  const char *doc;                  // one or two sentences for LLMConfig and `datadist info`
  /// A bad value's message; "{name}" is the option (or "VAR (key)" when the value came
  /// from the environment), "{value}" the value. Empty: the kind's message.
  const char *bad = "";
  bool empty_is_value = false;  // "" is a value to check (refused unless it is valid)
};

/// Every row, in the order `datadist info` shows them.
const std::vector<OptionSpec> &OptionTable();
/// The row of `key`; nullptr when the table has none.
const OptionSpec *FindOption(const std::string &key);

/// Where ParseOptions reads an environment variable: true and the value when it is set.
using Env = std::function<bool(const std::string &name, std::string *value)>;
/// The process's environment (getenv).
Env ProcessEnv();
/// A fixed environment (tests).
Env MapEnv(std::map<std::string, std::string> vars);
/// No environment at all (LLMConfig's setters check one value alone).
Env NoEnv();

/// One parsed value: its kind's field is set; `source` says where it came from.
struct OptionValue {
  OptionKind kind = OptionKind::kString;
  bool b = false;
  int64_t i = 0;
  std::string s;  // kEnum (lower-cased), kString, kPath, kSecret
  enum class Source { kDefault, kOption, kEnv } source = Source::kDefault;
  /// The value as an option would give it ("1", "256", "tcp", the text).
  std::string Text() const;
};
const char *SourceName(OptionValue::Source source);

/// Checks one raw value of `spec` (from `where`: the option key, or "VAR (key)").
/// LLM_PARAM_INVALID with the table's message when it is bad.
OptionValue CheckValue(const OptionSpec &spec, const std::string &raw, const std::string &where);

/// What the faces run with, every key of the table resolved.
struct Options {
  std::map<std::string, OptionValue> values;  // by key, every row of the table

  std::string transport = "auto";   // datadist.Transport
  bool nixl_serve = false;          // datadist.NixlServe
  bool nixl_whole_process = false;  // datadist.NixlAllowWholeProcessAccess
  std::string nixl_library;         // datadist.NixlLibrary ("" : the face finds NIXL)
  std::string secret;               // datadist.AuthSecret
  bool verify = false;              // datadist.VerifyChecksum
  bool allow_ptrace = true;         // datadist.AllowPtrace
  tls::Files tls;                   // datadist.TlsCert / TlsKey / TlsCa: all three or none
  size_t max_conns = 256;           // datadist.MaxConnections
  size_t max_per_peer = 64;         // datadist.MaxConnectionsPerPeer
  int64_t sync_timeout_ms = 1000;   // llm.SyncKvCacheWaitTime
};

/// Every key of the table from `options`, else `env`, else its default; the group rules
/// (TLS: all three files or none). LLM_PARAM_INVALID with the table's message on the first
/// bad value, in table order.
Options ParseOptions(const std::map<std::string, std::string> &options, const Env &env);

/// What a forced transport means for the engine's links, the one rule both faces use:
/// "tcp" and "nixl" neither use nor serve the local channel; "cma" reads no shared memory;
/// "shm" names the same-host path "shm"; "nixl" reads by NIXL. `transport` is a parsed
/// value ("auto", "tcp", "cma", "shm" or "nixl").
void ApplyTransport(const std::string &transport, EngineOptions *engine);

/// The engine's options for `options` (everything but TLS, which Open's caller loads:
/// tls::Context::Load(options.tls), which reads the files).
EngineOptions ToEngineOptions(const Options &options);

}  // namespace datadist

#endif  // DATADIST_CPP_OPTIONS_H_
