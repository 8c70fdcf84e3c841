"""Many hosts: a scale rehearsal of datadist on one machine (issue 27 item 4). Needs root.

    sudo python benchmarks/hosts.py --prefill 4 --decode 4 --mib 4 --rate-mbit 200 \\
        --delay-ms 1 --repeat 3 --json hosts.json

Builds P prefill and D decode "hosts", each a network namespace of its own with one veth
link into a bridge (in a hub namespace), every link limited to ``--rate-mbit`` in each
direction (and delayed by ``--delay-ms`` where the kernel has sch_netem; without it the delay
is left out and the output says so). One datadist process runs in each host: a prefill
registers a cache of ``--mib`` MiB filled with its own pattern; a decoder links to every
prefill at once (the P x D mesh; the time is measured) and then pulls every prefill's cache
at once, one thread per prefill, over datadist's TCP path (forced: on one kernel datadist
would otherwise see one host and use shared memory). The limit is a plain socket over the
same links, the same pattern of transfers: each decoder reads ``--mib`` MiB from every
prefill at once with ``recv_into``. Limit and datadist runs alternate, ``--repeat`` times each.

Reported: aggregate throughput (all bytes / from the first start to the last end) of datadist
and of the plain sockets, beside the sum of the links' configured limits; per-link fairness
(slowest / fastest link's throughput); the time to link the mesh (slowest decoder, and the
wall time for all at once); threads and resident memory of every process; and that every
byte that arrived is the sending prefill's (a wrong byte fails the run).

Everything it creates it removes: the namespaces (and with them the veths, the bridge and
every address, all private 10.99.x.y addresses inside our own namespaces; no traffic leaves
them), and the processes it started. The whole run is bounded by ``--timeout`` seconds.

Who runs it: a person, by hand (docs/performance.md, "Many hosts"); nothing imports it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

SUBNET = "10.99.0"  # private addresses, inside the run's own namespaces only
PREFILL_BASE, DECODE_BASE = 100, 200  # cluster ids
SEED = 0x5EED


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=20, check=check)


# ----------------------------------------------------------------------------- the network


class Net:
    """The namespaces, veths, bridge and qdiscs of a run; :meth:`close` removes them all."""

    def __init__(self, prefix: str, hosts: list[str], rate_mbit: float, delay_ms: float) -> None:
        self.prefix = prefix
        self.hub = f"{prefix}hub"
        self.hosts = hosts  # host names, in address order
        self.made: list[str] = []
        self.rate_mbit = rate_mbit
        self.delay_ms = delay_ms
        self.delay_applied = False
        self.qdisc = ""

    def ns(self, host: str) -> str:
        return f"{self.prefix}{host}"

    def ip(self, host: str) -> str:
        return f"{SUBNET}.{10 + self.hosts.index(host)}"

    def build(self) -> None:
        sh("ip", "netns", "add", self.hub)
        self.made.append(self.hub)
        sh("ip", "-n", self.hub, "link", "add", "name", "br0", "type", "bridge")
        sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        for k, host in enumerate(self.hosts):
            ns = self.ns(host)
            sh("ip", "netns", "add", ns)
            self.made.append(ns)
            sh("ip", "-n", self.hub, "link", "add", "name", f"v{k}", "type", "veth", "peer",
               "name", "eth0", "netns", ns)
            sh("ip", "-n", self.hub, "link", "set", f"v{k}", "master", "br0")
            sh("ip", "-n", self.hub, "link", "set", f"v{k}", "up")
            sh("ip", "-n", ns, "addr", "add", f"{self.ip(host)}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            # the link's limit, both directions: the host's egress and the hub's egress to it
            self._shape(ns, "eth0")
            self._shape(self.hub, f"v{k}")

    def _shape(self, ns: str, dev: str) -> None:
        rate = f"{self.rate_mbit}mbit"
        if self.delay_ms > 0:
            done = sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root",
                      "netem", "delay", f"{self.delay_ms}ms", "rate", rate, "limit", "100000",
                      check=False)
            if done.returncode == 0:
                self.delay_applied, self.qdisc = True, "netem delay + rate"
                return
        # no sch_netem (or no delay asked): a token bucket; burst at least one 64 KiB GSO packet
        burst = max(65536 * 2, int(self.rate_mbit * 1e6 / 8 / 100))
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
           "rate", rate, "burst", str(burst), "latency", "200ms")
        self.qdisc = "tbf rate (no delay: sch_netem missing)" if self.delay_ms > 0 else "tbf rate"

    def close(self) -> None:
        """Removes every namespace of the run (their veths, bridge and addresses go with
        them), after ending any process still inside one (only ours run there)."""
        for ns in reversed(self.made):
            pids = sh("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            sh("ip", "netns", "del", ns, check=False)
        self.made.clear()


# ----------------------------------------------------------------------------- the workers


def proc_stats() -> dict[str, int]:
    """Threads and resident memory (KiB) of this process."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("Threads", "VmRSS"):
            out[k] = int(v.split()[0])
    return {"threads": out.get("Threads", 0), "rss_kib": out.get("VmRSS", 0)}


