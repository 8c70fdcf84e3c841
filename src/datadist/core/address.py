"""Host addresses, IPv4 and IPv6: the one place that reads and writes them.

Who calls: the facade (``listen_ip_info``, ``LLMClusterInfo``, rank tables, the CLI's
``--peer``), the engine's Python side (:mod:`datadist.core.comm`: which listener serves an
address) and the vLLM connector. The core parses its own (cpp/src/addr.cc). Nothing here
blocks or touches the network.

The forms, as LLM-DataDist's own parser (``LLMUtils::ParseListenIpInfo``) takes them:

* an "ip:port" string writes an IPv6 address in brackets, ``[::1]:26000``; an IPv4 address
  (or a host name, which the socket layer resolves) bare, ``127.0.0.1:26000``, or in
  brackets too. A bare IPv6 address with a port (``::1:26000``) is ambiguous and refused
  (as the original refuses it), with a message showing the bracketed form;
* an ip on its own (``append_remote_ip_info``, a rank table's ``device_ip``) is a bare
  literal: ``::1`` or ``127.0.0.1``.

IPv6 literals come back in their short form (``::1``, not ``0:0:0:0:0:0:0:1``), so that two
spellings of one address compare equal. Zone ids (``fe80::1%eth0``) are not taken.
"""

from __future__ import annotations

import ipaddress
import socket

from datadist.core.errors import InvalidArgument


def ipv6_literal(text: str) -> str | None:
    """``text`` as a short-form IPv6 literal, or None when it is none (IPv4, a name, junk, or
    a zone id, which the C++ API's inet_pton does not take either)."""
    if ":" not in text or "%" in text:
        return None
    try:
        return ipaddress.IPv6Address(text).compressed
    except ValueError:
        return None


def _ipv4_literal(text: str) -> str | None:
    try:
        return str(ipaddress.IPv4Address(text))
    except ValueError:
        return None


def is_ipv6(host: str) -> bool:
    """Is ``host`` (as :func:`parse_host_port` returns it) an IPv6 address?"""
    return ":" in host


def family(host: str) -> socket.AddressFamily:
    """The socket family to bind or connect ``host`` with."""
    return socket.AF_INET6 if is_ipv6(host) else socket.AF_INET


def format_host_port(host: str, port: int) -> str:
    """``host:port`` for messages and options; an IPv6 host in brackets."""
    return f"[{host}]:{port}" if is_ipv6(host) else f"{host}:{port}"


def serves(listening: str, host: str) -> bool:
    """Does a listener bound to ``listening`` take connections made to ``host``? Its own
    address, or the wildcard of the address's family ("0.0.0.0", "::")."""
    return listening == host or listening == ("::" if is_ipv6(host) else "0.0.0.0")


def parse_host_port(text: str) -> tuple[str, int]:
    """Split an "ip:port" string strictly (module docstring). The host comes back without
    brackets, an IPv6 one in short form. Raises InvalidArgument naming the text."""
    if text.startswith("["):
        inner, sep, rest = text[1:].partition("]")
        host = ipv6_literal(inner) or _ipv4_literal(inner)  # the original's CheckIp takes both
        if not sep or host is None or not rest.startswith(":"):
            raise InvalidArgument(f"expected '[ipv6]:port' (e.g. '[::1]:26000'), got {text!r}")
        port = rest[1:]
    else:
        if text.count(":") > 1:
            raise InvalidArgument(f"an IPv6 address with a port is written in brackets, "
                                  f"e.g. '[::1]:26000'; got {text!r}")
        host, sep, port = text.rpartition(":")
        if not sep or not host:
            raise InvalidArgument(f"expected 'ip:port', got {text!r}")
    if not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise InvalidArgument(f"expected 'ip:port' with a port in [0, 65535], got {text!r}")
    return host, int(port)


def split_address(address: str) -> tuple[str, int]:
    """The (host, port) of an address :func:`format_host_port` wrote (a connection's printable
    address); ("", 0) when it is no such thing (a local channel's "local pid ...")."""
    try:
        return parse_host_port(address)
    except InvalidArgument:
        return "", 0


__all__ = ["family", "format_host_port", "ipv6_literal", "is_ipv6", "parse_host_port",
           "serves", "split_address"]
