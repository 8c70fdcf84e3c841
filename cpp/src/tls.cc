#include "tls.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "errors.h"

#ifdef DATADIST_HAVE_OPENSSL
#include <openssl/bio.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509_vfy.h>
#endif

namespace datadist {
namespace tls {
namespace {

std::string Quoted(const std::string &path) { return "'" + path + "'"; }

/// As Python's TlsConfig.check: each file a readable regular file, else LLM_PARAM_INVALID
/// naming it.
void CheckReadable(const char *what, const std::string &path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0)
    Invalid(std::string("cannot read the TLS ") + what + " file " + Quoted(path) + ": " + std::strerror(errno));
  struct stat st {};
  const bool regular = fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
  ::close(fd);
  if (!regular) Invalid(std::string("the TLS ") + what + " file " + Quoted(path) + " is not a regular file");
}

}  // namespace

#ifdef DATADIST_HAVE_OPENSSL
namespace {

// Python's ssl module's default cipher list for TLS 1.2 (TLS 1.3 suites are OpenSSL's own).
constexpr const char kCiphers[] =
    "@SECLEVEL=2:ECDH+AESGCM:ECDH+CHACHA20:ECDH+AES:DHE+AES:!aNULL:!eNULL:!aDSS:!SHA1:!AESCCM";

/// What OpenSSL's error queue says (emptied), "" when nothing.
std::string Drain() {
  std::string out;
  unsigned long e;
  while ((e = ERR_get_error()) != 0) {
    const char *reason = ERR_reason_error_string(e);
    std::string one = reason ? reason : "error " + std::to_string(ERR_GET_REASON(e));
    if (!out.empty()) out += "; ";
    out += one;
  }
  return out;
}

// The socket under a session: send with MSG_NOSIGNAL (a peer gone mid-write is an error, not
// SIGPIPE: the C++ library's callers keep SIGPIPE's default), recv as is. The descriptor is
// the BIO's data; the connection owns and closes it.
int BioWrite(BIO *b, const char *data, int n) {
  const int fd = static_cast<int>(reinterpret_cast<intptr_t>(BIO_get_data(b)));
  BIO_clear_retry_flags(b);
  ssize_t r = ::send(fd, data, static_cast<size_t>(n), MSG_NOSIGNAL);
  if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) BIO_set_retry_write(b);
  return static_cast<int>(r);
}

int BioRead(BIO *b, char *data, int n) {
  const int fd = static_cast<int>(reinterpret_cast<intptr_t>(BIO_get_data(b)));
  BIO_clear_retry_flags(b);
  ssize_t r = ::recv(fd, data, static_cast<size_t>(n), 0);
  if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) BIO_set_retry_read(b);
  return static_cast<int>(r);
}

long BioCtrl(BIO *, int cmd, long, void *) { return cmd == BIO_CTRL_FLUSH ? 1 : 0; }

int BioCreate(BIO *b) {
  BIO_set_init(b, 1);
  return 1;
}

BIO_METHOD *SocketMethod() {
  static BIO_METHOD *method = [] {
    BIO_METHOD *m = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK, "datadist socket");
    if (m == nullptr) return m;
    BIO_meth_set_write(m, BioWrite);
    BIO_meth_set_read(m, BioRead);
    BIO_meth_set_ctrl(m, BioCtrl);
    BIO_meth_set_create(m, BioCreate);
    return m;
  }();
  return method;
}

/// One side's SSL_CTX with the settings of Python's ssl.create_default_context (which
/// TlsConfig._context in core/config.py uses for the probe), then TLS 1.2 at least, no host
/// name check, a certificate required of the peer.
SSL_CTX *MakeCtx(const Files &f, bool server) {
  ERR_clear_error();
  SSL_CTX *ctx = SSL_CTX_new(server ? TLS_server_method() : TLS_client_method());
  if (ctx == nullptr) Invalid("cannot make a TLS context: " + Drain());
  try {
    SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
    SSL_CTX_set_options(ctx, SSL_OP_NO_COMPRESSION | SSL_OP_CIPHER_SERVER_PREFERENCE | SSL_OP_SINGLE_DH_USE |
                                 SSL_OP_SINGLE_ECDH_USE | SSL_OP_NO_RENEGOTIATION | SSL_OP_IGNORE_UNEXPECTED_EOF);
    if (SSL_CTX_set_cipher_list(ctx, kCiphers) != 1) Invalid("cannot set the TLS ciphers: " + Drain());
    SSL_CTX_set_mode(ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    if (SSL_CTX_load_verify_locations(ctx, f.ca.c_str(), nullptr) != 1)
      Invalid("cannot load the TLS CA file " + Quoted(f.ca) + ": " + Drain());
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
    if (SSL_CTX_use_certificate_chain_file(ctx, f.cert.c_str()) != 1 ||
        SSL_CTX_use_PrivateKey_file(ctx, f.key.c_str(), SSL_FILETYPE_PEM) != 1 || SSL_CTX_check_private_key(ctx) != 1)
      Invalid("cannot load the TLS certificate " + Quoted(f.cert) + " with its key " + Quoted(f.key) + ": " + Drain());
    if (server) {
      // Nothing is resumed (every link makes a fresh handshake): no tickets, no cache.
      SSL_CTX_set_num_tickets(ctx, 0);
      SSL_CTX_set_session_cache_mode(ctx, SSL_SESS_CACHE_OFF);
    }
  } catch (...) {
    SSL_CTX_free(ctx);
    throw;
  }
  return ctx;
}

}  // namespace

bool Available() { return true; }

std::string Describe() { return OpenSSL_version(OPENSSL_VERSION); }

