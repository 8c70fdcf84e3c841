"""``datadist probe HOST:PORT``: what stands between this host and a datadist listener.

``link_clusters`` answers LLM_LINK_FAILED for every reason a link can fail. The probe walks
a link's handshake one step at a time, as a client that links would, and stops at the first
step that fails, naming it:

====================  ===============================================================
``unreachable``       the connection cannot be made (no route, name unknown)
``timeout``           no answer to the connection (host down, a firewall drops it)
``closed``            the host answers but nothing listens on the port
``not-datadist``      something listens, but it does not speak datadist's protocol
``tls``               the listener wants TLS and we did not offer it, or the reverse,
                      or the certificates do not check out
``version``           a datadist listener of another protocol version
``refused``           the listener refused the Hello (its message says why: connection
                      caps, finalizing, ...)
``cluster-id``        the listener is another cluster than the one asked for
``auth``              the shared secrets do not match (one side has none, or they differ)
``ok``                a link would be made
====================  ===============================================================

Who calls: the ``datadist probe`` command (cli.py), or code that wants the reason as data
(:func:`probe`). Blocks up to ``timeout`` seconds per connection (two at most). The probe
identifies itself as cluster ``own_id`` with no reverse channel: the listener sees a
connection that ends right after its handshake, as after ``datadist info --peer``.
"""

from __future__ import annotations

import socket
import ssl
import time
from dataclasses import dataclass

from datadist.core.address import format_host_port as _at
from datadist.core.config import HostIdentity
from datadist.core.errors import RemoteProtocolError
from datadist.wire import auth
from datadist.wire import protocol as p

ROLES = {1: "PROMPT", 2: "DECODER", 3: "MIX"}  # LLMRole's values


@dataclass(frozen=True)
class Finding:
    """What the probe found: ``kind`` (the module docstring's table) and one line of text."""

    kind: str
    text: str

    @property
    def ok(self) -> bool:
        return self.kind == "ok"


class _Stop(Exception):
    """A step failed: carries the finding."""

    def __init__(self, kind: str, text: str) -> None:
        super().__init__(text)
        self.finding = Finding(kind, text)


def _connect(host: str, port: int, timeout: float) -> socket.socket:
    try:
        return socket.create_connection((host, port), timeout=timeout)
    except ConnectionRefusedError:
        raise _Stop("closed", f"{_at(host, port)} refused the connection: nothing listens on "
                    f"port {port} there (a PROMPT listens only with LLMConfig.listen_ip_info "
                    "= 'ip:port'; is it running, and is the port the one it set?)") from None
    except TimeoutError:
        raise _Stop("timeout", f"no answer from {_at(host, port)} within {timeout:g} s: the "
                    "host is down, a firewall drops the packets, or the address is "
                    "wrong") from None
    except OSError as e:
        raise _Stop("unreachable", f"cannot reach {_at(host, port)}: "
                    f"{e.strerror or e}") from None


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = b""
    while len(buf) < n:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            got = sock.recv(n - len(buf))
        except TimeoutError:
            raise _Stop("not-datadist", "the listener accepted the connection but did not "
                        "answer datadist's Hello in time: not a datadist listener (or one "
                        "too busy to answer)") from None
        except ssl.SSLError as e:
            raise _Stop("tls", f"TLS failed after the handshake: {e.reason or e} (does the "
                        "listener's CA sign this host's certificate?)") from None
        except OSError as e:
            if not buf:
                raise EOFError from e
            raise _Stop("not-datadist", f"the connection broke mid-answer: "
                        f"{e.strerror or e}") from None
        if not got:
            if not buf:
                raise EOFError
            return buf
        buf += got
    return buf


def _speaks_tls(host: str, port: int, timeout: float) -> bool:
    """Does ``host:port`` answer a TLS ClientHello as a TLS server would?"""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError:
        return False
    try:
        with ctx.wrap_socket(sock) as tls:
            tls.settimeout(timeout)
            return True  # a handshake (it asks for our certificate later, if at all)
    except ssl.SSLError as e:
        # An alert from the server (a certificate it wants, say) is TLS; garbage is not.
        return "WRONG_VERSION_NUMBER" not in str(e) and "EOF" not in type(e).__name__
    except OSError:
        return False
    finally:
        sock.close()


def _read_frame(sock: socket.socket, deadline: float, host: str, port: int,
                tls: bool) -> p.Message:
    try:
        head = _recv_exact(sock, p.HEADER_SIZE, deadline)
    except EOFError:
        raise _Stop("eof", "") from None
    if head[:1] == b"\x15" and head[1:2] == b"\x03":
        raise _Stop("tls", f"{_at(host, port)} answered with a TLS alert: it requires TLS "
                    "(DATADIST_TLS_CERT / _KEY / _CA, or LLMConfig.tls_*_file)")
    if head[:2] != p.MAGIC:
        what = " (an HTTP server)" if head.startswith(b"HTTP") else ""
        raise _Stop("not-datadist", f"{_at(host, port)} is not a datadist listener{what}: it "
                    f"answered {head[:12]!r}")
    try:
        header = p.decode_header(head)
    except RemoteProtocolError as e:
        version = head[2]
        if version != p.VERSION:
            raise _Stop("version", f"{_at(host, port)} is a datadist listener of protocol "
                        f"version {version}; this datadist speaks version {p.VERSION}: run "
                        "the same datadist release on both sides") from None
        raise _Stop("not-datadist", f"{_at(host, port)} sent a malformed frame: {e}") from None
    try:
        payload = _recv_exact(sock, header.length, deadline) if header.length else b""
        return p.decode_payload(header.type, payload)
    except (EOFError, RemoteProtocolError) as e:
        raise _Stop("not-datadist", f"{_at(host, port)} sent a malformed frame: {e}") from None