def pattern(nbytes: int, seed: int) -> Any:
    import numpy as np

    words = np.arange(nbytes // 8, dtype=np.uint64) + np.uint64(seed)
    return words.view(np.uint8)


def say(msg: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def prefill_main(args: argparse.Namespace) -> None:
    """A prefill host: a cache of --mib MiB (its pattern seeded by its id) served through
    datadist and through a plain socket (8-byte count -> that many bytes)."""
    import datadist as ll

    nbytes = args.mib << 20
    data = pattern(nbytes, SEED + args.id)
    dd = ll.LLMDataDist(ll.LLMRole.PROMPT, PREFILL_BASE + args.id)
    cfg = ll.LLMConfig()
    cfg.listen_ip_info = f"{args.ip}:0"
    cfg.local_comm_res = ""
    dd.init(cfg.generate_options())
    desc = ll.CacheDesc(1, [1, nbytes], ll.DataType.DT_UINT8, ll.Placement.HOST)
    cache = dd.cache_manager.register_cache(desc, [data.ctypes.data])
    srv = socket.create_server((args.ip, 0), backlog=64)

    def serve(conn: socket.socket) -> None:
        view = memoryview(data)
        with conn:
            while True:
                head = conn.recv(8, socket.MSG_WAITALL)
                if len(head) < 8:
                    return
                conn.sendall(view[: struct.unpack("<Q", head)[0]])

    def accept() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    listen = dd.listen_address
    assert listen is not None
    say({"ready": True, "port": listen[1], "plain_port": srv.getsockname()[1],
         "cache_id": cache.cache_id, **proc_stats()})
    for line in sys.stdin:
        if line.strip() == "stats":
            say(proc_stats())
        elif line.strip() == "quit":
            break
    say({"bye": True, **proc_stats()})
    dd.finalize()


def decode_main(args: argparse.Namespace) -> None:
    """A decode host: links to every prefill at once, then on each command pulls every
    prefill's cache at once (one thread each), over datadist ("dd") or plain sockets
    ("plain"), checks the bytes and answers with each link's start and end."""
    import numpy as np

    import datadist as ll

    prefills = json.loads(args.prefills)
    nbytes = args.mib << 20
    dd = ll.LLMDataDist(ll.LLMRole.DECODER, DECODE_BASE + args.id)
    cfg = ll.LLMConfig()
    cfg.local_comm_res = ""
    cfg.transport = "tcp"  # one kernel: otherwise datadist would use shared memory
    cfg.sync_kv_timeout = 120000
    dd.init(cfg.generate_options())
    cm = dd.cache_manager
    desc = ll.CacheDesc(1, [1, nbytes], ll.DataType.DT_UINT8, ll.Placement.HOST)
    bufs = [np.zeros(nbytes, dtype=np.uint8) for _ in prefills]
    caches = [cm.register_cache(desc, [b.ctypes.data]) for b in bufs]
    wants = [pattern(nbytes, SEED + p["id"]) for p in prefills]
    say({"ready": True, **proc_stats()})
    if sys.stdin.readline().strip() != "link":
        return
    clusters = []
    for p in prefills:
        c = ll.LLMClusterInfo()
        c.remote_cluster_id = PREFILL_BASE + p["id"]
        c.append_local_ip_info(args.ip, 0)
        c.append_remote_ip_info(p["ip"], p["port"])
        clusters.append(c)
    t0 = time.monotonic()
    code, rets = dd.link_clusters(clusters, 60000)
    link_s = time.monotonic() - t0
    if code != ll.LLMStatusCode.LLM_SUCCESS or any(r != ll.LLMStatusCode.LLM_SUCCESS
                                                   for r in rets):
        say({"error": f"link_clusters: {code} {rets}"})
        return
    plains = []
    for p in prefills:
        s = socket.create_connection((p["ip"], p["plain_port"]), timeout=60)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        plains.append(s)
    say({"linked": True, "link_s": link_s, "t0": t0, "t1": t0 + link_s, **proc_stats()})

    def pull_dd(i: int) -> None:
        key = ll.CacheKeyByIdAndIndex(PREFILL_BASE + prefills[i]["id"], prefills[i]["cache_id"],
                                      0)
        cm.pull_cache(key, caches[i], 0)

    def pull_plain(i: int) -> None:
        s, view, got = plains[i], bufs[i].data.cast("B"), 0
        s.sendall(struct.pack("<Q", nbytes))
        while got < nbytes:
            n = s.recv_into(view[got:])
            if not n:
                raise OSError("the prefill closed the plain socket")
            got += n

    for line in sys.stdin:
        mode = line.strip()
        if mode == "quit":
            break
        fn = pull_dd if mode == "dd" else pull_plain
        for b in bufs:
            b.fill(0)
        times: list[list[float]] = [[0.0, 0.0] for _ in prefills]
        errors: list[str] = []
        gate = threading.Barrier(len(prefills))

        def run(i: int, fn: Any = fn, times: Any = times, errors: Any = errors,
                gate: threading.Barrier = gate) -> None:
            gate.wait()
            times[i][0] = time.monotonic()
            try:
                fn(i)
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")
            times[i][1] = time.monotonic()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prefills))]
        stats = {}
        for t in threads:
            t.start()
        time.sleep(0.01)
        stats = proc_stats()  # while the pulls run
        for t in threads:
            t.join()
        ok = not errors and all(np.array_equal(b, w) for b, w in zip(bufs, wants, strict=True))
        say({"mode": mode, "times": times, "ok": ok, "errors": errors, **stats})
    for s in plains:
        s.close()
    say({"bye": True, **proc_stats()})
    dd.finalize()


