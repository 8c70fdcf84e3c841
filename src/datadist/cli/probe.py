"""``datadist probe HOST:PORT``: walk a link's handshake and name the step where it stops
(the walk itself is datadist/probe.py)."""

from __future__ import annotations

import argparse
from typing import Any

from datadist.cli.common import CliError, count


def cmd_probe(args: argparse.Namespace) -> int:
    """``datadist probe HOST:PORT``: one line, what a link there would meet (datadist/probe.py)."""
    from datadist.api.status import LLMException
    from datadist.core.errors import DatadistError
    from datadist.probe import main_args

    try:
        found = main_args(args.peer, args.cluster_id, args.own_id, args.timeout)
    except (DatadistError, LLMException) as e:
        raise CliError(f"probe {args.peer!r}: {e}") from None
    print(f"{found.kind}: {found.text}")
    return 0 if found.ok else 1


def add_parser(sub: Any) -> None:
    """The ``probe`` subcommand's options."""
    probe = sub.add_parser("probe", help="why a link to a listener fails (or that it would work)",
                           description="Walk a link's handshake to HOST:PORT and say where it "
                           "stops: port closed, not a datadist listener, TLS, protocol version, "
                           "cluster id, shared secret. Secret and TLS files are taken from the "
                           "environment, as a link takes them. Exit code 0 when a link would "
                           "be made, 1 otherwise.")
    probe.add_argument("peer", metavar="HOST:PORT", help="the listener's address")
    probe.add_argument("--cluster-id", type=count(0, 2**64 - 1),
                       help="the cluster id you link to (default: any; the probe says which)")
    probe.add_argument("--own-id", type=count(0, 2**64 - 1), default=2**63 - 1,
                       help="the cluster id the probe says it is (default 2**63-1)")
    probe.add_argument("--timeout", type=float, default=3.0, help="seconds per step (3)")
    probe.set_defaults(fn=cmd_probe)
