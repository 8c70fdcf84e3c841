// Every rule of the option table (src/options.h), key by key: its variable, its kind's valid
// and invalid values with the code and message, the option-over-variable-over-default order,
// the defaults; then the shared cases of tests/vectors/options.txt, which the Python face runs
// too (tests/core/test_options_table.py), through ParseOptions and the C++ API's Initialize.
#include "options.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "errors.h"
#include "llm_datadist/llm_datadist.h"

#ifndef DATADIST_OPTION_VECTORS_FILE
#error "cpp/CMakeLists.txt defines DATADIST_OPTION_VECTORS_FILE, the path of tests/vectors/options.txt"
#endif

namespace datadist {
namespace {

using llm_datadist::AscendString;
using llm_datadist::LLM_PARAM_INVALID;
using llm_datadist::LLM_SUCCESS;
using Map = std::map<std::string, std::string>;

/// The LLM_PARAM_INVALID message ParseOptions throws for `options` and `env`; "" when it parses.
std::string Refusal(const Map &options, const Map &env = {}) {
  try {
    ParseOptions(options, MapEnv(env));
  } catch (const Error &e) {
    EXPECT_EQ(e.code(), LLM_PARAM_INVALID) << e.what();
    return e.what();
  }
  return "";
}

std::string Value(const Map &options, const std::string &key, const Map &env = {}) {
  return ParseOptions(options, MapEnv(env)).values.at(key).Text();
}

TEST(OptionTable, EveryRowIsWhole) {
  std::map<std::string, int> keys, envs;
  for (const auto &spec : OptionTable()) {
    EXPECT_EQ(++keys[spec.key], 1) << spec.key << " twice";
    if (*spec.env) {
      EXPECT_EQ(++envs[spec.env], 1) << spec.env << " twice";
    }
    EXPECT_GT(std::string(spec.doc).size(), 20U) << spec.key;
    // The default is a value of its own kind.
    EXPECT_NO_THROW(CheckValue(spec, spec.def, spec.key)) << spec.key;
    if (spec.kind == OptionKind::kEnum) {
      EXPECT_FALSE(spec.values.empty()) << spec.key;
    }
    if (spec.kind == OptionKind::kInt) {
      EXPECT_LT(spec.lo, spec.hi) << spec.key;
    }
    EXPECT_EQ(FindOption(spec.key), &spec);
  }
  EXPECT_EQ(FindOption("datadist.NoSuchOption"), nullptr);
  // Every datadist.* key has its variable, DATADIST_ and the key's words.
  for (const auto &spec : OptionTable()) {
    if (std::string(spec.key).rfind("datadist.", 0) == 0) {
      EXPECT_EQ(std::string(spec.env).rfind("DATADIST_", 0), 0U) << spec.key;
    }
  }
}

TEST(OptionTable, Defaults) {
  const Options o = ParseOptions({}, NoEnv());
  EXPECT_EQ(o.transport, "auto");
  EXPECT_FALSE(o.nixl_serve);
  EXPECT_FALSE(o.nixl_whole_process);
  EXPECT_EQ(o.nixl_library, "");
  EXPECT_EQ(o.secret, "");
  EXPECT_FALSE(o.verify);
  EXPECT_TRUE(o.allow_ptrace);
  EXPECT_TRUE(o.tls.empty());
  EXPECT_EQ(o.max_conns, 256U);
  EXPECT_EQ(o.max_per_peer, 64U);
  EXPECT_EQ(o.sync_timeout_ms, 1000);
  for (const auto &spec : OptionTable()) {
    EXPECT_EQ(o.values.at(spec.key).source, OptionValue::Source::kDefault) << spec.key;
    EXPECT_EQ(o.values.at(spec.key).Text(), spec.def) << spec.key;
  }
  // The engine's own defaults are the table's: a face that passes none gets the same engine.
  const EngineOptions e = ToEngineOptions(o);
  const EngineOptions plain;
  EXPECT_EQ(e.max_conns, plain.max_conns);
  EXPECT_EQ(e.max_per_peer, plain.max_per_peer);
  EXPECT_EQ(e.allow_ptrace, plain.allow_ptrace);
  EXPECT_EQ(e.same_host, plain.same_host);
  EXPECT_EQ(e.shm, plain.shm);
}

TEST(OptionTable, Bools) {
  for (const auto &spec : OptionTable()) {
    if (spec.kind != OptionKind::kBool) continue;
    const std::string key = spec.key;
    EXPECT_EQ(Value({{key, "1"}}, key), "1");
    EXPECT_EQ(Value({{key, "0"}}, key), "0");
    // The original's ParseFlag: "1" or "0", nothing else.
    for (const char *bad : {"true", "True", "false", "yes", "no", "on", "2", " 1", "1 ", "01", "-1"})
      EXPECT_EQ(Refusal({{key, bad}}), key + " must be 0 or 1, got '" + bad + "'");
    EXPECT_EQ(Refusal({}, {{spec.env, "yes"}}), std::string(spec.env) + " (" + key + ") must be 0 or 1, got 'yes'");
  }
}

TEST(OptionTable, Ints) {
  for (const auto &spec : OptionTable()) {
    if (spec.kind != OptionKind::kInt) continue;
    const std::string key = spec.key;
    const std::string unit = *spec.unit ? std::string(" (") + spec.unit + ")" : "";
    const std::string range = "[" + std::to_string(spec.lo) + ", " + std::to_string(spec.hi) + "]" + unit;
    EXPECT_EQ(Value({{key, std::to_string(spec.lo)}}, key), std::to_string(spec.lo));
    EXPECT_EQ(Value({{key, std::to_string(spec.hi)}}, key), std::to_string(spec.hi));
    for (const std::string &bad :
         std::vector<std::string>{std::to_string(spec.lo - 1), std::to_string(spec.hi + 1), std::string("lots"),
                                  std::string("-1"), std::string("+1"), std::string(" 1"), std::string("1.0"),
                                  std::string("0x10"), std::string(40, '9'), std::string("\xd9\xa3")})
      EXPECT_EQ(Refusal({{key, bad}}), key + " must be an integer in " + range + ", got '" + bad + "'");
  }
  // The connection caps, by name: 1..65535 (before, the C++ face took any 9-digit number).
  EXPECT_EQ(Refusal({{"datadist.MaxConnections", "123456789"}}),
            "datadist.MaxConnections must be an integer in [1, 65535], got '123456789'");
  EXPECT_EQ(ParseOptions({{"datadist.MaxConnectionsPerPeer", "2"}}, NoEnv()).max_per_peer, 2U);
  EXPECT_EQ(ParseOptions({{"llm.SyncKvCacheWaitTime", "2500"}}, NoEnv()).sync_timeout_ms, 2500);
}

TEST(OptionTable, Enums) {
  for (const auto &spec : OptionTable()) {
    if (spec.kind != OptionKind::kEnum) continue;
    const std::string key = spec.key;
    for (const auto &v : spec.values) {
      EXPECT_EQ(Value({{key, v}}, key), v);
      std::string upper = v;
      for (char &c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
      EXPECT_EQ(Value({{key, upper}}, key), v);  // compared lower-cased
    }
    EXPECT_NE(Refusal({{key, "carrier-pigeon"}}).find("'carrier-pigeon'"), std::string::npos) << key;
  }
  EXPECT_EQ(Refusal({{"datadist.Transport", "rdma"}}),
            "unknown transport 'rdma' in datadist.Transport; use auto, tcp, cma, shm or nixl");
}

TEST(OptionTable, TextsAreTakenAsGiven) {
  for (const char *key : {"datadist.AuthSecret", "datadist.NixlLibrary"})
    EXPECT_EQ(Value({{key, " any text, 1 "}}, key), " any text, 1 ");
  const Options o =
      ParseOptions({{"datadist.TlsCert", "c"}, {"datadist.TlsKey", "k"}, {"datadist.TlsCa", "a"}}, NoEnv());
  EXPECT_EQ(o.tls.cert, "c");
  EXPECT_EQ(o.tls.key, "k");
  EXPECT_EQ(o.tls.ca, "a");
  const std::string tls =
      "TLS needs a certificate, its key and a CA file together (datadist.TlsCert, datadist.TlsKey, datadist.TlsCa)";
  EXPECT_EQ(Refusal({{"datadist.TlsCert", "c"}}), tls);
  EXPECT_EQ(Refusal({{"datadist.TlsCert", "c"}, {"datadist.TlsKey", "k"}}), tls);
  EXPECT_EQ(Refusal({}, {{"DATADIST_TLS_CA", "a"}}), tls);
  // The three may come from options and variables mixed.
  EXPECT_EQ(Refusal({{"datadist.TlsCert", "c"}}, {{"DATADIST_TLS_KEY", "k"}, {"DATADIST_TLS_CA", "a"}}), "");
}

// For every row with a variable: the option wins, the variable stands in for an option that is
// unset or "", the default for neither; each value's source says which.
TEST(OptionTable, OptionThenEnvironmentThenDefault) {
  for (const auto &spec : OptionTable()) {
    if (!*spec.env) continue;
    const std::string key = spec.key, env = spec.env;
    // two distinct valid values of the kind
    std::string a = "1", b = "0";
    if (spec.kind == OptionKind::kInt) a = std::to_string(spec.lo), b = std::to_string(spec.hi);
    if (spec.kind == OptionKind::kEnum) a = spec.values.front(), b = spec.values.back();
    if (spec.kind == OptionKind::kString || spec.kind == OptionKind::kPath || spec.kind == OptionKind::kSecret)
      a = "from-option", b = "from-env";
    // TLS files go by three: give the other two by option so the group rule holds.
    Map extra;
    if (key.rfind("datadist.Tls", 0) == 0)
      for (const char *k : {"datadist.TlsCert", "datadist.TlsKey", "datadist.TlsCa"})
        if (key != k) extra[k] = "x";
    Map with = extra;
    with[key] = a;
    Options o = ParseOptions(with, MapEnv({{env, b}}));
    EXPECT_EQ(o.values.at(key).Text(), a) << key;
    EXPECT_EQ(o.values.at(key).source, OptionValue::Source::kOption) << key;
    for (const Map &unset : {extra, [&] {
                               Map m = extra;
                               m[key] = "";
                               return m;
                             }()}) {
      o = ParseOptions(unset, MapEnv({{env, b}}));
      EXPECT_EQ(o.values.at(key).Text(), b) << key;
      EXPECT_EQ(o.values.at(key).source, OptionValue::Source::kEnv) << key;
    }
    o = ParseOptions({}, MapEnv({{env, ""}}));  // a variable set to "" is unset too
    EXPECT_EQ(o.values.at(key).source, OptionValue::Source::kDefault) << key;
    EXPECT_EQ(o.values.at(key).Text(), spec.def) << key;
  }
  // DATADIST_ALLOW_PTRACE (before: read by the Python face only).
  EXPECT_FALSE(ParseOptions({}, MapEnv({{"DATADIST_ALLOW_PTRACE", "0"}})).allow_ptrace);
  // A row without a variable: "" is checked as a value where the table says so.
  EXPECT_EQ(Refusal({{"llm.SyncKvCacheWaitTime", ""}}),
            "llm.SyncKvCacheWaitTime must be an integer in [1, 2147483647] (ms), got ''");
}

TEST(OptionTable, TransportMeaning) {
  struct Row {
    const char *transport;
    bool local, shm, shm_forced, nixl;
  };
  // tcp and nixl neither use nor serve the local channel (before: nixl served it from Python).
  for (const Row &r : {Row{"auto", true, true, false, false}, Row{"tcp", false, true, false, false},
                       Row{"cma", true, false, false, false}, Row{"shm", true, true, true, false},
                       Row{"nixl", false, true, false, true}}) {
    const EngineOptions e = ToEngineOptions(ParseOptions({{"datadist.Transport", r.transport}}, NoEnv()));
    EXPECT_EQ(e.same_host, r.local) << r.transport;
    EXPECT_EQ(e.shm, r.shm) << r.transport;
    EXPECT_EQ(e.shm_forced, r.shm_forced) << r.transport;
    EXPECT_EQ(e.nixl.read, r.nixl) << r.transport;
  }
  const Options o = ParseOptions({{"datadist.NixlServe", "1"},
                                  {"datadist.NixlAllowWholeProcessAccess", "1"},
                                  {"datadist.AuthSecret", "s"},
                                  {"datadist.MaxConnections", "7"},
                                  {"datadist.MaxConnectionsPerPeer", "3"},
                                  {"datadist.AllowPtrace", "0"}},
                                 NoEnv());
  const EngineOptions e = ToEngineOptions(o);
  EXPECT_TRUE(e.nixl.serve);
  EXPECT_TRUE(e.nixl.whole_process);
  EXPECT_EQ(e.secret, "s");
  EXPECT_EQ(e.max_conns, 7U);
  EXPECT_EQ(e.max_per_peer, 3U);
  EXPECT_FALSE(e.allow_ptrace);
}

// ---- the shared cases (tests/vectors/options.txt)

struct Case {
  std::string name, expect;
  Map options, env;
  bool init = false;
  int line = 0;
};

std::string Trim(const std::string &s) {
  const size_t a = s.find_first_not_of(' '), b = s.find_last_not_of(' ');
  return a == std::string::npos ? "" : s.substr(a, b - a + 1);
}

std::vector<std::string> Split(const std::string &s, const std::string &sep) {
  std::vector<std::string> out;
  size_t from = 0;
  for (size_t at = s.find(sep); at != std::string::npos; at = s.find(sep, from)) {
    out.push_back(s.substr(from, at - from));
    from = at + sep.size();
  }
  out.push_back(s.substr(from));
  return out;
}

Map Pairs(const std::string &field) {
  Map out;
  if (Trim(field) == "-") return out;
  for (const std::string &pair : Split(Trim(field), ";")) {
    const size_t eq = pair.find('=');
    out[pair.substr(0, eq)] = eq == std::string::npos ? "" : pair.substr(eq + 1);
  }
  return out;
}

std::vector<Case> Cases() {
  const char *env = std::getenv("DATADIST_OPTION_VECTORS");
  std::ifstream in(env != nullptr && *env ? env : DATADIST_OPTION_VECTORS_FILE);
  EXPECT_TRUE(in.good()) << "cannot read the option vectors";
  std::vector<Case> cases;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (Trim(line).empty() || line[0] == '#') continue;
    const std::vector<std::string> f = Split(line, " | ");
    EXPECT_EQ(f.size(), 5U) << "line " << n;
    if (f.size() != 5) continue;
    Case c;
    c.name = Trim(f[0]);
    c.options = Pairs(f[1]);
    c.env = Pairs(f[2]);
    c.init = Trim(f[3]) == "init";
    c.expect = f[4];
    c.line = n;
    cases.push_back(c);
  }
  return cases;
}

/// Sets the case's variables and unsets the table's others for its lifetime; restores them.
class ScopedEnv {
 public:
  explicit ScopedEnv(const Map &env) {
    for (const auto &spec : OptionTable()) {
      if (!*spec.env) continue;
      if (const char *v = std::getenv(spec.env)) saved_[spec.env] = v;
      unsetenv(spec.env);
    }
    for (const auto &kv : env) setenv(kv.first.c_str(), kv.second.c_str(), 1);
  }
  ~ScopedEnv() {
    for (const auto &spec : OptionTable())
      if (*spec.env) unsetenv(spec.env);
    for (const auto &kv : saved_) setenv(kv.first.c_str(), kv.second.c_str(), 1);
  }

