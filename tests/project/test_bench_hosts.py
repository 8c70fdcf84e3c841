"""The many-hosts rehearsal (benchmarks/hosts.py) end to end at 2P2D, tiny: it runs, checks
every byte, reports what it promises, and leaves no namespace behind. Needs root (netns);
never judges a figure."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.netns
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "hosts.py"


def netns_unavailable() -> str:
    """Why the rehearsal cannot run here, or "" when it can."""
    if os.geteuid() != 0:
        return "the many-hosts rehearsal needs root (ip netns add)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the many-hosts rehearsal needs the '{tool}' command (iproute2)"
    return ""


@pytest.mark.timeout(200)
def test_hosts_rehearsal_2p2d_checks_bytes_and_cleans_up(tmp_path: Path) -> None:
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "hosts.json"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--prefill", "2", "--decode", "2",
                             "--mib", "1", "--rate-mbit", "400", "--repeat", "1",
                             "--timeout", "150", "--json", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["bytes_checked"] and r["prefill"] == 2 and r["decode"] == 2
    for mode in ("plain", "dd"):
        assert r[mode]["aggregate_gbs"] > 0 and 0 < r[mode]["fairness"] <= 1
    assert r["mesh_link_s"] > 0 and len(r["link_s_per_decoder"]) == 2
    assert all(x["threads"] > 0 and x["rss_kib"] > 0 for x in r["decoder_linked"])
    assert "datadist TCP" in stdout and "fairness" in stdout
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"dd{proc.pid % 100000}" not in left, left  # its namespaces are gone
