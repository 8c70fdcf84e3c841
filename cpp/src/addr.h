// Host addresses, IPv4 and IPv6: the one place the C++ library reads and writes them.
//
// The forms, as LLM-DataDist's LLMUtils::ParseListenIpInfo takes them: an "ip:port" string
// writes an IPv6 address in brackets ("[::1]:26000") and an IPv4 one bare ("127.0.0.1:26000",
// or in brackets too); a bare IPv6 address with a port ("::1:26000") is refused. An ip on its
// own (IpInfo::ip) is a bare literal, "::1" or "127.0.0.1". Zone ids ("fe80::1%eth0") are not
// taken. Nothing here blocks or touches the network.
#ifndef DATADIST_CPP_ADDR_H_
#define DATADIST_CPP_ADDR_H_

#include <sys/socket.h>

#include <cstdint>
#include <string>

namespace datadist {

/// A socket address to bind or connect, of either family.
struct SockAddr {
  sockaddr_storage storage{};
  socklen_t len = 0;
  int family() const { return storage.ss_family; }
  const sockaddr *get() const { return reinterpret_cast<const sockaddr *>(&storage); }
  sockaddr *get() { return reinterpret_cast<sockaddr *>(&storage); }
};

/// True when `ip` is a bare IPv4 or IPv6 literal.
bool IsIpLiteral(const std::string &ip);

/// `ip` (a bare literal) and `port` as a socket address; LLM_PARAM_INVALID for anything else.
SockAddr ToSockAddr(const std::string &ip, uint16_t port);

/// The ip and port of a socket address (an accepted peer's, a bound socket's).
std::string IpOf(const sockaddr_storage &addr);
uint16_t PortOf(const sockaddr_storage &addr);

/// "[ip]:port" for an IPv6 ip, "ip:port" otherwise: for messages and options.
std::string FormatHostPort(const std::string &ip, uint16_t port);

/// Splits an "ip:port" string strictly (the forms above); LLM_PARAM_INVALID naming the text
/// otherwise. An IPv6 host comes back without brackets, in short form; an IPv4 one as written
/// (binding or connecting checks it).
void ParseHostPort(const std::string &text, std::string &host, uint16_t &port);

}  // namespace datadist

#endif  // DATADIST_CPP_ADDR_H_
