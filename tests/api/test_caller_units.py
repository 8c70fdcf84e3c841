"""Errors in the caller's units (issue 25, item 5): a source block out of range is named in
blocks, a block size mismatch in elements of the caller's data type, a data type mismatch by
the DataTypes' names; a PROMPT that registers caches but listens nowhere hears it once."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import datadist as llm
from datadist.api.cache_manager import geometry_of
from datadist.api.enums import DataType, Placement
from datadist.api.types import CacheDesc
from datadist.core.config import EngineConfig
from datadist.core.dtypes import DTYPES, dtype_name, in_elements
from datadist.core.errors import InvalidArgument
from datadist.core.layout import every_tensor, layout_tag, plan_blocks
from datadist.core.native import NativeEngine
from datadist.wire import protocol as p

pytestmark = pytest.mark.timeout(30)


def test_the_core_dtype_table_is_the_apis() -> None:
    assert {code: name for code, (name, _) in DTYPES.items()} == {
        dt.value: dt.name for dt in DataType}
    assert {code: size for code, (_, size) in DTYPES.items()} == {
        dt.value: dt.itemsize for dt in DataType}
    assert dtype_name(27) == "DT_BF16" and dtype_name(99) == "data type code 99"
    assert in_elements(8192, layout_tag(1, (16, 256))) == "4096 DT_FLOAT16 elements (8192 bytes)"
    assert in_elements(8192, 0) == "8192 bytes"


def _pair(transport: str):
    owner = NativeEngine(EngineConfig(cluster_id=1, role=1, listen=("127.0.0.1", 0)))
    puller = NativeEngine(EngineConfig(cluster_id=2, role=2, transport=transport))
    puller.link(1, *owner.listen_address, 2.0)
    return owner, puller


def _register(eng: NativeEngine, desc: CacheDesc, arrays: list[np.ndarray], **kw):
    return eng.register(geometry_of(desc, blocks=True), [a.ctypes.data for a in arrays],
                        placement=0, **kw)


@pytest.mark.parametrize("transport", ["tcp", "cma"])
def test_a_source_block_out_of_range_is_named_in_blocks(transport: str) -> None:
    owner, puller = _pair(transport)
    try:
        desc = CacheDesc(2, [8, 16, 4], DataType.DT_FLOAT16, Placement.HOST)
        src = [np.ones((8, 16, 4), np.float16) for _ in range(2)]
        big = [np.zeros((64, 16, 4), np.float16) for _ in range(2)]
        entry = _register(owner, desc, src, blocks_model_id=0)
        local = _register(puller, CacheDesc(2, [64, 16, 4], DataType.DT_FLOAT16,
                                            Placement.HOST), big)
        plan = plan_blocks(local.geometry, [1, 30], [3, 4],
                           every_tensor(2))
        with pytest.raises(InvalidArgument,
                           match=f"src block 30 out of range: cache {entry.cache_id} has 8 "
                                 "blocks"):
            puller.pull(1, p.KeyRef(p.KeyKind.BLOCKS_KEY, 0, 0), local.geometry.unit_bytes,
                        plan, local.cache_id, 2.0)
        assert not any(b.any() for b in big)
    finally:
        puller.close()
        owner.close()


def test_a_block_size_mismatch_is_in_elements() -> None:
    owner, puller = _pair("tcp")
    try:
        src = [np.ones((8, 16, 4), np.float16) for _ in range(2)]
        dst = [np.zeros((8, 16, 8), np.float16) for _ in range(2)]
        _register(owner, CacheDesc(2, [8, 16, 4], DataType.DT_FLOAT16, Placement.HOST), src,
                  blocks_model_id=0)
        local = _register(puller, CacheDesc(2, [8, 16, 8], DataType.DT_FLOAT16,
                                            Placement.HOST), dst)
        plan = plan_blocks(local.geometry, [1], [3], every_tensor(2))
        with pytest.raises(InvalidArgument, match=r"the requester's blocks hold 128 DT_FLOAT16 "
                           r"elements \(256 bytes\), cache \d+'s 64 DT_FLOAT16 elements"):
            puller.pull(1, p.KeyRef(p.KeyKind.BLOCKS_KEY, 0, 0), local.geometry.unit_bytes,
                        plan, local.cache_id, 2.0)
    finally:
        puller.close()
        owner.close()


def test_a_local_block_size_mismatch_is_in_elements() -> None:
    # the core's copy planner (PlanBlockCopy), the one both faces' local copies use
    eng = NativeEngine(EngineConfig(cluster_id=3, role=1))
    try:
        mem = [np.zeros((4, 8), np.float32)], [np.zeros((4, 4), np.float32)]
        a = _register(eng, CacheDesc(1, [4, 8], DataType.DT_FLOAT, Placement.HOST), mem[0])
        b = _register(eng, CacheDesc(1, [4, 4], DataType.DT_FLOAT, Placement.HOST), mem[1])
        one = np.array([0], np.uint64)
        with pytest.raises(InvalidArgument, match=r"the source's blocks hold 8 DT_FLOAT elements "
                           r"\(32 bytes\), the destination's 4 DT_FLOAT elements \(16 bytes\)"):
            eng.copy_blocks(a.cache_id, b.cache_id, one, one)
    finally:
        eng.close()


def test_a_dtype_mismatch_names_the_datatypes() -> None:
    owner, puller = _pair("tcp")
    try:
        src = [np.ones((8, 16, 4), np.float16) for _ in range(2)]
        dst = [np.zeros((8, 16, 4), np.float16) for _ in range(2)]
        _register(owner, CacheDesc(2, [8, 16, 4], DataType.DT_BF16, Placement.HOST), src,
                  blocks_model_id=0)
        local = _register(puller, CacheDesc(2, [8, 16, 4], DataType.DT_FLOAT16,
                                            Placement.HOST), dst)
        plan = plan_blocks(local.geometry, [1], [3], every_tensor(2))
        with pytest.raises(InvalidArgument, match="holds DT_BF16, the requester's cache "
                                                  "DT_FLOAT16"):
            puller.pull(1, p.KeyRef(p.KeyKind.BLOCKS_KEY, 0, 0), local.geometry.unit_bytes,
                        plan, local.cache_id, 2.0)
    finally:
        puller.close()
        owner.close()


def _prompt(listen: bool, local_comm_res: str | None = None) -> llm.LLMDataDist:
    d = llm.LLMDataDist(llm.LLMRole.PROMPT, 1)
    cfg = llm.LLMConfig()
    cfg.enable_cache_manager = True
    if listen:
        cfg.listen_ip_info = "127.0.0.1:0"
    if local_comm_res is not None:
        cfg.local_comm_res = local_comm_res
    d.init(cfg.generate_options())
    return d


def _register_twice(d: llm.LLMDataDist) -> list[warnings.WarningMessage]:
    arrays = [np.zeros((4, 8), np.float16) for _ in range(2)]
    desc = llm.CacheDesc(1, [4, 8], llm.DataType.DT_FLOAT16, llm.Placement.HOST)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        d.cache_manager.register_cache(desc, [arrays[0].ctypes.data])
        d.cache_manager.register_blocks_cache(desc, [arrays[1].ctypes.data])
    return [w for w in seen if issubclass(w.category, llm.DatadistWarning)]


def test_a_prompt_that_listens_nowhere_is_told_once() -> None:
    d = _prompt(listen=False)
    try:
        told = _register_twice(d)
        assert len(told) == 1 and told[0].category is llm.NotListeningWarning
        assert "listen_ip_info" in str(told[0].message)
    finally:
        d.finalize()
    d = _prompt(listen=True)
    try:
        assert _register_twice(d) == []
    finally:
        d.finalize()


def test_only_a_rank_table_for_two_sided_links_silences_it() -> None:
    """A LocalCommRes rank table: two-sided links listen on its ports later (no warning); an
    empty one is the one-sided flow of examples/two_hosts (warned like any PROMPT)."""
    d = _prompt(listen=False, local_comm_res='{"server_count": "1"}')
    try:
        assert _register_twice(d) == []
    finally:
        d.finalize()
    d = _prompt(listen=False, local_comm_res="")
    try:
        assert len(_register_twice(d)) == 1
    finally:
        d.finalize()
