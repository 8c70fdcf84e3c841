# Generated from the built datadist._core by pybind11-stubgen 3.0.0 (python tools/gen_stub.py):
# do not edit; change the binding (cpp/python/) and regenerate (tests/project/test_stub.py checks it).
"""
datadist's C++ engine (private: datadist.core.native drives it). Every error of the core is raised as datadist.core.errors' class for its code (one code-to-class table, module.cc PyError); a checksum mismatch as IntegrityError. Hooks for tests and tools: the `testing` submodule.
"""
from __future__ import annotations
import builtins
import collections.abc
import datadist.core.errors
import numpy
import numpy.typing
import typing
from . import testing
__all__: list[str] = ['Call', 'Engine', 'Handle', 'Hold', 'LayerRun', 'OptionSpec', 'PendingLink', 'PlannedPulls', 'UserCache', 'build_info', 'check_option', 'cuda_device', 'metrics_record', 'metrics_reset', 'metrics_series', 'nixl_load', 'options', 'parse_options', 'set_thread_cpus', 'testing', 'thread_cpus', 'tls']
class OptionSpec:
    """
    One row of the option table (read only)
    """
    def __repr__(self) -> str:
        ...
    @property
    def attr(self) -> str:
        """
        the LLMConfig property made for it ("": none)
        """
    @property
    def default(self) -> str:
        ...
    @property
    def doc(self) -> str:
        ...
    @property
    def env(self) -> str:
        """
        its environment variable ("": none)
        """
    @property
    def key(self) -> str:
        """
        the option's key
        """
    @property
    def kind(self) -> str:
        """
        "bool", "int", "enum", "str", "path" or "secret"
        """
    @property
    def range(self) -> tuple[int, int] | None:
        """
        an int's range, both ends included (None for other kinds)
        """
    @property
    def unit(self) -> str:
        ...
    @property
    def values(self) -> list[str]:
        """
        an enum's accepted values
        """
class Handle:
    """
    An asynchronous transfer, run by the engine's workers
    """
    def done(self) -> bool:
        """
        Ended, successfully or not? Never blocks.
        """
    def error(self) -> datadist.core.errors.DatadistError | None:
        """
        The error (datadist.core.errors) that ended a failed transfer; None while running or after a success.
        """
    def wait(self, timeout_s: typing.SupportsFloat | typing.SupportsIndex) -> bool:
        """
        Blocks until it ends or timeout_s passes (without the GIL past a short budget, gil.h); True once ended.
        """
class PendingLink:
    """
    A two-sided link's connection, opened and checked but not filed yet (Engine.adopt_link)
    """
    def close(self) -> None:
        ...
    @property
    def cluster_id(self) -> int:
        ...
    @property
    def path_name(self) -> str:
        ...
class Call:
    """
    A transfer made ready by Engine.prepare (opaque)
    """
    @property
    def bytes(self) -> int:
        """
        the bytes it moves
        """
    @property
    def cache_id(self) -> int:
        """
        the local cache its spans lie in
        """
    @property
    def cluster_id(self) -> int:
        ...
    @property
    def flags(self) -> int:
        """
        its request's flags (wire.h kFlag*)
        """
    @property
    def lengths(self) -> numpy.typing.NDArray[numpy.uint64]:
        """
        its request's span lengths (a copy)
        """
    @property
    def local_iov(self) -> numpy.typing.NDArray[numpy.uint64]:
        """
        its local spans, (address, length) rows in the order the request moves them (a copy)
        """
    @property
    def remote_offsets(self) -> numpy.typing.NDArray[numpy.uint64]:
        """
        its request's remote span offsets (a copy)
        """
    @property
    def remote_tensors(self) -> numpy.typing.NDArray[numpy.uint32]:
        """
        its request's remote tensor indices (a copy)
        """
    @property
    def spans(self) -> int:
        """
        local spans it holds
        """
    @property
    def unit_bytes(self) -> int:
        """
        the unit bytes its request states
        """
    @property
    def write(self) -> bool:
        ...
class Hold:
    """
    A hold on a local cache (Engine.hold); release() ends it
    """
    def release(self) -> None:
        ...
    @property
    def cache_id(self) -> int:
        ...
    @property
    def held(self) -> bool:
        ...
