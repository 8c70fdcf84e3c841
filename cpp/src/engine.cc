#include "engine.h"

#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>

#include "addr.h"
#include "auth.h"
#include "errors.h"
#include "local.h"
#include "metrics.h"

namespace datadist {

namespace {

// A JSON reader (RFC 8259) for the few texts the engine looks into (llm.LocalCommRes, a peer's
// STATS answer): checks the whole text and keeps the top-level object's string members.
class JsonTop {
 public:
  /// Parses `text`; false (and `error` says where) when it is not one JSON value.
  bool Parse(const std::string &text) {
    s_ = &text;
    i_ = 0;
    Space();
    if (!Value(0)) return false;
    Space();
    if (i_ != s_->size()) return Bad("text after the JSON value");
    return true;
  }
  bool object = false;                         // the value is an object
  std::map<std::string, std::string> strings;  // its members whose values are strings
  std::map<std::string, bool> members;         // every member's name
  std::string error;

 private:
  static constexpr int kMaxDepth = 256;
  bool Bad(const std::string &what) {
    error = what + " at byte " + std::to_string(i_);
    return false;
  }
  bool More() const { return i_ < s_->size(); }
  char At() const { return (*s_)[i_]; }
  void Space() {
    while (More() && (At() == ' ' || At() == '\t' || At() == '\n' || At() == '\r')) ++i_;
  }
  bool Lit(const char *word) {
    const size_t n = std::strlen(word);
    if (s_->compare(i_, n, word) != 0) return Bad("unexpected character");
    i_ += n;
    return true;
  }
  bool Digits() {
    const size_t from = i_;
    while (More() && std::isdigit(static_cast<unsigned char>(At()))) ++i_;
    return i_ > from || Bad("a digit expected");
  }
  bool Number() {
    if (At() == '-') ++i_;
    if (More() && At() == '0') {
      ++i_;
    } else if (!Digits()) {
      return false;
    }
    if (More() && At() == '.' && (++i_, !Digits())) return false;
    if (More() && (At() == 'e' || At() == 'E')) {
      ++i_;
      if (More() && (At() == '+' || At() == '-')) ++i_;
      if (!Digits()) return false;
    }
    return true;
  }
  bool String(std::string *out) {
    ++i_;  // the opening quote
    while (More()) {
      const unsigned char c = static_cast<unsigned char>((*s_)[i_++]);
      if (c == '"') return true;
      if (c < 0x20) return Bad("a control character in a string");
      if (c != '\\') {
        if (out) out->push_back(static_cast<char>(c));
        continue;
      }
      if (!More()) break;
      const char e = (*s_)[i_++];
      static const char kFrom[] = "\"\\/bfnrt", kTo[] = "\"\\/\b\f\n\r\t";
      if (e == 'u') {
        unsigned code = 0;
        for (int k = 0; k < 4; ++k, ++i_) {
          if (!More() || !std::isxdigit(static_cast<unsigned char>(At()))) return Bad("a bad \\u escape");
          const char h = static_cast<char>(std::tolower(static_cast<unsigned char>(At())));
          code = code * 16 + static_cast<unsigned>(h <= '9' ? h - '0' : h - 'a' + 10);
        }
        if (out) out->push_back(code < 0x80 ? static_cast<char>(code) : '?');  // only ASCII is compared
      } else if (const char *p = e ? std::strchr(kFrom, e) : nullptr) {
        if (out) out->push_back(kTo[p - kFrom]);
      } else {
        return Bad("a bad escape");
      }
    }
    return Bad("an unterminated string");
  }
  bool Value(int depth) {
    Space();
    if (!More()) return Bad("a value expected");
    if (depth > kMaxDepth) return Bad("nesting too deep");
    const char c = At();
    if (c == '"') return String(nullptr);
    if (c == '{' || c == '[') {
      if (depth == 0) object = c == '{';
      const char close = c == '{' ? '}' : ']';
      ++i_;
      Space();
      if (More() && At() == close) return ++i_, true;
      for (;;) {
        std::string name;
        bool kept = false;  // a top-level string member, read into `strings`
        if (c == '{') {
          Space();
          if (!More() || At() != '"') return Bad("a member name expected");
          if (!String(&name)) return false;
          Space();
          if (!More() || (*s_)[i_++] != ':') return Bad("':' expected");
          Space();
          if (depth == 0) {
            members[name] = true;
            strings.erase(name);
            if (More() && At() == '"') {
              if (!String(&strings[name])) return false;
              kept = true;
            }
          }
        }
        if (!kept && !Value(depth + 1)) return false;
        Space();
        if (!More()) return Bad("an unterminated " + std::string(c == '{' ? "object" : "array"));
        if (At() == close) return ++i_, true;
        if ((*s_)[i_++] != ',') return Bad("',' expected");
      }
    }
    if (c == '-' || std::isdigit(static_cast<unsigned char>(c))) return Number();
    if (c == 't') return Lit("true");
    if (c == 'f') return Lit("false");
    if (c == 'n') return Lit("null");
    return Bad("unexpected character");
  }
  const std::string *s_ = nullptr;
  size_t i_ = 0;
};

std::string JsonQuoted(const std::string &text) {
  std::string out = "\"";
  for (const char ch : text) {
    const unsigned char c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += ch;
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

// The string member `key` of the JSON object `json`; "" when absent, not a string, or the
// text is no JSON object.
std::string JsonStringField(const std::string &json, const std::string &key) {
  JsonTop top;
  if (!top.Parse(json) || !top.object) return {};
  auto it = top.strings.find(key);
  return it == top.strings.end() ? std::string() : it->second;
}

}  // namespace

std::string CommResError(const std::string &text) {
  constexpr size_t kMaxBytes = 64 * 1024;  // CANN's rank_table_json::kMaxCommResSizeInBytes
  if (text.empty()) return {};
  if (text.size() > kMaxBytes)
    return "it is " + std::to_string(text.size()) + " bytes, over the limit of " + std::to_string(kMaxBytes) +
           " bytes (64 KiB)";
  JsonTop top;
  if (!top.Parse(text)) return "it is not JSON (" + top.error + ")";
  if (!top.object) return "it is not a JSON object";
  if (!top.members.count("version")) return "it has no \"version\" (\"1.0\" or \"1.2\")";
  auto it = top.strings.find("version");
  if (it == top.strings.end()) return "its \"version\" is not a string (\"1.0\" or \"1.2\")";
  if (it->second != "1.0" && it->second != "1.2")
    return "its version \"" + it->second + "\" is not one CANN knows (\"1.0\" or \"1.2\")";
  return {};
}

using llm_datadist::LLM_ALREADY_LINK;
using llm_datadist::LLM_FAILED;
using llm_datadist::LLM_LINK_FAILED;
using llm_datadist::LLM_NOT_YET_LINK;

Engine::Engine(uint64_t cluster_id, int32_t role) {
  ident_.cluster_id = cluster_id;
  ident_.role = role;
  ident_.on_control = [this](uint64_t peer) {
    metrics::Admit(peer);  // a completed handshake: its id may have a series (metrics.h's cap)
    std::lock_guard<std::mutex> lock(hello_mu_);
    ++hellos_[peer];
  };
  alive_->engine = this;
  nixl_ = std::make_unique<nixl::Owner>(&registry_, cluster_id);
  ident_.nixl = nixl_.get();
  ident_.stats = [alive = alive_, cluster_id](uint64_t peer, const std::string &token) {
    std::lock_guard<std::mutex> lock(alive->mu);
    if (alive->engine == nullptr) return metrics::StatsJson(cluster_id, 0, peer, false);
    return alive->engine->StatsFor(peer, token);
  };
}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> lock(alive_->mu);
    alive_->engine = nullptr;
  }
  Close(0.0);
  // Its revoking threads reach our reverse channels (Open's revoker): joined while those exist.
  ident_.nixl = nullptr;
  nixl_.reset();
}

void Engine::Open(const EngineOptions &options) {
  Close(0.0);  // a re-open after Close, or a second Open: start clean
  std::lock_guard<std::mutex> lock(mu_);
  options_ = options;
  ident_.secret = options.secret;
  ident_.serve_local = options.same_host;
  ident_.allow_ptrace = options.allow_ptrace;
  ident_.tls = options.tls;
  {
    std::lock_guard<std::mutex> rev(rev_mu_);
    rev_closed_ = false;
  }
  // NIXL leases are revoked on the reader's reverse channel to us: the one that echoed the
  // asking connection's link token.
  auto reverse_of = [this](uint64_t cluster, const std::string &token) -> std::shared_ptr<Link> {
    std::lock_guard<std::mutex> rev(rev_mu_);
    auto it = reverse_links_.find(cluster);
    if (it == reverse_links_.end() || token.size() != it->second->link_token().size() ||
        !auth::Same(it->second->link_token(), token))
      return nullptr;
    return it->second;
  };
  nixl_reader_.reset();
  nixl_->Configure(
      options.nixl,
      [reverse_of](uint64_t cluster, const std::string &token, uint64_t lease_id, Deadline deadline) {
        std::shared_ptr<Link> link = reverse_of(cluster, token);
        if (!link) Fail(LLM_LINK_FAILED, "the reader's reverse channel is gone");
        link->NixlRevoke(lease_id, deadline);
      },
      [reverse_of](uint64_t cluster, const std::string &token) {
        std::shared_ptr<Link> link = reverse_of(cluster, token);
        return link && !link->Gone();
      });
  if (options.nixl.read) nixl_reader_ = nixl_->Reading();  // LLM_PARAM_INVALID without NIXL
  open_ = true;
}

int Engine::Close(double wait_s) {
  std::multimap<uint64_t, std::shared_ptr<Link>> links;
  std::unique_ptr<Server> server;
  bool was_open;
  {
    std::lock_guard<std::mutex> lock(mu_);
    was_open = open_;
    open_ = false;
    links.insert(links_.begin(), links_.end());
    links_.clear();
    server = std::move(server_);
  }
  nixl_->RevokeAll();  // while the readers' reverse channels are up (no wait when none is held)
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto &kv : extra_) kv.second->Stop();
    extra_.clear();
  }
  if (server) server->Stop();  // no new reverse channels after this
  {
    std::lock_guard<std::mutex> lock(rev_mu_);
    rev_closed_ = true;
    for (auto &kv : reverse_links_) links.emplace(kv.first, kv.second);
    reverse_links_.clear();
  }
  for (auto &kv : links) kv.second->Close(Deadline(), true);
  return was_open ? registry_.Clear(wait_s) : 0;
}

