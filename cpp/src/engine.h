// The engine both APIs drive: who we are (Identity), our caches (Registry), our listener
// (Server) and our links, both the ones we make (Connect) and our ends of the ones peers make
// to us (their reverse channels, adopted by the listener). CANN's C++ API (llm_datadist.cc)
// and the Python package's extension module (cpp/python/) are two facades over it: they check
// arguments, build plans and map errors; the engine owns every socket and every thread.
//
// Thread-safety: every method may be called from any thread. Calls that touch the network
// block up to the deadline they are given (Connect, Link::Read / Write, Close); the others
// take short locks only. Errors are thrown as datadist::Error with their status code.
#ifndef DATADIST_CPP_ENGINE_H_
#define DATADIST_CPP_ENGINE_H_

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "link.h"
#include "net.h"
#include "nixl.h"
#include "registry.h"
#include "server.h"

namespace datadist {

struct EngineOptions {
  std::string secret;        // shared secret linked peers must prove (empty: none)
  bool same_host = true;     // links may use a same-host peer's local channel; serve ours
  bool allow_ptrace = true;  // may PR_SET_PTRACER_ANY be set for same-host readers
  bool shm = true;           // same-host links read owners' shared memory (off: transport cma)
  bool shm_forced = false;   // transport shm: links name that path "shm" (Link::SetShm)
  size_t max_conns = 256;    // inbound connections (and reverse channels) served at once
  size_t max_per_peer = 64;  // ... of them from one peer (IP address, or uid for local ones)
  /// Mutual TLS on every connection, both ways (tls.h; tls::Context::Load makes it); null: none.
  std::shared_ptr<const tls::Context> tls;
  /// Serving NIXL readers (nixl.h): off unless asked for, as Python's EngineConfig.
  nixl::ServeOptions nixl;
};

/// Why `text`, an llm.LocalCommRes value, fails CANN's parse at link time
/// (RankTableGeneratorFactory::Create: at most 64 KiB, JSON, a string "version" of "1.0" or
/// "1.2"); "" when it passes. Empty text passes (CANN generates one). Never throws.
std::string CommResError(const std::string &text);

class Engine {
 public:
  /// s a reverse channel's last handshake frame may take
  static constexpr double kAdoptWait = 10.0;
  /// s a contested reverse channel has to answer a PING
  static constexpr double kReverseProbe = 0.5;

  Engine(uint64_t cluster_id, int32_t role);
  ~Engine();
  Engine(const Engine &) = delete;
  Engine &operator=(const Engine &) = delete;

  /// (Re)starts the engine with `options` (after Close too): no listener yet, no links.
  /// LLM_PARAM_INVALID when options.nixl.read and NIXL cannot be used (what to install).
  void Open(const EngineOptions &options);
  /// Stops the listener, closes every link at once (transfers in flight fail) and drops every
  /// cache, waiting up to `wait_s` for leases. Returns how many caches are still leased
  /// after that (a copy in flight): memory the embedder gave must stay mapped (leaked), as
  /// the registry keeps its own (Registry::Clear). Idempotent (0 when already closed).
  int Close(double wait_s);

  uint64_t cluster_id() const { return ident_.cluster_id; }
  int32_t role() const { return ident_.role.load(); }
  void set_role(int32_t role) { ident_.role = role; }
  Registry &registry() { return registry_; }
  /// The owner side of NIXL (nixl.h): whether it serves, its agent and leases.
  nixl::Owner &nixl_owner() { return *nixl_; }
  const EngineOptions &options() const { return options_; }

  /// Listens on host:port (port 0 picks one), replacing a listener we had. LLM_LINK_FAILED.
  void Listen(const std::string &host, uint16_t port);
  void StopListening();
  bool listening() const;
  uint16_t port() const;  // 0 when not listening