class UserCache:
    """
    Memory the caller keeps but never filed (create_cpu_cache), as one side of Engine.copy_slot / copy_blocks
    """
    def __init__(self, *, num_tensors: typing.SupportsInt | typing.SupportsIndex, tensor_bytes: typing.SupportsInt | typing.SupportsIndex, units: typing.SupportsInt | typing.SupportsIndex, addrs: numpy.typing.NDArray[numpy.uint64]) -> None:
        """
        `num_tensors` tensors of `tensor_bytes` bytes, `units` slots or blocks each, at `addrs`. InvalidArgument for a zero base, a tensor past the end of the address space, or units that do not split a tensor.
        """
    @property
    def num_tensors(self) -> int:
        ...
    @property
    def tensor_bytes(self) -> int:
        ...
    @property
    def units(self) -> int:
        ...
class LayerRun:
    """
    A layer-wise transfer whose steps the core runs in order (Engine.layers)
    """
    def abandon(self, code: typing.SupportsInt | typing.SupportsIndex, why: str) -> None:
        """
        Every destination with a step let go and no outcome gets `code`; nothing more runs.
        """
    def add(self, step: typing.SupportsInt | typing.SupportsIndex, job: typing.SupportsInt | typing.SupportsIndex, call: Call) -> None:
        """
        Step `step` sends `call` for destination `job` (before the first go; InvalidArgument after).
        """
    def add_all(self, first: typing.SupportsInt | typing.SupportsIndex, job: typing.SupportsInt | typing.SupportsIndex, calls: collections.abc.Sequence[Call], per_step: typing.SupportsInt | typing.SupportsIndex) -> None:
        """
        Every call of destination `job`: calls[i] in step first + i // per_step (add each, under one lock; none added when one is refused).
        """
    def add_refusal(self, step: typing.SupportsInt | typing.SupportsIndex, job: typing.SupportsInt | typing.SupportsIndex, code: typing.SupportsInt | typing.SupportsIndex, why: str) -> None:
        """
        Step `step` fails for destination `job` with `code` when reached.
        """
    def close(self) -> None:
        """
        No more steps will be let go. Never blocks.
        """
    def ended(self) -> int:
        """
        Steps ended so far. Never blocks.
        """
    def go(self, step: typing.SupportsInt | typing.SupportsIndex) -> bool:
        """
        Step `step` may run (in order, once each; InvalidArgument otherwise); returns stopped() after it. Never blocks.
        """
    def merges(self) -> bool:
        """
        Some step can be merged with the next (one destination, the same key and spans): letting layers go ahead pays. Never blocks.
        """
    def refuse(self, step: typing.SupportsInt | typing.SupportsIndex, code: typing.SupportsInt | typing.SupportsIndex, why: str) -> None:
        """
        Step `step` was not synchronized: applied in order, then the run stops. Never blocks.
        """
    def results(self) -> list[tuple[int, str] | None]:
        """
        Each destination's outcome: (code, why), or None when it has none (yet).
        """
    def stopped(self) -> bool:
        """
        A failure was seen: no later step runs. Never blocks.
        """
    def wait(self, timeout_s: typing.SupportsFloat | typing.SupportsIndex) -> bool:
        """
        Blocks (without the GIL) until the run is over; False when timeout_s passed first.
        """
    def wait_ended(self, steps: typing.SupportsInt | typing.SupportsIndex, timeout_s: typing.SupportsFloat | typing.SupportsIndex) -> bool:
        """
        Blocks (without the GIL, once it must wait) until `steps` steps ended or the run stopped; False when timeout_s passed first.
        """
    @property
    def calls_run(self) -> int:
        """
        Calls the core ran so far (tests: one per destination and layer).
        """
    @property
    def requests_run(self) -> int:
        """
        Requests sent so far: layers let go together and merged count one.
        """
    @property
    def steps(self) -> int:
        ...