void Engine::Listen(const std::string &host, uint16_t port) {
  std::unique_ptr<Server> old;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!open_) Fail(LLM_FAILED, "the engine is not open");
    old = std::move(server_);
  }
  if (old) old->Stop();
  auto server = MakeServer(host, port);
  std::lock_guard<std::mutex> lock(mu_);
  server_ = std::move(server);
}

std::unique_ptr<Server> Engine::MakeServer(const std::string &host, uint16_t port) {
  auto server = std::make_unique<Server>(
      &registry_, &ident_,
      [this](Server &s, uint64_t cid, std::unique_ptr<Conn> conn, const std::vector<uint8_t> &last,
             const std::string &token, const std::string &peer,
             bool eager) { AdoptReverse(s, cid, std::move(conn), last, token, peer, eager); });
  server->Start(host, port, options_.max_conns, options_.max_per_peer);
  return server;
}

int Engine::ListenAlso(const std::string &host, uint16_t port) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!open_) Fail(LLM_FAILED, "the engine is not open");
  }
  auto server = MakeServer(host, port);
  std::lock_guard<std::mutex> lock(mu_);
  int key = next_extra_++;
  extra_[key] = std::move(server);
  return key;
}

void Engine::StopAlso(int key) {
  std::unique_ptr<Server> server;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = extra_.find(key);
    if (it == extra_.end()) return;
    server = std::move(it->second);
    extra_.erase(it);
  }
  server->Stop();
}