  /// Opens a link to the listener at host:port within `deadline` (a peer with our own cluster
  /// id included: vllm-ascend's V0 connector gives both ends id 0) and files it under
  /// `cluster_id`, or with `take_peer_id` under the id the peer announces (CANN's
  /// LinkMsgHandler). Returns the id it is filed under. LLM_ALREADY_LINK when we hold a link
  /// to that id; LLM_LINK_FAILED (the reason kept for LastLinkFailure and, unless
  /// DATADIST_LINK_WARNINGS=0 or `quiet`, told on stderr) for any failure to link.
  uint64_t Connect(uint64_t cluster_id, const std::string &host, uint16_t port, Deadline deadline, bool take_peer_id,
                   bool quiet = false);
  /// Two-sided links (the Python package's link() with rank tables): a link opened and checked
  /// as Connect's, but not filed (transfers cannot use it yet) and, unless `reverse`, without
  /// a reverse channel (every member connects to every other). AdoptLink files it:
  /// LLM_ALREADY_LINK (left open) when that cluster is linked already.
  std::shared_ptr<Link> OpenLink(uint64_t cluster_id, const std::string &host, uint16_t port, Deadline deadline,
                                 bool take_peer_id, bool reverse);
  void AdoptLink(const std::shared_ptr<Link> &link);
  /// One more listener at host:port (a two-sided link's rank-table address), serving the same
  /// caches and adopting reverse channels as the main one; returns its key for StopAlso.
  /// LLM_LINK_FAILED if it cannot bind.
  int ListenAlso(const std::string &host, uint16_t port);
  void StopAlso(int key);
  /// How many control channels `cluster_id` has opened to any listener of ours so far.
  uint64_t HelloCount(uint64_t cluster_id);
  /// The cluster ids of the peers' control channels live now, on every listener of ours.
  std::vector<uint64_t> InboundControl();
  /// The link transfers to `cluster_id` use: the one we made, else its reverse channel to us.
  /// LLM_NOT_YET_LINK when neither exists.
  std::shared_ptr<Link> GetLink(uint64_t cluster_id);
  std::shared_ptr<Link> FindLink(uint64_t cluster_id);
  /// The two ends of a link with `id`, either may be null: the link we made and the one the
  /// peer made to us (its reverse channel).
  std::pair<std::shared_ptr<Link>, std::shared_ptr<Link>> BothEnds(uint64_t id);
  /// Drops `link` from the tables if it is still filed under `id` (it is not closed here).
  void Forget(uint64_t id, const std::shared_ptr<Link> &link);
  /// Any link up, either end? Reverse channels their clients closed are dropped here.
  bool HasLinks();
  /// The ids of the links we made, and of the live reverse channels peers made to us.
  std::vector<uint64_t> LinkIds(bool inbound);
  /// Why the last link to `id` failed ("" when none failed since it last succeeded).
  std::string LastLinkFailure(uint64_t id);
  /// What a peer's STATS_REQUEST is answered with (metrics.h's StatsJson): its own series,
  /// none while its id's live reverse channel belongs to another control channel (`token`:
  /// the asking connection's, "" for a reverse channel).
  std::string StatsFor(uint64_t peer, const std::string &token);
  /// Asks the linked peer `cluster_id` for its metrics (Link::Stats): the JSON it sent.
  /// LLM_NOT_YET_LINK, and Link::Stats's errors. Blocks up to the deadline.
  std::string PeerStats(uint64_t cluster_id, Deadline deadline);
  /// After Open: this process's llm.LocalCommRes (Python: LLMConfig.local_comm_res), `set`
  /// false when the option is absent. CANN accepts any text at Initialize and parses it when
  /// it links (RankTableGeneratorFactory::Create): a text that is not JSON, or whose
  /// "version" is not "1.0" / "1.2", fails the link on both ends with LLM_PARAM_INVALID.
  /// Here, alike: a Connect of ours fails with it before dialing when our own text is bad;
  /// when ours is set, a Connect asks the peer (STATS, within its deadline) and fails with
  /// it when the peer's is bad; and our STATS answer carries "comm_res_error" when ours is
  /// bad. An empty text is valid (CANN generates one then). Called by both faces' init.
  void SetLocalCommRes(bool set, const std::string &text);

 private:
  std::unique_ptr<Server> MakeServer(const std::string &host, uint16_t port);
  void AdoptReverse(Server &server, uint64_t cluster_id, std::unique_ptr<Conn> conn, const std::vector<uint8_t> &last,
                    const std::string &token, const std::string &peer, bool eager);
  void NoteLinkFailure(uint64_t id, const std::string &host, uint16_t port, const std::string &why, bool quiet);
  /// LLM_PARAM_INVALID when `link`'s peer says its llm.LocalCommRes is not valid (SetLocalCommRes).
  void CheckPeerCommRes(Link &link, Deadline deadline);

  /// What ident_.stats reaches the engine through: links hold a copy of that answer, and a
  /// link opened but never adopted (OpenLink) may outlive the engine; the destructor sets
  /// `engine` null first, under `mu`, and the answer then tells nothing.
  struct Alive {
    std::mutex mu;
    Engine *engine = nullptr;
  };
  std::shared_ptr<Alive> alive_ = std::make_shared<Alive>();
  Identity ident_;
  EngineOptions options_;
  Registry registry_;
  std::unique_ptr<nixl::Owner> nixl_;         // outlives the servers (declared after them: destroyed later)
  std::shared_ptr<nixl::Agent> nixl_reader_;  // options_.nixl.read: the agent our links read with
  mutable std::mutex mu_;                     // guards server_, links_, open_
  bool open_ = false;
  std::unique_ptr<Server> server_;
  std::map<int, std::unique_ptr<Server>> extra_;  // ListenAlso's, by key
  int next_extra_ = 1;
  std::map<uint64_t, std::shared_ptr<Link>> links_;
  // Cluster ids a Connect is linking now (under mu_): a second Connect to one waits for the
  // first, then is LLM_ALREADY_LINK if it linked (two links at once would fight over the
  // peer's one reverse-channel slot for us, and the loser would read as a failed link).
  std::set<uint64_t> connecting_;
  std::condition_variable connected_;  // a Connect ended (with mu_)
  std::mutex hello_mu_;                // guards hellos_
  std::map<uint64_t, uint64_t> hellos_;
  std::mutex fail_mu_;  // guards link_failures_
  std::map<uint64_t, std::string> link_failures_;
  std::mutex comm_res_mu_;      // guards the two below (SetLocalCommRes)
  bool comm_res_set_ = false;   // llm.LocalCommRes given
  std::string comm_res_error_;  // why it is not valid ("" when it is, or not given)
  std::mutex rev_mu_;           // guards the two below (its own: Listen stops the server under mu_)
  std::map<uint64_t, std::shared_ptr<Link>> reverse_links_;
  bool rev_closed_ = false;
};

}  // namespace datadist

#endif  // DATADIST_CPP_ENGINE_H_