class Engine:
    """
    An engine (cpp/src/engine.h) and its asynchronous workers: datadist.core.native.NativeEngine drives it
    """
    def __init__(self, cluster_id: typing.SupportsInt | typing.SupportsIndex, role: typing.SupportsInt | typing.SupportsIndex, async_threads: typing.SupportsInt | typing.SupportsIndex = 4) -> None:
        ...
    def add_cache(self, num_tensors: typing.SupportsInt | typing.SupportsIndex, tensor_bytes: typing.SupportsInt | typing.SupportsIndex, units: typing.SupportsInt | typing.SupportsIndex, layout: typing.SupportsInt | typing.SupportsIndex, addrs: numpy.typing.NDArray[numpy.uint64], *, allocated: bool, remote_accessible: bool, blocks: bool, device: bool, shm: typing.Any = None, keys: collections.abc.Sequence[tuple[typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex, bool] | None] = [], model_id: typing.SupportsInt | typing.SupportsIndex | None = None) -> int:
        """
        Files a cache (its memory the caller's) under the next free id and returns it, with `keys` ((value, model_id, is_prefix) or None per slot, from slot 0) and `model_id` (a BlocksCacheKey's) bound to it, all or nothing; `device`: DEVICE placement (NIXL registers it as VRAM where CUDA says its memory is a GPU's). InvalidArgument for bad keys or addresses. Blocks without the GIL while NIXL registers it.
        """
    def adopt_link(self, link: PendingLink) -> None:
        ...
    def allocate(self, num_tensors: typing.SupportsInt | typing.SupportsIndex, tensor_bytes: typing.SupportsInt | typing.SupportsIndex, units: typing.SupportsInt | typing.SupportsIndex, layout: typing.SupportsInt | typing.SupportsIndex, *, blocks: bool, device: bool, keys: collections.abc.Sequence[tuple[typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex, bool] | None] = [], model_id: typing.SupportsInt | typing.SupportsIndex | None = None) -> int:
        """
        allocate_cache / allocate_blocks_cache: carves the tensors (each on a page) from the pool of the placement and files them as add_cache files a cache (keys, model_id), all or nothing; returns its id. Deallocated pool caches nothing holds any more are released first. InvalidArgument without a pool or for bad keys, OutOfMemory when the pool has no room. Blocks without the GIL while NIXL registers it.
        """
    def bind_model(self, model_id: typing.SupportsInt | typing.SupportsIndex, cache_id: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def cache_ids(self) -> list[int]:
        """
        The ids filed now, ascending.
        """
    def cache_info(self, cache_id: typing.SupportsInt | typing.SupportsIndex) -> tuple[int, int, int, bool, int, numpy.typing.NDArray[numpy.uint64], bool, bool, bool, int]:
        """
        (num_tensors, tensor_bytes, units, blocks, layout, addrs, allocated, device, remote_accessible, leases) of a filed cache; CacheNotFound for an unknown (deallocated, unregistered) id. Never blocks.
        """
    def caches_in_use(self, wait_s: typing.SupportsFloat | typing.SupportsIndex) -> int:
        """
        After close: waits up to wait_s for the caches a transfer still held when they were dropped; returns how many still are (their memory must stay mapped).
        """
    def check_keys(self, keys: collections.abc.Sequence[tuple[typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex, bool] | None], units: typing.SupportsInt | typing.SupportsIndex) -> None:
        """
        add_cache's key rules for a cache of `units` slots, checked before its memory is allocated (InvalidArgument). Never blocks.
        """
    def close(self, wait_s: typing.SupportsFloat | typing.SupportsIndex) -> int:
        """
        Stop serving, close every link and drop every cache, waiting up to wait_s for leases; returns how many caches are still leased (their memory must stay mapped). Blocks.
        """
    def connect(self, cluster_id: typing.SupportsInt | typing.SupportsIndex, host: str, port: typing.SupportsInt | typing.SupportsIndex, timeout_s: typing.SupportsFloat | typing.SupportsIndex, *, take_peer_id: bool) -> int:
        ...
    def copy_blocks(self, *, src: typing.SupportsInt | typing.SupportsIndex | UserCache, dst: typing.SupportsInt | typing.SupportsIndex | UserCache, src_blocks: numpy.typing.NDArray[numpy.uint64], dst_blocks: numpy.typing.NDArray[numpy.uint64]) -> int:
        """
        Copies block src_blocks[i] of every tensor of `src` into block dst_blocks[i] of the same tensor of `dst` (a filed cache's id, or a UserCache), runs adjacent on both sides as one copy. Planned, held and checked by the core (Session::CopyBlocks, PlanBlockCopy: InvalidArgument with the Python API's texts, a destination named twice and, within one cache, a block both read and written included; CacheNotFound when a cache is not filed). Returns the bytes copied. Over 1 MiB, copies without the GIL.
        """
    def copy_slot(self, *, src: typing.SupportsInt | typing.SupportsIndex | UserCache, dst: typing.SupportsInt | typing.SupportsIndex | UserCache, src_unit: typing.SupportsInt | typing.SupportsIndex, dst_unit: typing.SupportsInt | typing.SupportsIndex, offset: typing.SupportsInt | typing.SupportsIndex, size: typing.SupportsInt | typing.SupportsIndex) -> int:
        """
        Copies slot src_unit of every tensor of `src` into slot dst_unit of the same tensor of `dst` (a filed cache's id, or a UserCache): `size` bytes from `offset` in the slot on both sides (-1: the rest of the source slot). Planned, held and checked by the core (Session::CopySlot, PlanSlotCopy: InvalidArgument with the Python API's texts; CacheNotFound when a cache is not filed). Returns the bytes copied. Over 1 MiB, copies without the GIL.
        """
    def deallocate(self, cache_id: typing.SupportsInt | typing.SupportsIndex, drop_keys: bool) -> None:
        ...
    def filed(self, cache_id: typing.SupportsInt | typing.SupportsIndex) -> bool:
        """
        Whether a cache is filed under `cache_id` now (not deallocated, unregistered or being unregistered). Never blocks.
        """
    def has_links(self) -> bool:
        ...
    def hello_count(self, cluster_id: typing.SupportsInt | typing.SupportsIndex) -> int:
        ...
    def hold(self, cache_id: typing.SupportsInt | typing.SupportsIndex) -> Hold:
        """
        Holds a filed cache for a local transfer until the Hold's release(): unregistering waits for it. CacheNotFound for an unknown id or one being unregistered. Never blocks.
        """
    def inbound_control(self) -> list[int]:
        ...
    def key_bound(self, value: typing.SupportsInt | typing.SupportsIndex, model_id: typing.SupportsInt | typing.SupportsIndex, is_prefix: bool) -> bool:
        """
        Whether the key is bound to a cache now (false once a peer's read consumed it). Never blocks.
        """
    def last_link_failure(self, cluster_id: typing.SupportsInt | typing.SupportsIndex) -> str:
        ...
    def layers(self, jobs: typing.SupportsInt | typing.SupportsIndex, steps: typing.SupportsInt | typing.SupportsIndex, width: typing.SupportsInt | typing.SupportsIndex, step_timeout_s: typing.SupportsFloat | typing.SupportsIndex) -> LayerRun:
        """
        A layer-wise run of `steps` steps for `jobs` destinations (LayerRun), up to `width` steps at once, each within step_timeout_s of its start; the run keeps the engine alive. Never blocks.
        """
    def link_ids(self, inbound: bool) -> list[int]:
        ...
    def link_many(self, peers: collections.abc.Sequence[tuple[typing.SupportsInt | typing.SupportsIndex, str, typing.SupportsInt | typing.SupportsIndex]], timeout_s: typing.SupportsFloat | typing.SupportsIndex, take_peer_id: bool) -> list[tuple[int, int, str]]:
        """
        Links to every (cluster_id, host, port) at once (Session::LinkMany), each within timeout_s; [(code, filed cluster id, why)] in order, code 0 on success. Blocks without the GIL.
        """
    def link_moved(self, cluster_id: typing.SupportsInt | typing.SupportsIndex) -> str | None:
        """
        how the link's last pull moved its bytes: shm, cma, stream or ""
        """
    def link_path(self, cluster_id: typing.SupportsInt | typing.SupportsIndex) -> str | None:
        ...
    def link_reason(self, cluster_id: typing.SupportsInt | typing.SupportsIndex) -> str | None:
        """
        why the link took its path
        """
    def link_serial(self, cluster_id: typing.SupportsInt | typing.SupportsIndex) -> int | None:
        """
        which link `cluster_id` is filed under now (Link::serial, never reused): tells a replaced link from the one seen before (tests)
        """
    def linked(self, cluster_id: typing.SupportsInt | typing.SupportsIndex) -> tuple[bool, bool]:
        """
        (we made a link to it, it made one to us)
        """
    def listen(self, host: str, port: typing.SupportsInt | typing.SupportsIndex) -> int:
        ...
    def listen_also(self, host: str, port: typing.SupportsInt | typing.SupportsIndex) -> int:
        ...
    def open(self, *, secret: bytes, transport: str, allow_ptrace: bool, max_conns: typing.SupportsInt | typing.SupportsIndex, max_per_peer: typing.SupportsInt | typing.SupportsIndex, tls_cert: str = '', tls_key: str = '', tls_ca: str = '', nixl_serve: bool = False, nixl_whole_process: bool = False) -> None:
        """
        Starts the engine; `transport` is a parsed datadist.Transport (auto, tcp, cma, shm, nixl: options.h ApplyTransport says what each means for links; nixl: LLM_PARAM_INVALID when NIXL cannot be loaded); with the three TLS files (PEM), every connection runs mutual TLS; nixl_serve (and nixl_whole_process): serve NIXL readers.
        """
    def open_link(self, cluster_id: typing.SupportsInt | typing.SupportsIndex, host: str, port: typing.SupportsInt | typing.SupportsIndex, timeout_s: typing.SupportsFloat | typing.SupportsIndex, *, take_peer_id: bool, reverse: bool) -> PendingLink:
        ...
    def open_pool(self, *, device: bool, memory_size: typing.SupportsInt | typing.SupportsIndex, page_shift: typing.SupportsInt | typing.SupportsIndex) -> None:
        """
        The pool DEVICE (device=True) or HOST caches are allocated from (mem_pool_cfg, host_mem_pool_cfg): one sealed memfd of memory_size bytes in pages of 1 << page_shift. InvalidArgument for a bad size or page_shift, OutOfMemory when it cannot be mapped. Never blocks.
        """
    def peer_stats(self, cluster_id: typing.SupportsInt | typing.SupportsIndex, timeout_s: typing.SupportsFloat | typing.SupportsIndex) -> bytes:
        """
        The linked peer's metrics (STATS_REQUEST): its JSON bytes. Blocks without the GIL up to timeout_s.
        """
    def ping(self, cluster_id: typing.SupportsInt | typing.SupportsIndex, timeout_s: typing.SupportsFloat | typing.SupportsIndex) -> None:
        ...
    def pool_info(self, *, device: bool) -> tuple[int, int, int] | None:
        """
        (size, used, page) of the DEVICE or HOST pool in bytes; None without one (or after close). Never blocks.
        """
    def prepare(self, *, write: bool, cluster_id: typing.SupportsInt | typing.SupportsIndex, kind: typing.SupportsInt | typing.SupportsIndex, a: typing.SupportsInt | typing.SupportsIndex, b: typing.SupportsInt | typing.SupportsIndex, c: typing.SupportsInt | typing.SupportsIndex, unit_bytes: typing.SupportsInt | typing.SupportsIndex, flags: typing.SupportsInt | typing.SupportsIndex, cache_id: typing.SupportsInt | typing.SupportsIndex, remote_tensors: numpy.typing.NDArray[numpy.uint32], remote_offsets: numpy.typing.NDArray[numpy.uint64], lengths: numpy.typing.NDArray[numpy.uint64], local_tensors: numpy.typing.NDArray[numpy.uint32], local_offsets: numpy.typing.NDArray[numpy.uint64]) -> Call:
        """
        A READ (write=False) or WRITE of the plan's spans into (from) local cache `cache_id`, made ready to run (run, submit): the core checks every local span against that cache's geometry (InvalidArgument) and makes the local spans from its registry's addresses; the layout stated is the cache's. CacheNotFound for an unknown cache. Never blocks.
        """
    def prepare_layer_pushes(self, *, cluster_id: typing.SupportsInt | typing.SupportsIndex, key_kind: typing.SupportsInt | typing.SupportsIndex, a: typing.SupportsInt | typing.SupportsIndex, b: typing.SupportsInt | typing.SupportsIndex, c: typing.SupportsInt | typing.SupportsIndex, unit_bytes: typing.SupportsInt | typing.SupportsIndex, cache_id: typing.SupportsInt | typing.SupportsIndex, kind: typing.SupportsInt | typing.SupportsIndex, src_unit: typing.SupportsInt | typing.SupportsIndex, src_blocks: numpy.typing.NDArray[numpy.uint64], dst_blocks: numpy.typing.NDArray[numpy.uint64], dst_block_bytes: typing.SupportsInt | typing.SupportsIndex, src_first: typing.SupportsInt | typing.SupportsIndex, dst_first: typing.SupportsInt | typing.SupportsIndex, layers: typing.SupportsInt | typing.SupportsIndex, tensors_per_layer: typing.SupportsInt | typing.SupportsIndex, dst_addrs: numpy.typing.NDArray[numpy.uint64]) -> list[Call]:
        """
        transfer_cache_async's pushes of one destination, every layer's, planned, checked and made ready to run in one call (Session::PrepareLayerPushes): local cache `cache_id` held (CacheNotFound), one layer's spans planned against its view with the Python API's texts (InvalidArgument: kind 0 slot `src_unit`, 1 blocks `src_blocks` into `dst_blocks` (`dst_block_bytes` apart, 0: a source block), 2 slot `src_unit` cut into `dst_block_bytes` chunks into `dst_blocks`), source layers src_first + k into destination layers dst_first + k for k < `layers`; by key (`dst_addrs` empty) one call per layer, by raw address one per tensor of each layer (layer-major), every address plus every span checked below 2**64 first. `key_kind`, `a`, `b`, `c`, `unit_bytes` name the destination. Never blocks.
        """
    def prepare_pull(self, cluster_id: typing.SupportsInt | typing.SupportsIndex, key_kind: typing.SupportsInt | typing.SupportsIndex, a: typing.SupportsInt | typing.SupportsIndex, b: typing.SupportsInt | typing.SupportsIndex, c: typing.SupportsInt | typing.SupportsIndex, checksum: bool, cache_id: typing.SupportsInt | typing.SupportsIndex, kind: typing.SupportsInt | typing.SupportsIndex, batch_index: typing.SupportsInt | typing.SupportsIndex, size: typing.SupportsInt | typing.SupportsIndex, src_offset: typing.SupportsInt | typing.SupportsIndex, dst_offset: typing.SupportsInt | typing.SupportsIndex, src_blocks: numpy.typing.NDArray[numpy.uint64], dst_blocks: numpy.typing.NDArray[numpy.uint64], src_layers: tuple[typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex] | None, dst_layers: tuple[typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex] | None, tensor_num_per_layer: typing.SupportsInt | typing.SupportsIndex) -> Call:
        """
        The Python face's pull, planned, checked and made ready to run (run, submit) in one call (Session::PreparePull): local cache `cache_id` held (CacheNotFound), the pull planned against its geometry with the Python API's rules and texts (InvalidArgument: kind 0 a slot, `batch_index`, `size` (-1: the rest), `src_offset` / `dst_offset` in it; 1 blocks `src_blocks` into `dst_blocks`; 2 the remote slot split into `dst_blocks`; half-open layer ranges, None for none), the request's size and every local span checked. `key_kind`, `a`, `b`, `c` name the remote cache; `checksum` asks the owner for a CRC-32. Never blocks; positional for speed (every pull passes here).
        """
    def prepare_push(self, cluster_id: typing.SupportsInt | typing.SupportsIndex, key_kind: typing.SupportsInt | typing.SupportsIndex, a: typing.SupportsInt | typing.SupportsIndex, b: typing.SupportsInt | typing.SupportsIndex, c: typing.SupportsInt | typing.SupportsIndex, cache_id: typing.SupportsInt | typing.SupportsIndex, blocks: bool, batch_index: typing.SupportsInt | typing.SupportsIndex, size: typing.SupportsInt | typing.SupportsIndex, src_blocks: numpy.typing.NDArray[numpy.uint64], dst_blocks: numpy.typing.NDArray[numpy.uint64], remote_first: typing.SupportsInt | typing.SupportsIndex, local_first: typing.SupportsInt | typing.SupportsIndex, count: typing.SupportsInt | typing.SupportsIndex) -> Call:
        """
        The Python face's push, planned, checked and made ready to run in one call (Session::PreparePush): local cache `cache_id` held (CacheNotFound), remote tensor remote_first + i <- local tensor local_first + i for i < count, then local slot `batch_index` (`size` bytes, -1: all) or local blocks `src_blocks` into remote blocks `dst_blocks` (InvalidArgument with the Python API's texts), the request's size and every local span checked. Never blocks; positional for speed.
        """
    def probe_cma(self, cluster_id: typing.SupportsInt | typing.SupportsIndex, timeout_s: typing.SupportsFloat | typing.SupportsIndex) -> None:
        """
        on the cma path, ask the kernel now whether it lets us read the owner's memory; a refusal changes the link's path and reason as the first pull would (datadist info --peer)
        """
    def remove_cache(self, cache_id: typing.SupportsInt | typing.SupportsIndex, wait_s: typing.SupportsFloat | typing.SupportsIndex) -> None:
        ...
    def run(self, call: Call, timeout_s: typing.SupportsFloat | typing.SupportsIndex) -> None:
        """
        Runs a prepared transfer until it ends or timeout_s passes, its local cache held by the core for the transfer (CacheNotFound, counted, when it is gone); the GIL is released where it waits.
        """
    def set_local_comm_res(self, set: bool, text: str) -> None:
        """
        After open: llm.LocalCommRes, checked when linking as CANN does (Engine::SetLocalCommRes).
        """
    def set_model_map(self, on: bool) -> None:
        ...
    def set_remote_writes(self, allowed: bool) -> None:
        ...
    def stop_also(self, key: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def stop_listening(self) -> None:
        ...
    def submit(self, call: Call, timeout_s: typing.SupportsFloat | typing.SupportsIndex) -> Handle:
        """
        Queues a prepared transfer on the engine's workers; returns its Handle at once. The core holds the call's local cache from now until the transfer ends (CacheNotFound, counted, when it is gone: nothing is queued), so unregistering it waits for the transfer.
        """
    def unbind_key(self, value: typing.SupportsInt | typing.SupportsIndex, model_id: typing.SupportsInt | typing.SupportsIndex, is_prefix: bool) -> None:
        ...
    def unbind_model(self, model_id: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def unlink(self, cluster_id: typing.SupportsInt | typing.SupportsIndex, timeout_s: typing.SupportsFloat | typing.SupportsIndex, *, force: bool, quiet_inbound: bool) -> None:
        ...
    def unlink_many(self, peers: collections.abc.Sequence[tuple[typing.SupportsInt | typing.SupportsIndex, str, typing.SupportsInt | typing.SupportsIndex]], timeout_s: typing.SupportsFloat | typing.SupportsIndex, *, force: bool, hixl: bool) -> list[tuple[int, str]]:
        """
        CANN's unlink of every (cluster_id, host, port) at once (Session::UnlinkMany; host "": none given); [(code, why)] in order, code 0 on success. Blocks without the GIL.
        """
    @property
    def async_threads(self) -> int:
        ...
    @property
    def port(self) -> int:
        ...
    @property
    def role(self) -> int:
        ...
    @role.setter
    def role(self, arg1: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
class PlannedPulls:
    """
    A CacheManager's planned pulls by their arguments (cpp/python/planned.h): the hit path of pull_blocks / pull_cache in one call
    """
    def __init__(self, engine: Engine, size: typing.SupportsInt | typing.SupportsIndex, max_weight: typing.SupportsInt | typing.SupportsIndex, small_request: typing.SupportsInt | typing.SupportsIndex, blocks_key_type: type, by_id_key_type: type, cache_key_type: type) -> None:
        ...
    def __len__(self) -> int:
        ...
    def clear(self) -> None:
        """
        Forgets every kept call.
        """
    def close(self) -> None:
        """
        Forgets every kept call and keeps none from now (the engine closes).
        """
    def find_blocks(self, key: builtins.object, cache: builtins.object, src_blocks: builtins.object, dst_blocks: builtins.object, kwargs: builtins.object) -> Call | None:
        """
        pull_blocks's kept call for these arguments (marked used), or None. Never blocks.
        """
    def find_slot(self, key: builtins.object, cache: builtins.object, batch_index: builtins.object, size: builtins.object, kwargs: builtins.object) -> Call | None:
        """
        pull_cache's kept call for these arguments, or None.
        """
    def put_blocks(self, key: builtins.object, cache: builtins.object, src_blocks: builtins.object, dst_blocks: builtins.object, kwargs: builtins.object, call: Call) -> bool:
        """
        Keeps `call` for these pull_blocks arguments, checked by the caller; False: they have no key.
        """
    def put_slot(self, key: builtins.object, cache: builtins.object, batch_index: builtins.object, size: builtins.object, kwargs: builtins.object, call: Call) -> bool:
        """
        Keeps `call` for these pull_cache arguments; False: no key.
        """
    def run_blocks(self, key: builtins.object, cache: builtins.object, src_blocks: builtins.object, dst_blocks: builtins.object, kwargs: builtins.object, timeout_s: typing.SupportsFloat | typing.SupportsIndex) -> bool:
        """
        pull_blocks(key, cache, src_blocks, dst_blocks, kwargs)'s kept call, run on the engine as Engine.run does (True); False, doing nothing, when the arguments have no key or none is kept. Positional.
        """
    def run_slot(self, key: builtins.object, cache: builtins.object, batch_index: builtins.object, size: builtins.object, kwargs: builtins.object, timeout_s: typing.SupportsFloat | typing.SupportsIndex) -> bool:
        """
        pull_cache(key, cache, batch_index, size, kwargs)'s kept call, run as run_blocks.
        """
    @property
    def total(self) -> int:
        """
        the kept calls' local spans
        """
def build_info() -> dict[str, str]:
    """
    A dict: compiler, build_type, pybind11 (what it was built with), protocol (the core's wire version).
    """
def check_option(key: str, value: str) -> bool | int | str:
    """
    One value of `key` checked alone (LLMConfig's setters): its parsed value, or InvalidArgument (LLM_PARAM_INVALID) with the table's message; KeyError for a key the table has not.
    """
def cuda_device(addr: typing.SupportsInt | typing.SupportsIndex) -> int | None:
    """
    The CUDA device whose memory (device or managed) `addr` is, or None: host memory, no CUDA runtime.
    """
def metrics_record(op: str, cluster_id: typing.SupportsInt | typing.SupportsIndex, nbytes: typing.SupportsInt | typing.SupportsIndex, seconds: typing.SupportsFloat | typing.SupportsIndex, code: typing.SupportsInt | typing.SupportsIndex) -> None:
    """
    Counts one transfer the core did not run (code 0: succeeded), e.g. one refused before it reached the core.
    """
def metrics_reset() -> None:
    """
    Zeroes every counter (tests).
    """
def metrics_series() -> list[tuple[str, int, int, int, dict[str, int], list[int], int]]:
    """
    Every series with a transfer: (op, cluster_id, transfers, bytes, {status name: count}, bucket counts, nanoseconds).
    """
def nixl_load(path: str) -> tuple[bool, str]:
    """
    (loaded, why not): loads NIXL's C API from `path` (the first call wins).
    """
def options() -> list[OptionSpec]:
    """
    Every row of the option table, in its order.
    """
def parse_options(options: collections.abc.Mapping[str, str], *, environ: bool = True) -> dict[str, tuple[bool | int | str, str]]:
    """
    {key: (value, source)} for every row of the table: `options` (str to str) first, then (with `environ`) the process's environment, then the default; source is 'option', 'env' or 'default'. InvalidArgument (LLM_PARAM_INVALID) with the table's message for a bad value.
    """
def set_thread_cpus(cpus: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]) -> None:
    """
    The CPUs the core's threads started from now on run on (empty: those of the thread that starts them).
    """
def thread_cpus() -> list[int]:
    """
    What set_thread_cpus set last (empty: the core's threads take their creator's CPUs).
    """
def tls() -> tuple[bool, str]:
    """
    (available, what): does this build have TLS, and the OpenSSL it runs with (or why not).
    """
__version__: str = '0.1.0'
