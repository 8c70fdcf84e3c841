"""The connector's settings and the transfer parameters it puts in a request's output.

No vLLM and no I/O here: the scheduler side, the worker side and the tests share these.

Settings come from ``kv_connector_extra_config`` (keys below) with environment fallbacks for
the one a deployment most often tunes (``VLLM_DATADIST_ABORT_TIMEOUT``, seconds).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from datadist.core.address import parse_host_port
from datadist.core.threads import cgroup_cpus, node_cpus, parse_cpu_list

#: Model ids of the two blocks caches every worker registers under its cluster id.
KV_MODEL_ID = 0
MAILBOX_MODEL_ID = 1
#: Layer-wise mode (layerwise.py), a producer's: its directory of progress records, the
#: block ids of each, and the records its decoders acknowledge in.
LW_DIR_MODEL_ID = 2
LW_IDS_MODEL_ID = 3
LW_ACK_MODEL_ID = 4

#: Key of datadist's own fields inside ``kv_transfer_params``.
PARAMS_KEY = "datadist"

#: Log records go to a child of vLLM's logger, so they show up in vLLM's log with its format
#: (datadist itself installs no handler).
LOGGER_NAME = "vllm.datadist_connector"

#: Transfer modes (``kv_connector_extra_config["mode"]``).
MODES = ("pull", "layerwise")

#: Where a CUDA worker's KV cache is moved from (``kv_connector_extra_config
#: ["kv_buffer_device"]``, NixlConnector's name; staging.py): staged through host buffers, or
#: read in GPU memory by NIXL.
KV_BUFFER_DEVICES = ("cpu", "cuda")

ROLES = {"kv_producer": "producer", "kv_consumer": "consumer", "kv_both": "both"}


@dataclass(frozen=True)
class Settings:
    """What ``kv_connector_extra_config`` may set (all optional).

    host: address the producer listens on and advertises to decoders (default 127.0.0.1;
        set a routable address for two hosts).
    port: first listen port (tensor-parallel rank r listens on port + r); 0 picks free ports.
    sync_kv_timeout_ms: deadline of one pull (datadist's ``sync_kv_timeout``).
    link_timeout_ms: deadline of linking to a prefill instance.
    abort_timeout_s: a producer frees a finished request's blocks after this long even if no
        decoder said it pulled them (env ``VLLM_DATADIST_ABORT_TIMEOUT``).
    hold_grace_s: how long a decoder waits for the producer to mark a request's blocks as
        held before it gives up on the request.
    mailbox_slots: how many finished requests a producer can hold at once.
    mode: "pull" (default: the decoder pulls a finished prefill's blocks) or "layerwise"
        (the router sends the request to both instances at once; the decoder allocates its
        blocks first and pulls each layer as soon as the prefill says vLLM saved it; see
        layerwise.py). Both instances of a pair must use the same mode.
    idle_wait_ms: a decoder's step that scheduled nothing waits up to this long for a
        transfer in flight to end (0: never), so the engine learns of it in this step (a
        layer-wise decoder follows its prefill's progress meanwhile, reading its record once
        a millisecond).
    layerwise_timeout_s: layer-wise decoder: how long a request waits for the prefill to
        write, and itself to pull, all its layers before it gives up on it (the prefill's
        compute time counts here, so it is longer than a pull's ``sync_kv_timeout_ms``).
    kv_buffer_device: a CUDA vLLM only (a CPU vLLM's KV cache is read where it lies): "cpu"
        (default) stages the KV cache through host buffers registered with datadist (copies
        device -> host after the prefill's forward, host -> device before the decode's;
        every transport works); "cuda" registers the GPU memory itself and moves it by NIXL
        (its VRAM path: ``pip install 'datadist[nixl]'``, a UCX with CUDA, on both
        instances; both instances of a pair use "cuda"). Read from
        ``kv_connector_extra_config``, not from vLLM's ``KVTransferConfig.kv_buffer_device``
        (whose default, "cuda", would pick NIXL without asking).
    prefill_workers: a decoder's: the prefill instances it will pull from, each "ip:port"
        as that instance's ``host`` (an IP address) and ``port`` settings ("[v6]:port" for
        IPv6; a list, or one string with commas). Each decode worker links to them at
        start-up in threads of its own, off the engine's step (tensor-parallel rank r to
        port + r, where the prefill's rank r listens), and reads one mailbox record and one
        KV block of each (the first transfers' one-time cost: a same-host link asks the
        owner for a lease of each cache once), so the first request to each finds its link
        made and warm. A worker not
        listening yet is tried again until ``link_timeout_ms``; a pre-link that fails is
        logged and made again at the first request that names the worker, as without the
        setting: start-up never waits or fails on it. Default: none (each link is made at
        the first sight of a worker's address, off the step).
    transfer_cpus: the CPUs datadist's own threads run on in this worker (its I/O threads and
        the workers of its pulls and pushes; datadist.set_thread_cpus). "auto" (default):
        when the worker's thread is pinned to one CPU, as vLLM's CPU backend pins its
        compute threads with OpenMP, the CPUs of that CPU's NUMA node that the process's
        cgroup allows (the KV cache's memory is on that node), so no byte is moved on the
        forward pass's own core alone; otherwise their creator's, as "inherit" always does.
        Or a CPU list as the kernel writes one ("2-3", "0,8-9").
    """

    host: str = "127.0.0.1"
    port: int = 0
    sync_kv_timeout_ms: int = 10_000
    link_timeout_ms: int = 5_000
    abort_timeout_s: float = 120.0
    hold_grace_s: float = 2.0
    mailbox_slots: int = 4096
    mode: str = "pull"
    idle_wait_ms: int = 10
    layerwise_timeout_s: float = 30.0
    kv_buffer_device: str = "cpu"
    prefill_workers: tuple[str, ...] = ()
    transfer_cpus: str = "auto"

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None,
                          env: Mapping[str, str] | None = None) -> Settings:
        """Parse ``kv_connector_extra_config``; unknown keys are ignored (other connectors'
        keys may share the dict), bad values raise ValueError."""
        environ: Mapping[str, str] = os.environ if env is None else env
        extra = dict(extra or {})
        if "abort_timeout_s" not in extra and environ.get("VLLM_DATADIST_ABORT_TIMEOUT"):
            extra["abort_timeout_s"] = environ["VLLM_DATADIST_ABORT_TIMEOUT"]
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in extra:
                continue
            raw = extra[f.name]
            if f.name == "prefill_workers":
                values[f.name] = _addresses(raw)
                continue
            try:
                values[f.name] = str(raw) if f.type == "str" else (
                    int(raw) if f.type == "int" else float(raw))
            except (TypeError, ValueError):
                raise ValueError(f"kv_connector_extra_config[{f.name!r}]: bad value {raw!r}")\
                    from None
        s = cls(**values)
        if not 0 <= s.port <= 65535:
            raise ValueError(f"port must be 0..65535, got {s.port}")
        for name in ("sync_kv_timeout_ms", "link_timeout_ms", "mailbox_slots"):
            if getattr(s, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(s, name)}")
        if s.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {s.mode!r}")
        if s.kv_buffer_device not in KV_BUFFER_DEVICES:
            raise ValueError(f"kv_buffer_device must be one of {', '.join(KV_BUFFER_DEVICES)}, "
                             f"got {s.kv_buffer_device!r}")
        if s.idle_wait_ms < 0:
            raise ValueError(f"idle_wait_ms must be >= 0, got {s.idle_wait_ms}")
        if s.layerwise_timeout_s <= 0:
            raise ValueError(f"layerwise_timeout_s must be > 0, got {s.layerwise_timeout_s}")
        for name in ("abort_timeout_s", "hold_grace_s"):
            if getattr(s, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(s, name)}")
        if s.transfer_cpus.strip() not in ("auto", "inherit"):
            s.thread_cpus()  # ValueError for a bad list
        return s

    def thread_cpus(self, pinned: set[int] | None = None) -> list[int] | None:
        """What ``transfer_cpus`` asks datadist.set_thread_cpus for, given the CPUs the
        calling thread may use (``pinned``; default: its own): None to leave the core's
        threads on their creator's CPUs. ValueError for a bad setting."""
        text = self.transfer_cpus.strip()
        if text == "inherit":
            return None
        if text == "auto":
            mine = os.sched_getaffinity(0) if pinned is None else pinned
            if len(mine) != 1:
                return None
            allowed = cgroup_cpus()
            near = set(node_cpus(next(iter(mine))) or allowed) & set(allowed)
            return sorted(near) or allowed
        try:
            cpus = parse_cpu_list(text)
        except ValueError:
            cpus = []
        if not cpus or cpus[-1] >= 1024:
            raise ValueError("transfer_cpus must be 'auto', 'inherit' or a CPU list such as "
                             f"'2-3' or '0,8-9', got {self.transfer_cpus!r}")
        return cpus


def _addresses(raw: Any) -> tuple[str, ...]:
    """``prefill_workers``: a list of "host:port" or one string with commas; ValueError
    naming the bad entry."""
    items = raw.split(",") if isinstance(raw, str) else raw
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
        raise ValueError(f"kv_connector_extra_config['prefill_workers']: expected a list of "
                         f"'host:port', got {raw!r}")
    out = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        try:
            host, port = parse_host_port(item)
        except ValueError as e:
            raise ValueError(f"kv_connector_extra_config['prefill_workers']: {e}") from None
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(f"kv_connector_extra_config['prefill_workers']: {item!r}: the "
                             "host must be an IP address, as the prefill's 'host'") from None
        if port == 0:
            raise ValueError(f"kv_connector_extra_config['prefill_workers']: {item!r} has "
                             "port 0 (name the port the prefill instance's 'port' setting fixes)")
        out.append(item)
    return tuple(out)


@dataclass(frozen=True)
class WorkerAddress:
    """Where one producer worker (one tensor-parallel rank) serves its KV cache."""

    host: str
    port: int
    cluster_id: int


@dataclass(frozen=True)
class RemoteRequest:
    """What a decoder needs to pull one request, parsed from its ``kv_transfer_params``."""

    request_id: str
    block_ids: list[int]
    num_tokens: int
    block_size: int
    workers: list[WorkerAddress]
    slot: int
    tag: str

    @classmethod
    def parse(cls, params: dict[str, Any]) -> RemoteRequest:
        """Raise ValueError when the parameters lack what a pull needs."""
        dd = params.get(PARAMS_KEY)
        if not isinstance(dd, dict):
            raise ValueError(f"kv_transfer_params has no {PARAMS_KEY!r} entry")
        try:
            workers = [WorkerAddress(str(h), int(p), int(c)) for h, p, c in dd["workers"]]
            blocks = params["remote_block_ids"]
            if blocks and isinstance(blocks[0], list):  # vLLM's per-group form
                blocks = blocks[0]
            req = cls(str(params.get("remote_request_id", "")), [int(b) for b in blocks],
                      int(params.get("remote_num_tokens") or 0), int(dd["block_size"]),
                      workers, int(dd["slot"]), str(dd["tag"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"bad datadist kv_transfer_params: {e!r}") from None
        if not req.workers:
            raise ValueError("kv_transfer_params name no producer worker")
        bytes.fromhex(req.tag)
        return req

    def blocks_for(self, num_local_blocks: int) -> list[int]:
        """The remote blocks that match a decoder's ``num_local_blocks`` newly allocated
        blocks: the prompt's blocks, minus those a local prefix-cache hit already holds."""
        used = self.block_ids
        if self.num_tokens > 0:
            used = used[:-(-self.num_tokens // self.block_size)]
        if num_local_blocks > len(used):
            raise ValueError(f"decoder allocated {num_local_blocks} blocks, "
                             f"prefill holds only {len(used)}")
        return used[len(used) - num_local_blocks:]
