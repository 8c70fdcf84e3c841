"""A PROMPT or DECODER process for the fault tests, driven over stdin/stdout.

Run by ``tests/faults/fault_harness.py`` as ``python fault_peer.py`` (the hostile-input tests
also import :func:`pattern` from it). It uses datadist the way a user does
(``import datadist as llm_datadist``). The parent writes
one JSON object per line (``{"op": ..., ...}``) and reads one JSON reply per line, prefixed with
``@@`` so that stray output can never be taken for a reply. A failed op answers
``{"error": "<LLMStatusCode name>"}`` (an LLMException) or ``{"exception": traceback}``.

Memory layout. Every cache is ``num_tensors`` tensors of ``blocks * block_bytes`` bytes, in
one buffer: either anonymous memory with ``guard`` bytes of 0xEE before, between and after
the tensors (to catch any read or write outside the registered spans), or a file (``shm``),
so that the parent can watch bytes land while a pull runs. Source caches hold
:func:`pattern`; no pattern byte is ever 0xEE (every byte is below 0x80).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import sys
import threading
import time
import traceback

import numpy as np

import datadist as llm_datadist

GUARD_BYTE = 0xEE
_MASK = np.uint64(0x7F7F7F7F7F7F7F7F)
_MUL = np.uint64(0x9E3779B97F4A7C15)
_PAGE = mmap.PAGESIZE


def pattern(seed: int, tensor: int, start: int, nbytes: int) -> np.ndarray:
    """The bytes ``[start, start + nbytes)`` of source tensor ``tensor`` for ``seed``.

    Both must be multiples of 8. Cheap enough for 256 MiB tensors (numpy, one pass)."""
    words = np.arange(start // 8, (start + nbytes) // 8, dtype=np.uint64)
    words += np.uint64(((seed & 0xFFFF) << 48) | ((tensor & 0xFF) << 40))
    words *= _MUL
    words ^= words >> np.uint64(29)
    words &= _MASK
    return words.view(np.uint8)


class Buffer:
    """The memory of one cache: tensor views, plus the guard regions around them."""

    def __init__(self, num_tensors: int, tensor_bytes: int, guard: int, shm: str | None):
        self.num_tensors, self.tensor_bytes, self.guard = num_tensors, tensor_bytes, guard
        if shm:
            size = num_tensors * tensor_bytes
            fd = os.open(shm, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.ftruncate(fd, size)
                self.map = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            self.raw = np.frombuffer(self.map, dtype=np.uint8)
            self.tensors = [self.raw[i * tensor_bytes:(i + 1) * tensor_bytes]
                            for i in range(num_tensors)]
            self.guards: list[np.ndarray] = []
            return
        # Page-aligned tensors with a guard before, between and after them.
        step = -(-(tensor_bytes + guard) // _PAGE) * _PAGE
        lead = -(-guard // _PAGE) * _PAGE if guard else 0
        self.map = mmap.mmap(-1, lead + step * num_tensors + _PAGE)
        self.raw = np.frombuffer(self.map, dtype=np.uint8)
        self.raw[:] = GUARD_BYTE if guard else 0
        starts = [lead + i * step for i in range(num_tensors)]
        self.tensors = [self.raw[s:s + tensor_bytes] for s in starts]
        self.guards = []
        if guard:
            edges = [0] + [s + tensor_bytes for s in starts]
            ends = starts + [len(self.raw)]
            self.guards = [self.raw[a:b] for a, b in zip(edges, ends, strict=False) if b > a]

    @property
    def addrs(self) -> list[int]:
        return [int(t.ctypes.data) for t in self.tensors]

    def fill(self, seed: int) -> None:
        for i, t in enumerate(self.tensors):
            t[:] = pattern(seed, i, 0, self.tensor_bytes)

    def fill_cheap(self, seed: int) -> None:
        """Non-zero bytes fast (one 1 MiB pattern repeated): for transfers that are cut
        on purpose and never verified."""
        chunk = 1 << 20
        for i, t in enumerate(self.tensors):
            if self.tensor_bytes % chunk:
                t[:] = pattern(seed, i, 0, self.tensor_bytes)
            else:
                t.reshape(-1, chunk)[:] = pattern(seed, i, 0, chunk)

    def guards_intact(self) -> bool:
        return all(bool((g == GUARD_BYTE).all()) for g in self.guards)

    def digest(self) -> str:
        h = hashlib.sha256()
        for t in self.tensors:
            h.update(t)
        return h.hexdigest()


class Peer:
    def __init__(self) -> None:
        self.dd: llm_datadist.LLMDataDist | None = None
        self.cluster_id = 0
        self.caches: dict[str, tuple[llm_datadist.Cache, Buffer, dict]] = {}

    # ------------------------------------------------------------------ lifecycle

    def op_init(self, role: str, cluster_id: int, listen: str = "", sync_ms: int = 1000,
                transport: str = "", remote_access: bool | None = None) -> dict:
        cfg = llm_datadist.LLMConfig()
        cfg.local_comm_res = ""  # cache-manager mode, remote cache accessible (HIXL flow)
        if remote_access is not None:
            cfg.enable_remote_cache_accessible = remote_access
        if listen:
            cfg.listen_ip_info = listen
        cfg.sync_kv_timeout = sync_ms
        if transport:
            cfg.transport = transport
        self.cluster_id = cluster_id
        self.dd = llm_datadist.LLMDataDist(getattr(llm_datadist.LLMRole, role), cluster_id)
        self.dd.init(cfg.generate_options())
        addr = self.dd.listen_address
        return {"port": addr[1] if addr else None, "pid": os.getpid()}

    def op_finalize(self) -> dict:
        assert self.dd is not None
        self.dd.finalize()
        return {}

    def op_register(self, name: str, num_tensors: int, blocks: int, block_bytes: int,
                    model_id: int = 0, seed: int | None = None, guard: int = 0,
                    shm: str | None = None, keys: int = 0, cheap: bool = False) -> dict:
        """A blocks cache under BlocksCacheKey(own id, model_id); with ``keys`` > 0, a
        contiguous cache instead whose slot i is bound to CacheKey(req_id=1000 + i)."""
        assert self.dd is not None
        buf = Buffer(num_tensors, blocks * block_bytes, guard, shm)
        if seed is not None:
            buf.fill_cheap(seed) if cheap else buf.fill(seed)
        desc = llm_datadist.CacheDesc(num_tensors, [blocks, block_bytes],
                                      llm_datadist.DataType.DT_UINT8,
                                      llm_datadist.Placement.HOST)
        cm = self.dd.cache_manager
        if keys:
            ck = [llm_datadist.CacheKey(self.cluster_id, 1000 + i, model_id)
                  for i in range(keys)]
            cache = cm.register_cache(desc, buf.addrs, ck)
        else:
            cache = cm.register_blocks_cache(
                desc, buf.addrs, llm_datadist.BlocksCacheKey(self.cluster_id, model_id))
        meta = {"seed": None if cheap else seed, "block_bytes": block_bytes, "blocks": blocks}
        self.caches[name] = (cache, buf, meta)
        return {"cache_id": cache.cache_id, "addrs": buf.addrs,
                "tensor_bytes": buf.tensor_bytes}

    def op_unregister(self, name: str) -> dict:
        assert self.dd is not None
        cache, _, _ = self.caches[name]
        t0 = time.monotonic()
        self.dd.cache_manager.unregister_cache(cache.cache_id)
        elapsed = time.monotonic() - t0
        del self.caches[name]  # only now may the memory go (as a user would free it)
        return {"elapsed": elapsed}

    def op_check(self, name: str) -> dict:
        """Guards untouched; with a seed, the tensors still hold the pattern."""
        _, buf, meta = self.caches[name]
        same = None
        if meta["seed"] is not None:
            same = all(np.array_equal(t, pattern(meta["seed"], i, 0, buf.tensor_bytes))
                       for i, t in enumerate(buf.tensors))
        return {"guards": buf.guards_intact(), "pattern": same, "digest": buf.digest()}

    # ------------------------------------------------------------------ links

    def _cluster(self, cid: int, ip: str, port: int) -> llm_datadist.LLMClusterInfo:
        c = llm_datadist.LLMClusterInfo()
        c.remote_cluster_id = cid
        c.append_local_ip_info(ip, 0)
        c.append_remote_ip_info(ip, port)
        return c

    def op_link(self, clusters: list, timeout_ms: int = 3000) -> dict:
        assert self.dd is not None
        t0 = time.monotonic()
        code, codes = self.dd.link_clusters([self._cluster(*c) for c in clusters], timeout_ms)
        return {"code": code.name, "codes": [c.name for c in codes],
                "elapsed": time.monotonic() - t0}

    def op_unlink(self, clusters: list, force: bool = False, timeout_ms: int = 3000) -> dict:
        assert self.dd is not None
        t0 = time.monotonic()
        code, codes = self.dd.unlink_clusters([self._cluster(*c) for c in clusters],
                                              timeout_ms, force=force)
        return {"code": code.name, "codes": [c.name for c in codes],
                "elapsed": time.monotonic() - t0}

    def op_path(self, cid: int) -> dict:
        assert self.dd is not None
        return {"path": self.dd.engine.get_link(cid).path_name}

    # ------------------------------------------------------------------ transfers

    def _pull_once(self, cid: int, model_id: int, dst: str, src_blocks: list[int],
                   dst_blocks: list[int]) -> None:
        assert self.dd is not None
        cache, _, _ = self.caches[dst]
        self.dd.cache_manager.pull_blocks(llm_datadist.BlocksCacheKey(cid, model_id), cache,
                                          src_blocks, dst_blocks)

    def _verify(self, dst: str, seed: int, src_blocks: list[int],
                dst_blocks: list[int]) -> bool:
        _, buf, meta = self.caches[dst]
        bb = meta["block_bytes"]
        for i, t in enumerate(buf.tensors):
            for s, d in zip(src_blocks, dst_blocks, strict=True):
                if not np.array_equal(t[d * bb:(d + 1) * bb], pattern(seed, i, s * bb, bb)):
                    return False
        return True

    def op_pull(self, cid: int, dst: str, src_blocks: list[int], dst_blocks: list[int],
                model_id: int = 0, seed: int | None = None, clear: bool = False) -> dict:
        """One pull_blocks. Reports how it ended and how long it took, never raises."""
        _, buf, _ = self.caches[dst]
        if clear:
            for t in buf.tensors:
                t[:] = 0
        t0 = time.monotonic()
        try:
            self._pull_once(cid, model_id, dst, src_blocks, dst_blocks)
        except llm_datadist.LLMException as e:
            return {"ok": False, "code": e.status_code.name, "msg": str(e),
                    "elapsed": time.monotonic() - t0}
        elapsed = time.monotonic() - t0
        verified = None if seed is None else self._verify(dst, seed, src_blocks, dst_blocks)
        return {"ok": True, "code": "LLM_SUCCESS", "elapsed": elapsed, "verified": verified}

    def op_verify(self, dst: str, seed: int, src_blocks: list[int],
                  dst_blocks: list[int]) -> dict:
        return {"verified": self._verify(dst, seed, src_blocks, dst_blocks)}

    def op_load(self, cid: int, dst: str, seed: int, pulls: int, src_total: int,
                per_pull: int, rng_seed: int, model_id: int = 0) -> dict:
        """``pulls`` pulls of ``per_pull`` random blocks, each verified byte for byte; the
        destination blocks are wiped before every pull so a pull that moved nothing shows."""
        _, buf, meta = self.caches[dst]
        rng = np.random.default_rng(rng_seed)
        dst_total = meta["blocks"]
        errors: list[str] = []
        bad = 0
        moved = 0
        t0 = time.monotonic()
        for _ in range(pulls):
            src = rng.choice(src_total, size=per_pull, replace=False).tolist()
            dstb = rng.choice(dst_total, size=per_pull, replace=False).tolist()
            bb = meta["block_bytes"]
            for t in buf.tensors:
                for d in dstb:
                    t[d * bb:(d + 1) * bb] = 0xEE
            try:
                self._pull_once(cid, model_id, dst, src, dstb)
            except llm_datadist.LLMException as e:
                errors.append(f"{e.status_code.name}: {e}")
                continue
            if not self._verify(dst, seed, src, dstb):
                bad += 1
            moved += per_pull * bb * len(buf.tensors)
        return {"errors": errors[:10], "nerrors": len(errors), "mismatches": bad,
                "bytes": moved, "elapsed": time.monotonic() - t0}


    MIN_CYCLES = 20

    def op_churn(self, cid: int, ip: str, port: int, dst: str, seed: int, seconds: float,
                 src_total: int, per_pull: int, force: bool = True, rng_seed: int = 0) -> dict:
        """Pull in a thread while this one unlinks and relinks the same cluster, again and
        again, for ``seconds``. Every pull that succeeds must carry the right bytes; the
        failures are counted by status code."""
        assert self.dd is not None
        _, buf, meta = self.caches[dst]
        bb = meta["block_bytes"]
        stop = threading.Event()
        outcomes: dict[str, int] = {}
        wrong: list[str] = []

        def puller() -> None:
            rng = np.random.default_rng(rng_seed)
            while not stop.is_set():
                src = rng.choice(src_total, size=per_pull, replace=False).tolist()
                dstb = rng.choice(meta["blocks"], size=per_pull, replace=False).tolist()
                for t in buf.tensors:
                    for d in dstb:
                        t[d * bb:(d + 1) * bb] = 0xEE
                try:
                    self._pull_once(cid, 0, dst, src, dstb)
                except llm_datadist.LLMException as e:
                    outcomes[e.status_code.name] = outcomes.get(e.status_code.name, 0) + 1
                    time.sleep(0.0005)  # as a client would: no hot spin holding the GIL
                    continue
                if self._verify(dst, seed, src, dstb):
                    outcomes["ok"] = outcomes.get("ok", 0) + 1
                else:
                    wrong.append(f"{src}->{dstb}")

        t = threading.Thread(target=puller, daemon=True)
        t.start()
        unlink_codes: dict[str, int] = {}
        link_codes: dict[str, int] = {}
        cycles = 0
        # ``seconds`` of churn, and at least MIN_CYCLES link/unlink cycles where a loaded
        # machine makes them slow (bounded: four times ``seconds`` at most)
        start = time.monotonic()
        end, hard_end = start + seconds, start + 4 * seconds
        try:
            while ((time.monotonic() < end or cycles < self.MIN_CYCLES)
                   and time.monotonic() < hard_end):
                r = self.op_unlink([[cid, ip, port]], force=force, timeout_ms=200)
                unlink_codes[r["code"]] = unlink_codes.get(r["code"], 0) + 1
                r = self.op_link([[cid, ip, port]], timeout_ms=2000)
                link_codes[r["code"]] = link_codes.get(r["code"], 0) + 1
                cycles += 1
                time.sleep(0.002 * (cycles % 5))
        finally:
            stop.set()
            t.join(30)
        return {"cycles": cycles, "outcomes": outcomes, "wrong": wrong[:5],
                "nwrong": len(wrong), "unlink": unlink_codes, "link": link_codes,
                "puller_alive": t.is_alive()}


def main() -> None:
    peer = Peer()
    out = sys.stdout
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        req = json.loads(line)
        op = req.pop("op")
        if op == "quit":
            break
        try:
            reply = getattr(peer, f"op_{op}")(**req)
        except llm_datadist.LLMException as e:
            reply = {"error": e.status_code.name, "msg": str(e)}
        except Exception:  # forwarded to the parent, which fails the test with it
            reply = {"exception": traceback.format_exc()}
        out.write("@@" + json.dumps(reply) + "\n")
        out.flush()
    if peer.dd is not None:
        peer.dd.finalize()


if __name__ == "__main__":
    main()