uint64_t Engine::HelloCount(uint64_t cluster_id) {
  std::lock_guard<std::mutex> lock(hello_mu_);
  auto it = hellos_.find(cluster_id);
  return it == hellos_.end() ? 0 : it->second;
}

std::vector<uint64_t> Engine::InboundControl() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<uint64_t> ids;
  if (server_) ids = server_->ControlClusters();
  for (auto &kv : extra_) {
    auto more = kv.second->ControlClusters();
    ids.insert(ids.end(), more.begin(), more.end());
  }
  return ids;
}

std::shared_ptr<Link> Engine::OpenLink(uint64_t id, const std::string &host, uint16_t port, Deadline deadline,
                                       bool take_peer_id, bool reverse) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!open_) Fail(LLM_FAILED, "the engine is not open");
  }
  wire::Hello hello;
  hello.cluster_id = ident_.cluster_id;
  hello.role = static_cast<uint8_t>(ident_.role.load());
  hello.pid = static_cast<uint32_t>(getpid());
  // Who we say we are, as Python does; an owner reads nothing on it (grants go by the pid
  // the kernel reports for a local-channel connection).
  hello.pid_ns = local::HostIdentity::Current().pid_ns;
  hello.boot_id = local::HostIdentity::Current().boot_id;
  auto link = std::make_shared<Link>(id, host, port, hello, options_.secret, reverse ? &registry_ : nullptr,
                                     options_.same_host);
  link->SetShm(options_.shm, options_.shm_forced);
  if (options_.nixl.read) link->SetNixl(nixl_reader_, nixl_->ReaderRefusal());
  if (take_peer_id) link->TakePeerId();
  link->SetStatsAnswer(ident_.stats);
  link->SetTls(options_.tls);
  link->Open(deadline);
  return link;
}

