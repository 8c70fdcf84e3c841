"""Two network namespaces joined by a veth pair, and the faults the netns tests inject
into the wire between them. Built and torn down by the ``netns_pair`` fixture (conftest)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass


@dataclass
class NetnsPair:
    """Two namespaces ``a`` (the prompt's host) and ``b`` (the decoder's), one veth pair."""

    a: str
    b: str
    dev_a: str
    dev_b: str
    ip_a: str
    ip_b: str

    def exec_prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def sh(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), capture_output=True, text=True, timeout=10,
                              check=check)

    def link(self, up: bool) -> None:
        """Cut (or restore) the wire: both ends down, as when a cable is pulled."""
        state = "up" if up else "down"
        self.sh("ip", "-n", self.a, "link", "set", self.dev_a, state)
        self.sh("ip", "-n", self.b, "link", "set", self.dev_b, state)

    def qdisc(self, *spec: str) -> None:
        """The same root qdisc on both ends (so both directions see it)."""
        for ns, dev in ((self.a, self.dev_a), (self.b, self.dev_b)):
            self.sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root",
                    *spec)

    def clear_qdisc(self) -> None:
        for ns, dev in ((self.a, self.dev_a), (self.b, self.dev_b)):
            self.sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root",
                    check=False)

    def random_loss(self, fraction: float) -> None:
        """Drop ``fraction`` of the packets leaving each end, at random.

        A classic-BPF classifier in direct-action mode on the clsact egress hook: load the
        kernel's per-packet random number, drop (TC_ACT_SHOT) when it falls under the
        threshold. Works on kernels without sch_netem (like this CI's).
        """
        # One segment per packet: with GSO a "packet" at egress is up to 64 KiB of segments,
        # and dropping those few super-packets is not the loss a real wire shows.
        for ns, dev in ((self.a, self.dev_a), (self.b, self.dev_b)):
            self.sh("ip", "-n", ns, "link", "set", dev, "gso_max_segs", "1")
        threshold = int((1.0 - fraction) * 2**32)
        code = f"4,32 0 0 4294963256,37 0 1 {threshold},6 0 0 2,6 0 0 0"
        for ns, dev in ((self.a, self.dev_a), (self.b, self.dev_b)):
            self.sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "clsact")
            self.sh("ip", "netns", "exec", ns, "tc", "filter", "add", "dev", dev, "egress",
                    "bpf", "da", "bytecode", code)

    def clear_loss(self) -> None:
        for ns, dev in ((self.a, self.dev_a), (self.b, self.dev_b)):
            self.sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "clsact",
                    check=False)