 private:
  Map saved_;
};

TEST(OptionVectors, BothFacesCases) {
  const std::vector<Case> cases = Cases();
  ASSERT_GE(cases.size(), 30U);
  for (const Case &c : cases) {
    SCOPED_TRACE("tests/vectors/options.txt line " + std::to_string(c.line) + ": " + c.name);
    const bool ok = c.expect.rfind("ok", 0) == 0;
    ASSERT_TRUE(ok || c.expect.rfind("invalid ", 0) == 0) << c.expect;
    if (ok) {
      const Options o = ParseOptions(c.options, MapEnv(c.env));
      for (const auto &kv : Pairs(c.expect.size() > 3 ? c.expect.substr(3) : "-")) {
        if (kv.first == "local_channel")
          EXPECT_EQ(ToEngineOptions(o).same_host ? "1" : "0", kv.second);
        else
          EXPECT_EQ(o.values.at(kv.first).Text(), kv.second) << kv.first;
      }
    } else {
      EXPECT_EQ(Refusal(c.options, c.env), c.expect.substr(8));
    }
    if (!c.init) continue;
    // The C++ API: Initialize takes the same options, with the variables in the process's
    // environment, and answers the same way.
    ScopedEnv scoped(c.env);
    std::map<AscendString, AscendString> options;
    for (const auto &kv : c.options) options[AscendString(kv.first.c_str())] = AscendString(kv.second.c_str());
    llm_datadist::LlmDataDist dd(7, llm_datadist::LlmRole::kDecoder);
    EXPECT_EQ(dd.Initialize(options), ok ? LLM_SUCCESS : LLM_PARAM_INVALID);
    dd.Finalize();
  }
}

}  // namespace
}  // namespace datadist