void Engine::AdoptLink(const std::shared_ptr<Link> &link) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!open_) {
    link->Close(Deadline(), true);
    Fail(LLM_FAILED, "finalized");
  }
  const uint64_t id = link->remote_cluster_id();
  if (!links_.emplace(id, link).second) Fail(LLM_ALREADY_LINK, "cluster " + std::to_string(id) + " is already linked");
  metrics::Admit(id);  // our link: its peer's requests on the reverse channel have a series (metrics.h)
}

void Engine::StopListening() {
  std::unique_ptr<Server> old;
  {
    std::lock_guard<std::mutex> lock(mu_);
    old = std::move(server_);
  }
  if (old) old->Stop();
}

bool Engine::listening() const {
  std::lock_guard<std::mutex> lock(mu_);
  return server_ != nullptr;
}

uint16_t Engine::port() const {
  std::lock_guard<std::mutex> lock(mu_);
  return server_ ? server_->port() : 0;
}

uint64_t Engine::Connect(uint64_t id, const std::string &host, uint16_t port, Deadline deadline, bool take_peer_id,
                         bool quiet) {
  bool check_peer_comm_res = false;
  {
    std::lock_guard<std::mutex> lock(comm_res_mu_);
    if (!comm_res_error_.empty())
      Fail(llm_datadist::LLM_PARAM_INVALID,
           "our " + std::string(llm_datadist::OPTION_LOCAL_COMM_RES) + " is not valid: " + comm_res_error_);
    check_peer_comm_res = comm_res_set_;
  }
  {
    std::unique_lock<std::mutex> lock(mu_);
    while (connecting_.count(id) && !links_.count(id))
      if (connected_.wait_until(lock, deadline) == std::cv_status::timeout && connecting_.count(id) &&
          !links_.count(id))
        Fail(LLM_LINK_FAILED,
             "cluster " + std::to_string(id) + ": another link to it was still being made at the deadline");
    if (links_.count(id)) Fail(LLM_ALREADY_LINK, "cluster " + std::to_string(id) + " is already linked");
    connecting_.insert(id);
  }
  struct Done {  // this Connect ends: the next one for `id` may go on
    Engine *engine;
    uint64_t id;
    ~Done() {
      std::lock_guard<std::mutex> lock(engine->mu_);
      engine->connecting_.erase(id);
      engine->connected_.notify_all();
    }
  } done{this, id};
  std::shared_ptr<Link> link;
  try {
    link = OpenLink(id, host, port, deadline, take_peer_id, true);
  } catch (const Error &e) {
    if (e.code() == LLM_FAILED) throw;  // not open
    NoteLinkFailure(id, host, port, e.what(), quiet);
    Fail(LLM_LINK_FAILED, e.what());  // as Python: any failure to link is LLM_LINK_FAILED
  }
  try {
    if (check_peer_comm_res) CheckPeerCommRes(*link, deadline);
    AdoptLink(link);
  } catch (const Error &) {
    link->Close(Deadline(), true);
    throw;
  }
  std::lock_guard<std::mutex> failures(fail_mu_);
  link_failures_.erase(link->remote_cluster_id());  // linked: an old failure no longer applies
  return link->remote_cluster_id();
}