# ----------------------------------------------------------------------------- the run


class Worker:
    """One worker process in a namespace, spoken to over its stdin / stdout."""

    def __init__(self, ns: str, argv: list[str]) -> None:
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-u", __file__, *argv],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=os.environ.copy())

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise RuntimeError(f"a worker ended: {err[-2000:]}")
        msg: dict[str, Any] = json.loads(line)
        if "error" in msg:
            raise RuntimeError(msg["error"])
        return msg

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.send("quit")
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def summarize(replies: list[dict[str, Any]], nbytes: int) -> dict[str, Any]:
    """Aggregate GB/s (all bytes over first start .. last end) and per-link GB/s."""
    spans = [t for r in replies for t in r["times"]]
    start, end = min(t[0] for t in spans), max(t[1] for t in spans)
    per_link = [nbytes / (t[1] - t[0]) / 1e9 for t in spans]
    return {"aggregate_gbs": nbytes * len(spans) / (end - start) / 1e9,
            "link_min_gbs": min(per_link), "link_max_gbs": max(per_link),
            "fairness": min(per_link) / max(per_link)}


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def orchestrate(args: argparse.Namespace) -> dict[str, Any]:
    hosts = [f"p{i}" for i in range(args.prefill)] + [f"d{j}" for j in range(args.decode)]
    net = Net(f"dd{os.getpid() % 100000}", hosts, args.rate_mbit, args.delay_ms)
    workers: list[Worker] = []
    try:
        net.build()
        here = str(Path(__file__).resolve().parents[1] / "src")
        os.environ["PYTHONPATH"] = os.pathsep.join(
            x for x in (here, os.environ.get("PYTHONPATH", "")) if x)
        prefills = []
        pws = []
        for i in range(args.prefill):
            w = Worker(net.ns(f"p{i}"), ["--worker", "prefill", "--id", str(i), "--ip",
                                         net.ip(f"p{i}"), "--mib", str(args.mib)])
            workers.append(w)
            pws.append(w)
        for i, w in enumerate(pws):
            r = w.read()
            prefills.append({"id": i, "ip": net.ip(f"p{i}"), "port": r["port"],
                             "plain_port": r["plain_port"], "cache_id": r["cache_id"]})
        dws = []
        for j in range(args.decode):
            w = Worker(net.ns(f"d{j}"), ["--worker", "decode", "--id", str(j), "--ip",
                                         net.ip(f"d{j}"), "--mib", str(args.mib),
                                         "--prefills", json.dumps(prefills)])
            workers.append(w)
            dws.append(w)
        idle = [w.read() for w in dws]
        t0 = time.monotonic()
        for w in dws:
            w.send("link")
        linked = [w.read() for w in dws]
        mesh_s = max(r["t1"] for r in linked) - t0
        nbytes = args.mib << 20
        runs: dict[str, list[dict[str, Any]]] = {"plain": [], "dd": []}
        during: dict[str, list[dict[str, Any]]] = {"plain": [], "dd": []}
        for _ in range(args.repeat + 1):  # the first round of each is the warm-up
            for mode in ("plain", "dd"):
                for w in dws:
                    w.send(mode)
                replies = [w.read() for w in dws]
                bad = [r for r in replies if not r["ok"]]
                if bad:
                    raise RuntimeError(f"{mode}: bytes wrong or a pull failed: {bad[0]}")
                runs[mode].append(summarize(replies, nbytes))
                during[mode].append({"threads": max(r["threads"] for r in replies),
                                     "rss_kib": max(r["rss_kib"] for r in replies)})
        for w in pws:
            w.send("stats")
        pstats = [w.read() for w in pws]
        link_limit = args.rate_mbit * 1e6 / 8 / 1e9  # GB/s, each direction of each link
        sum_limit = min(args.prefill, args.decode) * link_limit
        result: dict[str, Any] = {
            "prefill": args.prefill, "decode": args.decode, "mib": args.mib,
            "repeat": args.repeat, "rate_mbit": args.rate_mbit, "delay_ms": args.delay_ms,
            "qdisc": net.qdisc, "delay_applied": net.delay_applied,
            "links_sum_limit_gbs": sum_limit, "bytes_checked": True,
            "mesh_link_s": mesh_s, "link_s_per_decoder": [r["link_s"] for r in linked],
            "decoder_idle": idle, "decoder_linked": linked, "prefill_stats": pstats,
            "decoder_during": during,
        }
        for mode in ("plain", "dd"):
            timed = runs[mode][1:]
            result[mode] = {k: median([r[k] for r in timed]) for k in timed[0]}
            result[mode]["samples"] = timed
        result["dd_vs_plain"] = result["dd"]["aggregate_gbs"] / result["plain"]["aggregate_gbs"]
        result["dd_vs_links"] = result["dd"]["aggregate_gbs"] / sum_limit
        return result
    finally:
        for w in workers:
            w.stop()
        net.close()


