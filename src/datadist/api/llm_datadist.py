"""``LLMDataDist``: one per process; init, links, and the cache managers.

Who calls: user code. ``init`` starts the engine (and its listener when ``llm.listenIpInfo``
is given); ``link_clusters`` / ``unlink_clusters`` block up to their timeout and return codes
instead of raising; ``finalize`` tears everything down (also at exit).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import threading
from typing import Any, ClassVar

from datadist.api import config as cfg
from datadist.api import rank_table as rank_table_mod
from datadist.api.cache_manager import CacheManager
from datadist.api.checks import check_int, check_isinstance
from datadist.api.config import LLMClusterInfo, ip_text
from datadist.api.enums import LLMRole, RegisterMemStatus
from datadist.api.link_failures import LinkFailures, warn_caller
from datadist.api.notices import ClusterIdMismatchWarning, LinkFailedWarning
from datadist.api.status import (
    LLMException,
    LLMStatusCode,
    code_to_status,
    llm_errors,
    to_llm_exception,
)
from datadist.core import options as core_options
from datadist.core.address import format_host_port, parse_host_port
from datadist.core.comm import CommManager, CommState, Member
from datadist.core.config import EngineConfig, engine_settings
from datadist.core.errors import DatadistError, InvalidArgument
from datadist.core.native import NativeEngine, engine_for
from datadist.memory.pool import PoolConfig

log = logging.getLogger(__name__)

MAX_CLUSTERS_PER_CALL = 16
DEFAULT_LINK_TOTAL_TIME_S = 120  # HCCL_CONNECT_TIMEOUT's default


def _param_invalid(msg: str) -> LLMException:
    return LLMException(msg, status_code=LLMStatusCode.LLM_PARAM_INVALID)


def _mismatch_text(asked: int, answered: int, host: str, port: int) -> str:
    """The ClusterIdMismatchWarning's text: both ids, and what to use."""
    where = format_host_port(host, port)
    return (f"link_clusters: the listener at {where} answered as cluster {answered}, not "
            f"the remote_cluster_id {asked} asked for; linked as the original does, under "
            f"cluster {answered}: name {answered} in cache keys and unlink_clusters (transfers "
            f"from cluster {asked} answer LLM_NOT_YET_LINK), or fix remote_cluster_id")


def _not_in_mode(what: str, cache_manager_mode: bool) -> LLMException:
    """The original's text for a call or option of the other mode (v2/llm_datadist.py,
    ``_check_is_cache_mgr_mode`` / ``_check_is_not_cache_mgr_mode``): LLM_PARAM_INVALID."""
    neg = "" if cache_manager_mode else "not "
    return _param_invalid(f"{what} is not supported when llm.EnableCacheManager is {neg}"
                          "configured.")


def _check_global_resource_config(raw: str) -> None:
    """With the HIXL backend, ``llm.GlobalResourceConfig`` is empty or a JSON object, as the
    original's HixlOptions::ParseGlobalResourceConfig (src/hixl/engine/hixl_options.cc)
    requires at init; anything else is LLM_PARAM_INVALID. Its fields tune HIXL and are not
    read here."""
    if not raw:
        return

    def no_constant(name: str) -> None:  # NaN / Infinity are not JSON (nlohmann refuses them)
        raise ValueError(f"{name} is not JSON")

    try:
        value = json.loads(raw, parse_constant=no_constant)
    except ValueError as e:
        raise _param_invalid(f"Failed to parse GlobalResourceConfig json, exception:{e}") from None
    if not isinstance(value, dict):
        raise _param_invalid("GlobalResourceConfig must be a JSON object.")


def _check_flow_graph_max_size(options: dict[Any, Any]) -> None:
    """``ge.flowGraphMemMaxSize``, as v2/llm_datadist.py ``_check_flow_graph_max_size``:
    a str (TypeError otherwise, an int included), one pool, digits (LLM_PARAM_INVALID)."""
    value = options.get("ge.flowGraphMemMaxSize")
    if value is None:
        return
    check_isinstance("ge.flowGraphMemMaxSize", value, str, allow_none=False)
    if len(value.split(",")) != 1:
        raise _param_invalid("ge.flowGraphMemMaxSize only support one mem pool in llm datadist")
    if not value.isdigit():
        raise _param_invalid(f"ge.flowGraphMemMaxSize must be digit, config value={value}")