def _handshake(sock: socket.socket, host: str, port: int, cluster_id: int | None, own_id: int,
               secret: bytes | None, timeout: float, tls: bool) -> Finding:
    ident = HostIdentity.current()
    hello = p.Hello(own_id, 2, ident.pid, ident.pid_ns, ident.boot_id,
                    p.FEATURE_AUTH if secret else 0, auth.nonce() if secret else b"")
    deadline = time.monotonic() + timeout
    sock.sendall(p.encode(hello))
    welcome = _read_frame(sock, deadline, host, port, tls)
    if isinstance(welcome, p.Error):
        raise _Stop("refused", f"{_at(host, port)} refused the link: {welcome.message}")
    if not isinstance(welcome, p.Welcome):
        raise _Stop("not-datadist", f"{_at(host, port)} answered Hello with "
                    f"{type(welcome).__name__}, not Welcome")
    peer = welcome.cluster_id
    if cluster_id is not None and peer != cluster_id:
        raise _Stop("cluster-id", f"{_at(host, port)} is cluster {peer}, not {cluster_id}: set "
                    f"LLMClusterInfo.remote_cluster_id = {peer} (the PROMPT's own cluster "
                    "id), or link to the right address")
    required = bool(welcome.features & p.FEATURE_AUTH)
    if required and secret is None:
        raise _Stop("auth", f"cluster {peer} at {_at(host, port)} requires a shared secret and "
                    "none is set here (DATADIST_AUTH_SECRET or LLMConfig.auth_secret)")
    if secret is not None and not required:
        raise _Stop("auth", f"cluster {peer} at {_at(host, port)} uses no shared secret but one "
                    "is set here: a link refuses a peer that cannot prove it; unset it here "
                    "or set the same one there")
    if secret is not None:
        # A control channel's WELCOME ends its proof with the link token (FEATURE_TOKEN).
        parts = auth.split_server_proof(p.split_token(welcome.proof, welcome.features)[0])
        want = auth.server_proof(secret, hello.proof, parts[0], peer, own_id) if parts else b""
        if parts is None or not auth.same(want[auth.NONCE_BYTES:], parts[1]):
            raise _Stop("auth", f"cluster {peer} at {_at(host, port)} has another shared secret "
                        "than this host")
        sock.sendall(p.encode(p.Auth(auth.client_proof(secret, hello.proof, parts[0], peer,
                                                       own_id))))
        ok = _read_frame(sock, deadline, host, port, tls)
        if not isinstance(ok, p.Ok):
            why = ok.message if isinstance(ok, p.Error) else type(ok).__name__
            raise _Stop("auth", f"cluster {peer} at {_at(host, port)} refused this host's proof "
                        f"of the shared secret: {why}")
    where = ("this host" if ident.claims_same_host(welcome.boot_id)
             else "another host")
    return Finding("ok", (
        f"{_at(host, port)} is a datadist listener: cluster {peer}, role "
        f"{ROLES.get(welcome.role, welcome.role)}, pid {welcome.pid} on {where}"
        f"{', shared secret checked' if secret else ''}{', TLS' if tls else ''}: a link "
        "would be made"))


def probe(host: str, port: int, cluster_id: int | None = None, *,
          own_id: int = 2**63 - 1, secret: bytes | None = None,
          tls: ssl.SSLContext | None = None, timeout: float = 3.0) -> Finding:
    """Walk a link's handshake to ``host:port`` and say where it stops (module docstring).

    ``cluster_id``: the cluster the caller means to link to (None: any); ``secret`` and
    ``tls``: what this host would link with. Never raises for what the peer does."""
    try:
        sock = _connect(host, port, timeout)
        try:
            if tls is not None:
                sock.settimeout(timeout)
                try:
                    wrapped = tls.wrap_socket(sock)
                except ssl.SSLError as e:
                    raise _Stop("tls", f"the TLS handshake with {_at(host, port)} failed: "
                                f"{e.reason or e} (the listener may not use TLS, or the "
                                "certificates are not signed by each other's CA)") from None
                except OSError as e:
                    raise _Stop("tls", f"{_at(host, port)} closed the connection during the TLS "
                                f"handshake ({e.strerror or e}): the listener may not use "
                                "TLS") from None
                sock = wrapped
            return _handshake(sock, host, port, cluster_id, own_id, secret, timeout,
                              tls is not None)
        finally:
            sock.close()
    except _Stop as stop:
        if stop.finding.kind != "eof":
            return stop.finding
    # The listener closed the connection at our Hello without a word.
    if tls is None and _speaks_tls(host, port, timeout):
        return Finding("tls", f"{_at(host, port)} speaks TLS: it requires TLS certificates "
                       "(DATADIST_TLS_CERT / _KEY / _CA, or LLMConfig.tls_*_file)")
    return Finding("refused", f"{_at(host, port)} closed the connection at datadist's Hello "
                   "without a word: its connection caps are full, it is finalizing, or it "
                   "is not a datadist listener")


def main_args(peer: str, cluster_id: int | None, own_id: int, timeout: float) -> Finding:
    """``datadist probe``'s work: the secret and TLS files as a link would take them (the
    environment: DATADIST_AUTH_SECRET, DATADIST_TLS_CERT / _KEY / _CA)."""
    from datadist.core.address import parse_host_port
    from datadist.core.config import engine_settings
    from datadist.core.options import parse_options

    host, port = parse_host_port(peer)
    table = engine_settings(parse_options({}))  # the core's option table, as init reads it
    files = table["tls"]
    return probe(host, port, cluster_id, own_id=own_id, secret=table["secret"],
                 tls=None if files is None else files.client_context(), timeout=timeout)


__all__ = ["Finding", "main_args", "probe"]