def report(r: dict[str, Any]) -> str:
    mib = 1 << 10
    lines = [
        f"{r['prefill']}P x {r['decode']}D, {r['mib']} MiB per pair, links {r['rate_mbit']} "
        f"Mbit/s each way ({r['qdisc']}), median of {r['repeat']}; every byte checked",
        f"links' limit, summed: {r['links_sum_limit_gbs']:.3f} GB/s",
    ]
    for mode, what in (("plain", "plain sockets"), ("dd", "datadist TCP")):
        m = r[mode]
        lines.append(f"{what:14s} aggregate {m['aggregate_gbs']:.3f} GB/s "
                     f"({m['aggregate_gbs'] / r['links_sum_limit_gbs']:.2f}x the links), "
                     f"per link {m['link_min_gbs'] * 1e3:.1f}-{m['link_max_gbs'] * 1e3:.1f} "
                     f"MB/s, fairness min/max {m['fairness']:.2f}")
    lines.append(f"datadist / plain sockets: {r['dd_vs_plain']:.2f}x")
    lines.append(f"linking the {r['prefill']}x{r['decode']} mesh: {r['mesh_link_s'] * 1e3:.0f} ms "
                 f"(all decoders at once); per decoder "
                 f"{min(r['link_s_per_decoder']) * 1e3:.0f}-"
                 f"{max(r['link_s_per_decoder']) * 1e3:.0f} ms")
    d = r["decoder_linked"]
    lines.append(f"decoder: threads {min(x['threads'] for x in d)}-"
                 f"{max(x['threads'] for x in d)} linked, "
                 f"{max(x['threads'] for x in r['decoder_during']['dd'])} while pulling; "
                 f"RSS {max(x['rss_kib'] for x in d) / mib:.0f} MiB linked, "
                 f"{max(x['rss_kib'] for x in r['decoder_during']['dd']) / mib:.0f} MiB pulling")
    p = r["prefill_stats"]
    lines.append(f"prefill: threads {min(x['threads'] for x in p)}-{max(x['threads'] for x in p)}"
                 f", RSS {max(x['rss_kib'] for x in p) / mib:.0f} MiB (its cache included)")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefill", type=int, default=4)
    ap.add_argument("--decode", type=int, default=4)
    ap.add_argument("--mib", type=int, default=4, help="MiB each decoder pulls from each prefill")
    ap.add_argument("--rate-mbit", type=float, default=200.0, help="each link, each way")
    ap.add_argument("--delay-ms", type=float, default=1.0, help="one-way, where sch_netem is")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=300, help="seconds for the whole run")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--worker", choices=("prefill", "decode"), help=argparse.SUPPRESS)
    ap.add_argument("--id", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--ip", default="", help=argparse.SUPPRESS)
    ap.add_argument("--prefills", default="[]", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "prefill":
        prefill_main(args)
        return 0
    if args.worker == "decode":
        decode_main(args)
        return 0
    if os.geteuid() != 0:
        print("hosts.py needs root (network namespaces, veth, tc)", file=sys.stderr)
        return 2
    if not (1 <= args.prefill <= 60 and 1 <= args.decode <= 60) or args.mib < 1 or \
            args.repeat < 1 or args.rate_mbit <= 0:
        ap.error("1..60 prefills and decoders, --mib and --repeat >= 1, --rate-mbit > 0")

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"the run took more than {args.timeout} s")

    signal.signal(signal.SIGALRM, expire)
    signal.alarm(args.timeout)
    try:
        result = orchestrate(args)
    except (RuntimeError, TimeoutError, subprocess.SubprocessError, OSError) as e:
        print(f"hosts.py failed: {e}", file=sys.stderr)
        return 1
    finally:
        signal.alarm(0)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