// Why a link failed, beyond its LLM_LINK_FAILED (as Python's LinkFailedWarning and
// last_link_failure): kept per cluster until a link to it succeeds, and told on stderr
// unless DATADIST_LINK_WARNINGS=0 (or the caller warns its own way: `quiet`).
void Engine::NoteLinkFailure(uint64_t id, const std::string &host, uint16_t port, const std::string &why, bool quiet) {
  std::string where = FormatHostPort(host, port);
  std::string text = "link to cluster " + std::to_string(id) + " at " + where + " failed (LLM_LINK_FAILED): " + why +
                     " [for more: datadist probe " + where + " --cluster-id " + std::to_string(id) + "]";
  {
    std::lock_guard<std::mutex> lock(fail_mu_);
    link_failures_[id] = text;
  }
  const char *env = std::getenv("DATADIST_LINK_WARNINGS");
  if (!quiet && (env == nullptr || std::string(env) != "0"))
    std::fprintf(stderr, "[datadist] warning: %s\n", text.c_str());
}

std::string Engine::LastLinkFailure(uint64_t id) {
  std::lock_guard<std::mutex> lock(fail_mu_);
  auto it = link_failures_.find(id);
  return it == link_failures_.end() ? std::string() : it->second;
}

std::string Engine::StatsFor(uint64_t peer, const std::string &token) {
  std::shared_ptr<Link> rev;
  {
    std::lock_guard<std::mutex> lock(rev_mu_);
    auto it = reverse_links_.find(peer);
    if (it != reverse_links_.end()) rev = it->second;
  }
  // The id is only a claim: while that cluster's link has a live reverse channel, its series
  // are the control channel's it belongs to (the token it echoed), not any connection's.
  const bool foreign = rev && !auth::Same(rev->link_token(), token) && !rev->Gone();
  std::string json = metrics::StatsJson(ident_.cluster_id, ident_.role.load(), peer, !foreign);
  std::lock_guard<std::mutex> lock(comm_res_mu_);
  if (!comm_res_error_.empty() && !json.empty() && json.back() == '}') {
    json.pop_back();
    json += ",\"comm_res_error\":" + JsonQuoted(comm_res_error_) + "}";
  }
  return json;
}