def _table(opts: dict[str, str]) -> dict[str, Any]:
    """The :class:`EngineConfig` fields the core's option table decides for ``opts`` (with
    the environment): its one parser, the C++ API's too. LLMException PARAM_INVALID with the
    table's message for a bad value; FEATURE_NOT_ENABLED where the core is not built."""
    try:
        parsed = core_options.parse_options(opts)
    except InvalidArgument as e:
        raise _param_invalid(str(e)) from None
    except DatadistError as e:
        raise to_llm_exception(e, "init") from None
    return engine_settings(parsed)


class LLMDataDist:
    """The per-process entry point: ``LLMDataDist(role, cluster_id).init(options)``."""

    llm_engine_instance: ClassVar[LLMDataDist | None] = None
    _instance_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        check_isinstance("role", role, LLMRole, allow_none=False)
        check_int("cluster_id", cluster_id, "uint64", allow_none=False)
        self._role = role
        self._cluster_id = cluster_id
        self._engine: NativeEngine | None = None
        self._cache_manager: CacheManager | None = None
        self._kv_cache_manager: Any = None
        self._cache_manager_mode = False
        self._hixl_backend = False  # llm.TransferBackend = "hixl"
        self._options: dict[str, str] = {}
        self._comms: CommManager | None = None  # two-sided links (link / unlink)
        self._link_failures = LinkFailures()  # why link_clusters failed, per cluster
        self._finalized = False  # finalize() ran and no init() since
        self._mode_selector = ""  # what selected cache-manager mode (set by init)

    def __repr__(self) -> str:
        state = "initialized" if self._engine is not None else "not initialized"
        return f"<LLMDataDist {self._role} cluster_id={self._cluster_id} {state}>"

    # ------------------------------------------------------------------ properties

    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def cache_manager(self) -> CacheManager:
        self._check_init()
        if not self._cache_manager_mode:
            raise _not_in_mode("cache_manager", False)
        assert self._cache_manager is not None
        return self._cache_manager

    @property
    def kv_cache_manager(self) -> Any:
        self._check_init()
        if self._cache_manager_mode:
            raise _not_in_mode("kv_cache_manager", True)
        return self._kv_cache_manager

    @property
    def listen_address(self) -> tuple[str, int] | None:
        """datadist extra: the (ip, port) this instance listens on, with port 0 resolved."""
        return None if self._engine is None else self._engine.listen_address

    @property
    def engine(self) -> NativeEngine:
        """datadist extra: the typed engine under this facade (links, paths, caches)."""
        self._check_init()
        assert self._engine is not None
        return self._engine

    def _check_init(self) -> None:
        """Every call but init / finalize: refused on an instance that is not running.
        Never initialized: RuntimeError, the original's text (v2/llm_datadist.py
        ``_check_is_inited``). After ``finalize()``: LLMException LLM_ENGINE_FINALIZED (a
        RuntimeError too, so code written for the original still catches it; the code is
        the one llm_datadist's status.py names for this state, and the one this package's
        CacheManager raises after finalize), saying what to do."""
        if self._engine is not None:
            return
        if self._finalized:
            raise LLMException(
                "llm datadist was finalized (finalize() ran, or the process is exiting): "
                "call init(options) on it again, or create and init a new LLMDataDist",
                status_code=LLMStatusCode.LLM_ENGINE_FINALIZED)
        raise RuntimeError("llm datadist is not initialized")

    # ------------------------------------------------------------------ init / finalize

    def init(self, options: dict[str, str]) -> None:
        """Start the engine. A no-op when already initialized; one instance per process."""
        with LLMDataDist._instance_lock:
            # v2/llm_datadist.py init: initialized, then another instance, then the options
            if self._engine is not None:
                return
            if LLMDataDist.llm_engine_instance is not None:
                raise LLMException("Cannot init multiple LLMDataDists",
                                   status_code=LLMStatusCode.LLM_FAILED)
            check_isinstance("options", options, dict, allow_none=False)
            _check_flow_graph_max_size(options)
            opts = self._setup_options(options)
            engine_cfg = self._engine_config(opts)
            with llm_errors("init"):
                engine = engine_for(engine_cfg)
            # Accepted as the original does; checked when linking, as its default backend
            # parses it then. The HIXL backend reads another format (its endpoint list,
            # version "1.3": hixl's EndpointGenerator), describing NICs datadist does not use.
            engine.set_local_comm_res(
                None if self._hixl_backend else opts.get(cfg.OPT_LOCAL_COMM_RES))
            self._engine = engine
            self._options = opts
            self._finalized = False
            if self._cache_manager_mode:
                self._cache_manager = CacheManager(
                    engine,
                    remote_cache_accessible=opts.get(cfg.OPT_REMOTE_CACHE_ACCESSIBLE) == "1",
                    mem_pool=engine_cfg.device_pool is not None,
                    host_mem_pool=engine_cfg.host_pool is not None,
                    two_sided=bool(opts.get(cfg.OPT_LOCAL_COMM_RES)),
                )
            else:
                from datadist.api.v1 import KvCacheManager

                self._kv_cache_manager = KvCacheManager(engine, self._role)
            LLMDataDist.llm_engine_instance = self

    @staticmethod
    def _role_to_str(role: LLMRole) -> str:
        """The ``llm.Role`` option's text for a role (the original's static helper of the
        same name; its tests/python/test_llm_datadist_coverage.py calls it)."""
        return {LLMRole.PROMPT: "Prompt", LLMRole.DECODER: "Decoder", LLMRole.MIX: "Mix"}[role]

    def _setup_options(self, options: dict[str, str]) -> dict[str, str]:
        """llm_datadist's mode selection, on a copy of the options."""
        opts = {str(k): str(v) for k, v in options.items()}
        opts["llm.Role"] = self._role_to_str(self._role)
        # What selected cache-manager mode, in the caller's words (for refusals that name it).
        self._mode_selector = (
            f"{cfg.OPT_ENABLE_CACHE_MANAGER} = 1 (LLMConfig.enable_cache_manager)"
            if opts.get(cfg.OPT_ENABLE_CACHE_MANAGER) == "1" else
            f"{cfg.OPT_LOCAL_COMM_RES} (LLMConfig.local_comm_res) is set, which turns on "
            f"{cfg.OPT_ENABLE_CACHE_MANAGER}")
        if cfg.OPT_LOCAL_COMM_RES in opts:
            opts.setdefault(cfg.OPT_ENABLE_CACHE_MANAGER, "1")
            opts.setdefault(cfg.OPT_REMOTE_CACHE_ACCESSIBLE, "1")
        self._cache_manager_mode = opts.get(cfg.OPT_ENABLE_CACHE_MANAGER) == "1"
        if cfg.OPT_LOCAL_COMM_RES in opts and not self._cache_manager_mode:
            raise _not_in_mode(cfg.OPT_LOCAL_COMM_RES, False)
        if cfg.OPT_TRANSFER_BACKEND in opts:
            # v2/llm_datadist.py _setup_engine_option, its texts
            if not self._cache_manager_mode:
                raise _not_in_mode(cfg.OPT_TRANSFER_BACKEND, False)
            if opts.setdefault(cfg.OPT_REMOTE_CACHE_ACCESSIBLE, "1") != "1":
                raise _param_invalid("llm.TransferBackend is not supported when "
                                     "llm.EnableRemoteCacheAccessible is not enable.")
            if cfg.OPT_LISTEN_IP_INFO not in opts:
                raise _param_invalid("llm.TransferBackend is not supported when "
                                     "llm.listenIpInfo is not configured.")
        self._hixl_backend = opts.get(cfg.OPT_TRANSFER_BACKEND) == "hixl"
        if self._hixl_backend:
            _check_global_resource_config(opts.get(cfg.OPT_GLOBAL_RESOURCE, ""))
        listen = opts.get(cfg.OPT_LISTEN_IP_INFO)
        if listen and self._cache_manager_mode:
            ip, port = _parse_listen(listen)
            opts["llm.ListenIp"], opts["llm.ListenPort"] = ip, str(port)
        if not self._cache_manager_mode and self._role == LLMRole.PROMPT and not listen:
            raise _param_invalid("a PROMPT without cache-manager mode needs llm.listenIpInfo")
        return opts

    def _engine_config(self, opts: dict[str, str]) -> EngineConfig:
        listen = None
        raw = opts.get(cfg.OPT_LISTEN_IP_INFO)
        if raw:
            # v1 allows one ip:port per device separated by ';': we serve the first.
            try:
                listen = parse_host_port(raw.split(";")[0])
            except InvalidArgument as e:
                raise _param_invalid(str(e)) from None
        table = _table(opts)  # datadist.* and llm.SyncKvCacheWaitTime, as the core reads them
        cfg.link_total_time_s(opts, os.environ, DEFAULT_LINK_TOTAL_TIME_S)  # checked now
        pools = {}
        for key in (cfg.OPT_MEM_POOL, cfg.OPT_HOST_MEM_POOL):
            if opts.get(key):
                with llm_errors("init"):
                    pools[key] = PoolConfig.parse(opts[key])
        if not self._cache_manager_mode and cfg.OPT_MEM_POOL not in pools:
            from datadist.api.v1 import v1_pool_config  # legacy mode: the KV pool

            pools[cfg.OPT_MEM_POOL] = v1_pool_config(opts)
        return EngineConfig(
            cluster_id=self._cluster_id,
            role=int(self._role),
            listen=listen,
            device_pool=pools.get(cfg.OPT_MEM_POOL),
            host_pool=pools.get(cfg.OPT_HOST_MEM_POOL),
            remote_cache_accessible=opts.get(cfg.OPT_REMOTE_CACHE_ACCESSIBLE) == "1",
            **table,
        )

    def finalize(self) -> None:
        """Release everything. A no-op when not initialized."""
        with LLMDataDist._instance_lock:
            engine, self._engine = self._engine, None
            if engine is None:
                return
            self._finalized = True
            if self._cache_manager is not None:
                self._cache_manager._invalidate()
            if self._kv_cache_manager is not None:
                self._kv_cache_manager._invalidate()
            if self._comms is not None:
                self._comms.close()
                self._comms = None
            engine.close()
            if LLMDataDist.llm_engine_instance is self:
                LLMDataDist.llm_engine_instance = None

    # ------------------------------------------------------------------ links

    def _check_clusters(self, clusters: Any, timeout: Any) -> list[LLMClusterInfo]:
        # v2/llm_datadist.py link_clusters / unlink_clusters: the timeout first, then the list
        check_int("timeout", timeout, "int32", allow_none=False)
        if timeout <= 0:
            raise _param_invalid(f"Param timeout should be greater than 0. (got {timeout})")
        check_isinstance("clusters", clusters, (list, tuple), allow_none=False)
        for c in clusters:
            check_isinstance("cluster", c, LLMClusterInfo, allow_none=False)
        for c in clusters:
            # Unset (None) is a TypeError, as llm_datadist's check_uint64 makes it.
            check_int("remote_cluster_id", c.remote_cluster_id, "uint64", allow_none=False)
        return list(clusters)

    def link_clusters(self, clusters: list[LLMClusterInfo] | tuple[LLMClusterInfo, ...],
                      timeout: int = 3000) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Link to each cluster's listener; returns (overall code, per-cluster codes).

        Never raises for a link that fails: its code is LLM_LINK_FAILED whatever the reason
        (as LLM-DataDist), and the reason is a :class:`LinkFailedWarning` (stderr by
        default) and :meth:`last_link_failure` (api/link_failures.py). Links are made in
        parallel, each bounded by ``timeout`` ms.
        As the original, a link is known by the cluster id its listener announces, whatever
        ``remote_cluster_id`` said (with the HIXL backend the two must match here);
        transfers and unlinks name that id. When the two differ the link still succeeds (as
        LLM-DataDist, which never compares them), with a :class:`ClusterIdMismatchWarning`
        naming both ids.
        """
        self._check_init()
        clusters = self._check_clusters(clusters, timeout)
        if not clusters:
            # llm_datadist's native LinkClusters answers an empty list with this code.
            return LLMStatusCode.LLM_PARAM_INVALID, []
        local_comm_res = self._options.get(cfg.OPT_LOCAL_COMM_RES, "")
        for c in clusters:
            if self._cache_manager_mode and not local_comm_res and not c.local_ip_info_list:
                raise _param_invalid(
                    "local_ip_info_list is empty. Call append_local_ip_info to add local_ip_info "
                    "when local_comm_res option is unspecified or empty.")
            if not c.remote_ip_info_list:
                raise _param_invalid(f"cluster {c.remote_cluster_id} has no remote ip info")
        if len(clusters) > MAX_CLUSTERS_PER_CALL:
            # A native limit in llm_datadist: reported in the codes, like any link failure.
            return (LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT,
                    [LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT] * len(clusters))
        failures: list[str] = []  # texts to warn about, in the application's thread
        mismatches: list[str] = []
        peers: list[tuple[int, str, int]] = []
        for c in clusters:
            assert c.remote_cluster_id is not None  # _check_clusters refused an unset one
            ip, port = c.remote_ip_info_list[0]
            peers.append((c.remote_cluster_id, ip_text(ip), port))
        # The core links them all at once, each bounded by the timeout (Session::LinkMany).
        # The default backend files a link under the id the peer announces, as
        # LinkMsgHandler::ExchangeInfoProcess (AddEntity(peer_exchange_info.cluster_id));
        # HIXL's LinkCluster files it under the id passed (datadist: it must match).
        outcomes = self.engine.link_many(peers, timeout / 1000.0,
                                         as_announced=not self._hixl_backend)
        codes: list[LLMStatusCode] = []
        for (cluster_id, host, port), (code, filed, why) in zip(peers, outcomes, strict=True):
            if code == LLMStatusCode.LLM_SUCCESS:
                if filed != cluster_id:
                    text = _mismatch_text(cluster_id, filed, host, port)
                    log.warning("%s", text)
                    mismatches.append(text)
                self._link_failures.succeeded(cluster_id)
                codes.append(LLMStatusCode.LLM_SUCCESS)
            elif code == LLMStatusCode.LLM_ALREADY_LINK:
                codes.append(LLMStatusCode.LLM_ALREADY_LINK)
            else:
                # LLM_PARAM_INVALID: local_comm_res (ours or the peer's) is not what the
                # original can parse (its RankTableGeneratorFactory fails the link so);
                # any other failure is LLM_LINK_FAILED, as LLM-DataDist reports it.
                status = (LLMStatusCode.LLM_PARAM_INVALID if code == LLMStatusCode.LLM_PARAM_INVALID
                          else LLMStatusCode.LLM_LINK_FAILED)
                failures.append(
                    self._link_failures.report(cluster_id, host, port, status.name, why))
                codes.append(status)
        # Here, in the application's thread: the warnings name the application's call
        # (stacklevel 2 from this method).
        warn_caller(failures, LinkFailedWarning, stacklevel=2)
        warn_caller(mismatches, ClusterIdMismatchWarning, stacklevel=2)
        return self._overall(codes), codes

    def last_link_failure(self, remote_cluster_id: int) -> str | None:
        """datadist extra: why the last ``link_clusters`` to ``remote_cluster_id`` failed
        (refused port, wrong cluster id, secret, TLS, timeout), or None when it has not
        failed since its last success. Never blocks; callable before ``init``."""
        check_int("remote_cluster_id", remote_cluster_id, "uint64", allow_none=False)
        return self._link_failures.last(remote_cluster_id)

    def unlink_clusters(self, clusters: list[LLMClusterInfo] | tuple[LLMClusterInfo, ...],
                        timeout: int = 3000,
                        force: bool = False) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Unlink; without ``force`` the peer is told too. ``force`` always drops our end.

        With ``llm.TransferBackend = "hixl"`` (HixlTransferEngine::UnlinkCluster) a cluster
        needs no remote ip info and ``force`` is ignored: our link to it is closed politely
        (LLM_UNLINK_FAILED if the peer could not be told), the peer's link to us is closed
        without a word, and a cluster we have no link with is LLM_SUCCESS. Otherwise:

        Either end of a link unlinks its own end: the one that called ``link_clusters``, and
        the one it linked to (whose end is the linker's reverse channel). As LLM-DataDist's
        LinkMsgHandler::UnlinkCluster: without ``force`` a cluster needs exactly one remote
        ip info (else LLM_PARAM_INVALID), and a peer that cannot be told is
        LLM_UNLINK_FAILED (our end is closed all the same, so a relink works); unlinking a
        cluster we have no link with is LLM_SUCCESS, without ``force`` only if its listener
        answers at the remote address (the original tells it, and it has nothing to drop).
        """
        self._check_init()
        clusters = self._check_clusters(clusters, timeout)
        check_isinstance("force", force, bool, allow_none=False)
        if not clusters:
            # As in llm_datadist's native UnlinkClusters.
            return LLMStatusCode.LLM_PARAM_INVALID, []
        if len(clusters) > MAX_CLUSTERS_PER_CALL:
            # A native limit in llm_datadist: reported in the codes, like any link failure.
            return (LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT,
                    [LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT] * len(clusters))
        codes: list[LLMStatusCode | None] = []
        peers: list[tuple[int, str, int]] = []
        for c in clusters:
            cluster_id = c.remote_cluster_id
            assert cluster_id is not None  # _check_clusters refused an unset one
            if not self._hixl_backend and not force and len(c.remote_ip_info_list) != 1:
                codes.append(LLMStatusCode.LLM_PARAM_INVALID)
                continue
            codes.append(None)
            if len(c.remote_ip_info_list) == 1:
                ip, port = c.remote_ip_info_list[0]
                peers.append((cluster_id, ip_text(ip), port))
            else:
                peers.append((cluster_id, "", 0))
        # The core unlinks them all at once (Session::UnlinkMany: both ends; a cluster we have
        # no link with succeeds when forced or HIXL, else as its listener answers a dial).
        outcomes = iter(self.engine.unlink_many(peers, timeout / 1000.0, force=force,
                                                hixl=self._hixl_backend))
        done = [c if c is not None else code_to_status(next(outcomes)[0]) for c in codes]
        return self._overall(done), done

    @staticmethod
    def _overall(codes: list[LLMStatusCode]) -> LLMStatusCode:
        """The last failure, as LLMLinkManager::LinkClusters / UnlinkClusters report it."""
        for c in reversed(codes):
            if c != LLMStatusCode.LLM_SUCCESS:
                return c
        return LLMStatusCode.LLM_SUCCESS

    def switch_role(self, role: LLMRole, switch_options: dict[str, str] | None = None) -> None:
        """Change the role label; optionally start, move or stop listening.

        Raises LLM_EXIST_LINK while links (ours or peers') are alive.
        """
        self._check_init()
        check_isinstance("role", role, LLMRole, allow_none=False)
        # The original's Python layer (hixl v2/llm_datadist.py switch_role) checks, in v1
        # mode, the role before the options' type, and both before its native layer refuses
        # a datadist without enable_switch_role.
        if not self._cache_manager_mode and role == self._role:
            raise _param_invalid(f"role not changed, role = {role.name}")
        check_isinstance("switch_options", switch_options, dict)
        engine = self.engine
        if not self._cache_manager_mode:
            if role == LLMRole.PROMPT and not (switch_options or {}).get(cfg.OPT_LISTEN_IP_INFO):
                raise _param_invalid(
                    'Failed to switch to Prompt, option "llm.listenIpInfo" must be specified')
            if self._options.get(cfg.OPT_SWITCH_ROLE) != "1":
                raise LLMException("switch_role needs enable_switch_role",
                                   status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
        if engine.has_links():
            raise LLMException("switch_role while links exist",
                               status_code=LLMStatusCode.LLM_EXIST_LINK)
        listen = (switch_options or {}).get(cfg.OPT_LISTEN_IP_INFO)
        with llm_errors("switch_role"):
            if listen:
                host, port = _parse_listen(listen)
                if engine.listen_address != (host, port) or port == 0:
                    engine.start_listening(host, port)
            elif engine.listener is not None:
                engine.stop_listening()
        self._role = role
        engine.role = int(role)

    def check_link_status(self, remote_cluster_id: int) -> None:
        """v1 mode: raise if the link to ``remote_cluster_id`` is not usable."""
        self._check_init()
        if self._cache_manager_mode:  # the mode first, as v2/llm_datadist.py
            # The original's text, then which mode this is and what to use in it.
            e = _not_in_mode("check_link_status", True)
            raise LLMException(
                f"{e} This instance is in cache-manager mode ({self._mode_selector}); "
                "check_link_status checks links of the legacy mode (KvCacheManager, "
                "llm.EnableCacheManager unset). In cache-manager mode link_clusters' "
                "return codes say whether each link was made, last_link_failure(cluster_id) "
                "why one failed, and query_register_mem_status(comm_id) whether a link() "
                "is ready.", status_code=LLMStatusCode.LLM_PARAM_INVALID) from None
        check_int("remote_cluster_id", remote_cluster_id, "uint64", allow_none=False)
        with llm_errors("check_link_status"):
            self.engine.check_link(remote_cluster_id, self.engine.config.sync_timeout)

    # ------------------------------------------------------------------ two-sided links

    def link(self, comm_name: str, cluster_rank_info: dict[int, int], rank_table: str) -> int:
        """Join a two-sided link: every member calls this with the same arguments.

        ``cluster_rank_info`` maps each member's cluster id to its rank (2..4 members, ranks
        ascending in dict order, this instance among them); ``rank_table`` is an HCCL rank
        table JSON (v1.0 / v1.2) whose ``device_ip`` per rank is the host address to use;
        each rank listens on 16666 + its ``device_id``, or on its ``device_port`` when given
        (see :mod:`datadist.api.rank_table`). Cache-manager mode only.

        Blocks until every member has joined, as LLM-DataDist's ``link`` does, within
        ``link_total_time`` seconds (``llm.LinkTotalTime``; 0 or unset: env
        ``HCCL_CONNECT_TIMEOUT``, else 120), and returns the comm id; a member missing at the
        deadline raises LLM_LINK_FAILED. Links inside one process are made one at a time (a
        second call waits for the first, within its own link time). Then
        :meth:`query_register_mem_status` is OK. Register caches before linking.
        """
        self._check_init()
        if not self._cache_manager_mode:
            raise _not_in_mode("link", False)
        # v2/llm_datadist.py link: its checks, their texts and their order (the name, the
        # dict's types and size, its values' ranges, then the rank table's type, then ranks)
        check_isinstance("comm_name", comm_name, str, allow_none=False)
        if not comm_name:
            raise _param_invalid("comm_name can not be empty")
        if len(comm_name) >= 128:
            raise _param_invalid("comm_name length should be smaller than 128.")
        check_isinstance("cluster_rank_info", cluster_rank_info, dict, allow_none=False)
        for cid, rank in cluster_rank_info.items():
            check_isinstance("cluster_rank_info dict key", cid, int, allow_none=False)
            check_isinstance("cluster_rank_info dict value", rank, int, allow_none=False)
        if len(cluster_rank_info) > 4:
            raise _param_invalid("cluster_rank_info size can not be greater than 4.")
        for cid, rank in cluster_rank_info.items():
            check_int("cluster_rank_info key", cid, "uint64", allow_none=False)
            check_int("cluster_rank_info value", rank, "uint32", allow_none=False)
        check_isinstance("rank_table", rank_table, str, allow_none=False)
        if len(cluster_rank_info) <= 1:
            raise _param_invalid("cluster num must be bigger than 1.")
        ranks = list(cluster_rank_info.values())
        if any(b <= a for a, b in zip(ranks, ranks[1:], strict=False)):
            # the original's text; datadist refuses a repeated rank here too
            raise _param_invalid(f"rank in cluster_rank_info must be ordered (ascending and "
                                 f"distinct), got {ranks}")
        if self._cluster_id not in cluster_rank_info:
            raise _param_invalid(f"cluster_rank_info does not list this cluster "
                                 f"({self._cluster_id})")
        engine = self.engine
        # A table that names no usable rank is LLM_LINK_FAILED: the original hands it to HCCL
        # (comm_link_manager.cc CommLinkManager::Link, HcclCommInitClusterInfoMemConfig) and
        # answers any refusal LLM_LINK_FAILED. rank_table's own errors say what is wrong.
        try:
            table = rank_table_mod.parse(rank_table)
            members = []
            for cid, rank in cluster_rank_info.items():
                entry = table.get(rank)
                if entry is None:
                    raise _param_invalid(f"rank {rank} (cluster {cid}) is not in the "
                                         "rank_table")
                members.append(Member(cid, rank, entry.device_ip,
                                      rank_table_mod.port_of(entry)))
        except LLMException as e:
            raise LLMException(f"[link] {e}", status_code=LLMStatusCode.LLM_LINK_FAILED) from None
        me = next(m for m in members if m.cluster_id == self._cluster_id)
        peers = [m for m in members if m is not me]
        with LLMDataDist._instance_lock:
            if self._comms is None:
                self._comms = CommManager(engine)
            comms = self._comms
        with llm_errors("link"):
            comm_id = comms.link(comm_name, me, peers, self._link_total_time())
        assert self._cache_manager is not None
        self._cache_manager.set_is_call_linked()
        return comm_id

    def _link_total_time(self) -> float:
        return float(cfg.link_total_time_s(self._options, os.environ,
                                           DEFAULT_LINK_TOTAL_TIME_S))

    def _comm_manager(self, comm_id: Any, func: str) -> CommManager:
        self._check_init()
        if not self._cache_manager_mode:
            raise _not_in_mode(func, False)
        check_int("comm_id", comm_id, "uint64", allow_none=False)  # v2/llm_datadist.py
        if self._comms is None:
            raise LLMException(f"comm_id {comm_id} is not a live link",
                               status_code=LLMStatusCode.LLM_NOT_YET_LINK)
        return self._comms

    def unlink(self, comm_id: int) -> None:
        """Leave a two-sided link: drop the links it made and tell the members. Unknown
        comm ids raise LLM_NOT_YET_LINK (as LLM-DataDist's CommLinkManager::Unlink)."""
        comms = self._comm_manager(comm_id, "unlink")
        with llm_errors("unlink"):
            comms.unlink(comm_id)

    def query_register_mem_status(self, comm_id: int) -> RegisterMemStatus:
        """OK for a comm id :meth:`link` returned (it returns once every member joined);
        unknown ids raise LLM_NOT_YET_LINK. Never blocks."""
        comms = self._comm_manager(comm_id, "query_register_mem_status")
        with llm_errors("query_register_mem_status"):
            state = comms.status(comm_id)
        return {CommState.PREPARING: RegisterMemStatus.PREPARING,
                CommState.OK: RegisterMemStatus.OK}.get(state, RegisterMemStatus.FAILED)


def _parse_listen(listen: str) -> tuple[str, int]:
    """llm.listenIpInfo of init (cache-manager mode) and switch_role: "ip:port" (IPv6 in
    brackets). Without any ':' the original's text (v2/llm_utils.py parse_listen_ip_info);
    datadist's own checks of the rest say what is wrong. LLM_PARAM_INVALID."""
    if ":" not in listen:
        raise _param_invalid(f'llm.listenIpInfo "{listen}" is invalid, format should be '
                             '"ip:port"')
    try:
        return parse_host_port(listen)
    except InvalidArgument as e:
        raise _param_invalid(str(e)) from None


def _shutdown_handler() -> None:
    """Finalize the process's LLMDataDist, if any; an LLMException from finalize (another
    framework finalized it already) is swallowed. Registered with atexit; also importable
    from ``v2.llm_datadist`` under this name, as the original's (hixl v2/llm_datadist.py,
    whose tests/python/test_llm_datadist_coverage.py calls it)."""
    inst = LLMDataDist.llm_engine_instance
    if inst is not None:
        with contextlib.suppress(LLMException):
            inst.finalize()


atexit.register(_shutdown_handler)
