#include "addr.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <cstring>

#include "errors.h"

namespace datadist {
namespace {

// `text` as a short-form IPv6 literal, or "" when it is none.
std::string Ipv6Literal(const std::string &text) {
  in6_addr a{};
  if (text.find(':') == std::string::npos || inet_pton(AF_INET6, text.c_str(), &a) != 1) return "";
  char buf[INET6_ADDRSTRLEN] = {0};
  return inet_ntop(AF_INET6, &a, buf, sizeof(buf)) ? std::string(buf) : "";
}

bool IsIpv4Literal(const std::string &text) {
  in_addr a{};
  return inet_pton(AF_INET, text.c_str(), &a) == 1;
}

bool IsPort(const std::string &p) {
  return !p.empty() && p.size() <= 5 && p.find_first_not_of("0123456789") == std::string::npos &&
         std::stoul(p) <= 65535;
}

}  // namespace

bool IsIpLiteral(const std::string &ip) { return IsIpv4Literal(ip) || !Ipv6Literal(ip).empty(); }

SockAddr ToSockAddr(const std::string &ip, uint16_t port) {
  SockAddr out;
  if (ip.find(':') != std::string::npos) {
    auto *in6 = reinterpret_cast<sockaddr_in6 *>(&out.storage);
    in6->sin6_family = AF_INET6;
    in6->sin6_port = htons(port);
    if (inet_pton(AF_INET6, ip.c_str(), &in6->sin6_addr) != 1) Invalid("not an IP address: '" + ip + "'");
    out.len = sizeof(sockaddr_in6);
  } else {
    auto *in = reinterpret_cast<sockaddr_in *>(&out.storage);
    in->sin_family = AF_INET;
    in->sin_port = htons(port);
    if (inet_pton(AF_INET, ip.c_str(), &in->sin_addr) != 1) Invalid("not an IP address: '" + ip + "'");
    out.len = sizeof(sockaddr_in);
  }
  return out;
}

std::string IpOf(const sockaddr_storage &addr) {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (addr.ss_family == AF_INET6) {
    (void)inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6 *>(&addr)->sin6_addr, buf, sizeof(buf));
  } else {
    (void)inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in *>(&addr)->sin_addr, buf, sizeof(buf));
  }
  return buf;
}

uint16_t PortOf(const sockaddr_storage &addr) {
  return ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<const sockaddr_in6 *>(&addr)->sin6_port
                                          : reinterpret_cast<const sockaddr_in *>(&addr)->sin_port);
}

std::string FormatHostPort(const std::string &ip, uint16_t port) {
  const std::string p = std::to_string(port);
  return ip.find(':') != std::string::npos ? "[" + ip + "]:" + p : ip + ":" + p;
}

void ParseHostPort(const std::string &text, std::string &host, uint16_t &port) {
  std::string h, p;
  if (!text.empty() && text[0] == '[') {
    const size_t close = text.find(']');
    if (close != std::string::npos) {
      const std::string inner = text.substr(1, close - 1);
      h = Ipv6Literal(inner);
      if (h.empty() && IsIpv4Literal(inner)) h = inner;  // the original's CheckIp takes both
    }
    if (h.empty() || close + 1 >= text.size() || text[close + 1] != ':')
      Invalid("expected '[ipv6]:port' (e.g. '[::1]:26000'), got '" + text + "'");
    p = text.substr(close + 2);
  } else {
    const size_t colon = text.rfind(':');
    if (colon != std::string::npos && text.find(':') != colon)
      Invalid("an IPv6 address with a port is written in brackets, e.g. '[::1]:26000'; got '" + text + "'");
    if (colon == std::string::npos || colon == 0) Invalid("expected 'ip:port', got '" + text + "'");
    h = text.substr(0, colon);
    p = text.substr(colon + 1);
  }
  if (!IsPort(p)) Invalid("expected 'ip:port' with a port in [0, 65535], got '" + text + "'");
  host = h;
  port = static_cast<uint16_t>(std::stoul(p));
}

}  // namespace datadist