void Engine::SetLocalCommRes(bool set, const std::string &text) {
  std::lock_guard<std::mutex> lock(comm_res_mu_);
  comm_res_set_ = set;
  comm_res_error_ = set ? CommResError(text) : std::string();
}

// The linker's half of CANN's rule (SetLocalCommRes): the peer's STATS answer names its own
// llm.LocalCommRes's fault. A peer that answers STATS without the field, or not at all within
// the deadline (an older datadist), is taken as valid: the link is not refused for that.
void Engine::CheckPeerCommRes(Link &link, Deadline deadline) {
  std::string json;
  try {
    json = link.Stats(deadline);
  } catch (const Error &) {
    return;
  }
  const std::string fault = JsonStringField(json, "comm_res_error");
  if (!fault.empty())
    Fail(llm_datadist::LLM_PARAM_INVALID, "the " + std::string(llm_datadist::OPTION_LOCAL_COMM_RES) + " of cluster " +
                                              std::to_string(link.remote_cluster_id()) +
                                              " (the peer) is not valid: " + fault);
}

std::string Engine::PeerStats(uint64_t cluster_id, Deadline deadline) { return GetLink(cluster_id)->Stats(deadline); }

std::shared_ptr<Link> Engine::GetLink(uint64_t cluster_id) {
  std::shared_ptr<Link> link = FindLink(cluster_id);
  if (!link) Fail(LLM_NOT_YET_LINK, "cluster " + std::to_string(cluster_id) + " is not linked");
  return link;
}

std::shared_ptr<Link> Engine::FindLink(uint64_t cluster_id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = links_.find(cluster_id);
    if (it != links_.end()) return it->second;
  }
  std::lock_guard<std::mutex> lock(rev_mu_);
  auto it = reverse_links_.find(cluster_id);
  return it == reverse_links_.end() ? nullptr : it->second;
}

std::pair<std::shared_ptr<Link>, std::shared_ptr<Link>> Engine::BothEnds(uint64_t id) {
  std::shared_ptr<Link> own, inbound;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = links_.find(id);
    if (it != links_.end()) own = it->second;
  }
  {
    std::lock_guard<std::mutex> lock(rev_mu_);
    auto it = reverse_links_.find(id);
    if (it != reverse_links_.end()) inbound = it->second;
  }
  return {own, inbound};
}

void Engine::Forget(uint64_t id, const std::shared_ptr<Link> &link) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = links_.find(id);
    if (it != links_.end() && it->second == link) links_.erase(it);
  }
  std::lock_guard<std::mutex> lock(rev_mu_);
  auto it = reverse_links_.find(id);
  if (it != reverse_links_.end() && it->second == link) reverse_links_.erase(it);
}

// A client's reverse channel counts until that client unlinks or ends (its channel then
// closes: dropped here, as the Python listener does).
bool Engine::HasLinks() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!links_.empty()) return true;
  }
  return !LinkIds(true).empty();
}

std::vector<uint64_t> Engine::LinkIds(bool inbound) {
  std::vector<uint64_t> ids;
  if (!inbound) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto &kv : links_) ids.push_back(kv.first);
    return ids;
  }
  std::vector<std::shared_ptr<Link>> gone;
  {
    std::lock_guard<std::mutex> lock(rev_mu_);
    for (auto it = reverse_links_.begin(); it != reverse_links_.end();) {
      if (it->second->Gone()) {
        gone.push_back(std::move(it->second));
        it = reverse_links_.erase(it);
      } else {
        ids.push_back(it->first);
        ++it;
      }
    }
  }
  for (auto &link : gone) link->Close(Deadline(), true);
  return ids;
}

