// TLS for links that cross untrusted networks (an option), with OpenSSL 3, under both APIs
// (docs/security.md, "TLS").
//
// Both ends present a certificate signed by the configured CA (mutual TLS: a peer without a
// certificate, or with one the CA did not sign, fails the handshake), TLS 1.2 at least, the
// CA file alone as trust store (not the system's), and no host name check: peers are
// identified by cluster id in the handshake that follows, and deployments link by IP address.
//
// Who calls: Engine::Open loads a Context (EngineOptions::tls); Conn (net.h) runs a Session
// over its socket when the link (link.cc) or the listener (server.cc) has a Context. Nothing
// here blocks: a Session's calls are non-blocking steps, and Conn waits between them within
// its deadlines. This header names no OpenSSL type, so a build without OpenSSL's headers
// compiles it too: there Available() is false and Context::Load refuses
// (LLM_FEATURE_NOT_ENABLED), and the Python package keeps TLS configurations on its own
// engine (core/native.py refusal()).
#ifndef DATADIST_CPP_TLS_H_
#define DATADIST_CPP_TLS_H_

#include <cstddef>
#include <memory>
#include <string>

namespace datadist {
namespace tls {

/// The PEM files of one process: its certificate, that certificate's key, and the CA that
/// signs every peer's. All three or none.
struct Files {
  std::string cert, key, ca;
  bool empty() const { return cert.empty() && key.empty() && ca.empty(); }
};

/// Was this build made with OpenSSL (TLS possible)?
bool Available();
/// What TLS this build has, for `datadist info` and logs: the OpenSSL version it runs with,
/// or why there is none.
std::string Describe();

/// The client and server settings of one process (two SSL_CTX), made once at Engine::Open and
/// shared, read-only, by every connection. Thread-safe.
class Context {
 public:
  /// Loads and checks the files. LLM_PARAM_INVALID naming the file that cannot be read, is not
  /// a regular file, or does not hold what it should (wording as Python's TlsConfig);
  /// LLM_FEATURE_NOT_ENABLED when the build has no TLS.
  static std::shared_ptr<const Context> Load(const Files &files);
  ~Context();
  Context(const Context &) = delete;
  Context &operator=(const Context &) = delete;
  const Files &files() const { return files_; }

 private:
  Context() = default;
  friend class Session;
  Files files_;
  void *client_ = nullptr;  // SSL_CTX*
  void *server_ = nullptr;  // SSL_CTX*
};

/// One connection's TLS state over a non-blocking socket it does not own. Every call is one
/// non-blocking step: it does what the socket allows and says what to wait for. Used by its
/// connection's owner only (not thread-safe).
class Session {
 public:
  enum class Want { kNothing, kRead, kWrite };
  /// What a Read or Write did.
  struct Step {
    size_t bytes = 0;            // moved (> 0), or 0 with `want` / `eof` / `error`
    Want want = Want::kNothing;  // wait for this, then call again
    bool eof = false;            // the peer closed the connection (close_notify or EOF)
    std::string error;           // the connection broke (what OpenSSL said)
  };
  /// A session on `fd` as a client or as the server. LLM_LINK_FAILED if OpenSSL cannot make one.
  Session(const Context &ctx, int fd, bool server);
  ~Session();
  Session(const Session &) = delete;
  Session &operator=(const Session &) = delete;

  /// One step of the handshake: true once it is complete; false with `want` set to what to wait
  /// for. A failed handshake (a certificate refused, not TLS at all, the peer gone) throws
  /// LLM_LINK_FAILED "TLS handshake with <address> failed: <why>".
  bool Handshake(const std::string &address, Want &want);
  Step Read(void *data, size_t n);
  Step Write(const void *data, size_t n);
  /// Decrypted bytes read from the socket and not taken yet: a connection with some is
  /// readable whatever its socket says.
  size_t Pending() const;
  /// Does the peer have sent anything but application data since (a session ticket, a key
  /// update), or nothing at all? Reads what the socket holds, never blocks; false when
  /// application data, an EOF or an error came (an idle connection's peer closed or broke the
  /// protocol). For Conn::PeerGone.
  bool IdleRecordsOnly();

 private:
  void *ssl_ = nullptr;  // SSL*
};

}  // namespace tls
}  // namespace datadist

#endif  // DATADIST_CPP_TLS_H_