std::shared_ptr<const Context> Context::Load(const Files &files) {
  CheckReadable("certificate", files.cert);
  CheckReadable("key", files.key);
  CheckReadable("CA", files.ca);
  std::shared_ptr<Context> ctx(new Context());
  ctx->files_ = files;
  ctx->client_ = MakeCtx(files, false);
  ctx->server_ = MakeCtx(files, true);
  return ctx;
}

Context::~Context() {
  SSL_CTX_free(static_cast<SSL_CTX *>(client_));
  SSL_CTX_free(static_cast<SSL_CTX *>(server_));
}

Session::Session(const Context &ctx, int fd, bool server) {
  ERR_clear_error();
  SSL *ssl = SSL_new(static_cast<SSL_CTX *>(server ? ctx.server_ : ctx.client_));
  BIO *bio = SocketMethod() ? BIO_new(SocketMethod()) : nullptr;
  if (ssl == nullptr || bio == nullptr) {
    SSL_free(ssl);
    BIO_free(bio);
    Fail(llm_datadist::LLM_LINK_FAILED, "TLS setup failed: " + Drain());
  }
  BIO_set_data(bio, reinterpret_cast<void *>(static_cast<intptr_t>(fd)));
  SSL_set_bio(ssl, bio, bio);  // the SSL owns the BIO
  if (server)
    SSL_set_accept_state(ssl);
  else
    SSL_set_connect_state(ssl);
  ssl_ = ssl;
}

Session::~Session() { SSL_free(static_cast<SSL *>(ssl_)); }

bool Session::Handshake(const std::string &address, Want &want) {
  SSL *ssl = static_cast<SSL *>(ssl_);
  ERR_clear_error();
  errno = 0;
  const int r = SSL_do_handshake(ssl);
  if (r == 1) return true;
  const int err = SSL_get_error(ssl, r);
  if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) {
    want = err == SSL_ERROR_WANT_READ ? Want::kRead : Want::kWrite;
    return false;
  }
  std::string why = Drain();
  const long verify = SSL_get_verify_result(ssl);
  if (verify != X509_V_OK) why += std::string(why.empty() ? "" : ": ") + X509_verify_cert_error_string(verify);
  if (why.empty()) why = err == SSL_ERROR_SYSCALL && errno ? std::strerror(errno) : "the peer closed the connection";
  Fail(llm_datadist::LLM_LINK_FAILED, "TLS handshake with " + address + " failed: " + why);
}

namespace {

Session::Step Outcome(SSL *ssl, int r, size_t moved) {
  Session::Step s;
  if (r == 1) {
    s.bytes = moved;
    return s;
  }
  const int err = SSL_get_error(ssl, r);
  if (err == SSL_ERROR_WANT_READ) {
    s.want = Session::Want::kRead;
  } else if (err == SSL_ERROR_WANT_WRITE) {
    s.want = Session::Want::kWrite;
  } else if (err == SSL_ERROR_ZERO_RETURN || (err == SSL_ERROR_SYSCALL && errno == 0 && ERR_peek_error() == 0)) {
    s.eof = true;
  } else {
    s.error = Drain();
    if (s.error.empty()) s.error = errno ? std::strerror(errno) : "TLS error";
  }
  return s;
}

}  // namespace

Session::Step Session::Read(void *data, size_t n) {
  SSL *ssl = static_cast<SSL *>(ssl_);
  ERR_clear_error();
  errno = 0;
  size_t got = 0;
  const int r = SSL_read_ex(ssl, data, n, &got);
  return Outcome(ssl, r, got);
}

Session::Step Session::Write(const void *data, size_t n) {
  SSL *ssl = static_cast<SSL *>(ssl_);
  ERR_clear_error();
  errno = 0;
  size_t put = 0;
  const int r = SSL_write_ex(ssl, data, n, &put);
  return Outcome(ssl, r, put);
}

size_t Session::Pending() const { return static_cast<size_t>(SSL_pending(static_cast<SSL *>(ssl_))); }

bool Session::IdleRecordsOnly() {
  SSL *ssl = static_cast<SSL *>(ssl_);
  if (SSL_pending(ssl) > 0) return false;
  ERR_clear_error();
  errno = 0;
  char byte;
  size_t got = 0;
  const int r = SSL_peek_ex(ssl, &byte, 1, &got);
  if (r == 1) return false;  // application data on an idle connection
  const int err = SSL_get_error(ssl, r);
  ERR_clear_error();
  return err == SSL_ERROR_WANT_READ;
}

#else  // no OpenSSL at build time

namespace {
constexpr const char kNone[] =
    "this build of the datadist core has no TLS (OpenSSL's headers were not found when it was built: "
    "install libssl-dev and rebuild)";
[[noreturn]] void NoTls() { Fail(llm_datadist::LLM_FEATURE_NOT_ENABLED, kNone); }
}  // namespace

bool Available() { return false; }
std::string Describe() { return kNone; }
std::shared_ptr<const Context> Context::Load(const Files &files) {
  CheckReadable("certificate", files.cert);
  CheckReadable("key", files.key);
  CheckReadable("CA", files.ca);
  NoTls();
}
Context::~Context() = default;
Session::Session(const Context &, int, bool) { NoTls(); }
Session::~Session() = default;
bool Session::Handshake(const std::string &, Want &) { NoTls(); }
Session::Step Session::Read(void *, size_t) { NoTls(); }
Session::Step Session::Write(const void *, size_t) { NoTls(); }
size_t Session::Pending() const { return 0; }
bool Session::IdleRecordsOnly() { return false; }

#endif

}  // namespace tls
}  // namespace datadist