/// A client's reverse channel (one of the server's adopter threads calls this after the
/// handshake, never an I/O pool thread: the PING of a link it would replace may wait; the
/// handshake checked that the client holds that cluster's control channel: `token`): our end of its
/// link, replacing an older one only if that echoed the same token or its control channel is
/// gone (another control channel of that id, which anyone may open, cannot take a live
/// link). Not adopted (that, closing, as many reverse channels as connections already, or
/// as the per-peer cap from `peer`'s address): the handshake is answered with ERROR
/// LLM_LINK_FAILED, so the client's link fails. `eager`: its HELLO set FEATURE_EAGER_WRITE
/// (our pushes on it take one round trip).
void Engine::AdoptReverse(Server &server, uint64_t cluster_id, std::unique_ptr<Conn> conn,
                          const std::vector<uint8_t> &last, const std::string &token, const std::string &peer,
                          bool eager) {
  auto link = std::make_shared<Link>(cluster_id, std::move(conn), token, peer, eager);
  const size_t max_conns = options_.max_conns, max_per_peer = options_.max_per_peer;
  {
    // A live-looking reverse channel of another control channel of this id: asked for a
    // PONG first, outside the locks. One whose linker's channels died unseen (a cut wire)
    // does not answer and is closed, so the check below lets the relink replace it; a live
    // one answers and keeps its link.
    std::shared_ptr<Link> incumbent;
    {
      std::lock_guard<std::mutex> lock(rev_mu_);
      auto held = reverse_links_.find(cluster_id);
      if (held != reverse_links_.end() && !auth::Same(held->second->link_token(), token) && !held->second->Gone() &&
          server.HoldsToken(cluster_id, held->second->link_token()))
        incumbent = held->second;
    }
    if (incumbent) incumbent->AnswersPing(After(kReverseProbe));
  }
  std::shared_ptr<Link> old;
  std::vector<std::shared_ptr<Link>> gone;  // closed by their clients: pruned
  try {
    link->Adopted(
        [&]() -> std::string {
          std::lock_guard<std::mutex> lock(rev_mu_);
          if (rev_closed_) return "this listener is finalizing: it takes no reverse channel";
          // bounded like connections: a peer cannot hold sockets open without limit this way
          // (the ones their clients closed do not count), and from one address as
          // connections are: one host cannot fill the table and refuse every other link
          auto from_peer = [&] {
            size_t n = 0;
            for (const auto &kv : reverse_links_) n += kv.first != cluster_id && kv.second->peer_key() == peer;
            return n;
          };
          if ((!reverse_links_.count(cluster_id) && reverse_links_.size() >= max_conns) || from_peer() >= max_per_peer)
            for (auto it = reverse_links_.begin(); it != reverse_links_.end();) {
              if (it->second->Gone()) {
                gone.push_back(std::move(it->second));
                it = reverse_links_.erase(it);
              } else {
                ++it;
              }
            }
          if (!reverse_links_.count(cluster_id) && reverse_links_.size() >= max_conns)
            return "too many reverse channels (" + std::to_string(reverse_links_.size()) + ") to this listener";
          if (from_peer() >= max_per_peer)
            return "too many reverse channels (" + std::to_string(from_peer()) + ") from " + peer + " to this listener";
          auto held = reverse_links_.find(cluster_id);
          if (held != reverse_links_.end() && !auth::Same(held->second->link_token(), token) && !held->second->Gone() &&
              server.HoldsToken(cluster_id, held->second->link_token()))
            return "cluster " + std::to_string(cluster_id) +
                   " already has a reverse channel to this listener, belonging to another of its control channels, "
                   "which is live";
          old = std::move(reverse_links_[cluster_id]);
          reverse_links_[cluster_id] = link;
          return std::string();
        },
        last, After(kAdoptWait));     // not adopted: the channel closes with `link`
  } catch (const std::exception &) {  // the client went away mid-handshake: its link never came up
    std::lock_guard<std::mutex> lock(rev_mu_);
    auto it = reverse_links_.find(cluster_id);
    if (it != reverse_links_.end() && it->second == link) reverse_links_.erase(it);
  }
  if (old) old->Close(Deadline(), true);
  for (auto &g : gone) g->Close(Deadline(), true);
}

}  // namespace datadist
