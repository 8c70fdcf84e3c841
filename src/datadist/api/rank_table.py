"""HCCL-style rank tables for ``LLMDataDist.link``: parsing, and where each rank listens.

Who calls: ``LLMDataDist.link``. Pure: a JSON string in, members out; errors are
LLMException(LLM_PARAM_INVALID).

Accepted format (HCCL rank table v"1.0" and v"1.2"; v1.2's ``super_pod_list`` and a device's
``super_device_id`` are accepted and ignored)::

    {"version": "1.2", "server_count": "1",
     "server_list": [{"server_id": "node-0",
                      "device": [{"device_id": "0", "device_ip": "10.0.0.1", "rank_id": "0"},
                                 {"device_id": "1", "device_ip": "10.0.0.2", "rank_id": "1",
                                  "device_port": 26001}]}],
     "status": "completed"}

Each rank's ``device_ip`` is the host address datadist uses for that member: it listens
there when the rank is its own, and connects there otherwise. An IPv4 or a bare IPv6 literal
(``"fd00::2"``, kept in short form), as HCCL's rank tables write them.

The port of a rank (one rule, computed alike by every member from the table alone):

1. ``device_port`` of that rank's device entry, when given (a datadist extension; an int or
   a digit string, 1..65535): an override;
2. else ``DEFAULT_BASE_PORT + device_id``. Rank tables always carry ``device_id`` (vllm-ascend
   builds them from ``device_id``, ``device_ip``, ``super_device_id`` and ``rank_id`` only),
   and a device id is unique per host, so workers sharing one host address never collide;
3. a device entry without ``device_id``: ``DEFAULT_BASE_PORT + rank_id``.

Two members on one host with the same device id (two processes on one device, or tests)
need ``device_port``.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from typing import Any

from datadist.api.status import LLMException, LLMStatusCode
from datadist.core.address import ipv6_literal

VERSIONS = ("1.0", "1.2")
DEFAULT_BASE_PORT = 16666  # as HIXL's default device NIC port; device d listens on base + d


@dataclass(frozen=True)
class RankEntry:
    """One rank of a rank table: its id, address and port, and device id if given."""

    rank_id: int
    device_ip: str
    device_port: int | None
    device_id: int | None = None


def _bad(msg: str) -> LLMException:
    return LLMException(f"rank_table: {msg}", status_code=LLMStatusCode.LLM_PARAM_INVALID)


def _as_int(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise _bad(f"{what} must be an int, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isascii() and value.isdigit():  # not '²' (int fails)
        return int(value)
    raise _bad(f"{what} must be an int or a digit string, got {value!r}")


def parse(text: str) -> dict[int, RankEntry]:
    """Every device entry of the table, by rank id."""
    try:
        table = json.loads(text)
    except ValueError as e:
        raise _bad(f"not JSON: {e}") from None
    if not isinstance(table, dict):
        raise _bad("must be a JSON object")
    version = table.get("version")
    if version not in VERSIONS:
        raise _bad(f"version must be one of {VERSIONS}, got {version!r}")
    servers = table.get("server_list")
    if not isinstance(servers, list) or not servers:
        raise _bad("server_list must be a non-empty list")
    ranks: dict[int, RankEntry] = {}
    for server in servers:
        devices = server.get("device") if isinstance(server, dict) else None
        if not isinstance(devices, list):
            raise _bad("every server_list entry needs a device list")
        for dev in devices:
            if not isinstance(dev, dict) or "rank_id" not in dev or "device_ip" not in dev:
                raise _bad(f"a device entry needs rank_id and device_ip, got {dev!r}")
            rank = _as_int(dev["rank_id"], "rank_id")
            ip = dev["device_ip"]
            v6 = ipv6_literal(ip) if isinstance(ip, str) else None
            if v6 is not None:
                ip = v6
            else:
                try:
                    if not isinstance(ip, str):
                        raise OSError
                    socket.inet_aton(ip)
                except (OSError, ValueError):  # ValueError: an embedded NUL
                    raise _bad(f"device_ip {ip!r} of rank {rank} is not an IPv4 or IPv6 "
                               "address") from None
            device_id = None
            if "device_id" in dev:
                device_id = _as_int(dev["device_id"], "device_id")
            port = None
            if "device_port" in dev:
                port = _as_int(dev["device_port"], "device_port")
                if not 0 < port <= 65535:
                    raise _bad(f"device_port {port} of rank {rank} out of range [1, 65535]")
            if rank in ranks:
                raise _bad(f"rank_id {rank} appears twice")
            ranks[rank] = RankEntry(rank, ip, port, device_id)
    return ranks


def port_of(entry: RankEntry) -> int:
    """The port rank ``entry`` listens on; see the module docstring."""
    if entry.device_port is not None:
        return entry.device_port
    offset = entry.device_id if entry.device_id is not None else entry.rank_id
    if DEFAULT_BASE_PORT + offset > 65535:
        raise _bad(f"rank {entry.rank_id} has no default port: give device_port")
    return DEFAULT_BASE_PORT + offset


__all__ = ["DEFAULT_BASE_PORT", "RankEntry", "parse", "port_of"]
