"""What the Python facade tells a caller who got something wrong (issue 38, items 7, 9, 10).

- item 10: a ``LinkFailedWarning`` names the application's line (the call of
  ``link_clusters``), not datadist's own frame or a link worker's.
- item 7: a call after ``finalize()`` says the instance was finalized and what to do, with
  the status code LLM_ENGINE_FINALIZED (hicann/hixl src/python/llm_datadist/llm_datadist/
  status.py names it; the original's ``_check_is_inited`` raises a RuntimeError, which
  LLMException is).
- item 9: ``check_link_status`` in cache-manager mode keeps the original's text and then
  names what selected that mode and what to use instead.
"""

from __future__ import annotations

import inspect
import warnings

import pytest

import datadist as llm

from ._support import free_port, loopback_info

pytestmark = pytest.mark.timeout(60)

S = llm.LLMStatusCode


_free_port, _info = free_port, loopback_info


def _datadist(**options: object) -> llm.LLMDataDist:
    cfg = llm.LLMConfig()
    for name, value in options.items():
        setattr(cfg, name, value)
    d = llm.LLMDataDist(llm.LLMRole.DECODER, 2)
    d.init(cfg.generate_options())
    return d


@pytest.fixture
def decoder():
    d = _datadist(enable_cache_manager=True)
    yield d
    d.finalize()


@pytest.mark.parametrize("n", [1, 2])  # one cluster links inline, two in worker threads
def test_a_link_failure_warning_names_the_callers_line(decoder, n: int) -> None:
    clusters = [_info(10 + i, _free_port()) for i in range(n)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        code, _ = decoder.link_clusters(clusters, 1000)
    assert code == S.LLM_LINK_FAILED
    failed = [w for w in caught if issubclass(w.category, llm.LinkFailedWarning)]
    assert len(failed) == n
    for w in failed:
        assert (w.filename, w.lineno) == (__file__, line), (w.filename, w.lineno)


def test_calls_after_finalize_say_finalized_and_what_to_do() -> None:
    d = _datadist(enable_cache_manager=True)
    d.finalize()
    for call in (lambda: d.link_clusters([_info(1, 1)], 1000), lambda: d.cache_manager,
                 lambda: d.engine):
        with pytest.raises(llm.LLMException) as e:
            call()
        assert isinstance(e.value, RuntimeError)  # as the original's RuntimeError
        assert e.value.status_code is S.LLM_ENGINE_FINALIZED
        assert "finalized" in str(e.value) and "init" in str(e.value)
    d.init(llm.LLMConfig().generate_options() | {"llm.EnableCacheManager": "1"})
    try:
        assert d.cache_manager is not None  # init again: usable again
    finally:
        d.finalize()


def test_before_init_is_still_the_originals_not_initialized() -> None:
    d = llm.LLMDataDist(llm.LLMRole.DECODER, 2)
    with pytest.raises(RuntimeError, match="^llm datadist is not initialized$") as e:
        d.link_clusters([_info(1, 1)], 1000)
    assert not isinstance(e.value, llm.LLMException)


@pytest.mark.parametrize("options, selector", [
    ({"enable_cache_manager": True}, "llm.EnableCacheManager = 1"),
    ({"local_comm_res": ""}, "llm.LocalCommRes (LLMConfig.local_comm_res) is set"),
])
def test_check_link_status_refusal_names_the_mode_and_what_to_use(options, selector) -> None:
    d = _datadist(**options)
    try:
        with pytest.raises(llm.LLMException) as e:
            d.check_link_status(1)
    finally:
        d.finalize()
    text = str(e.value)
    assert e.value.status_code is S.LLM_PARAM_INVALID
    assert text.startswith("check_link_status is not supported when llm.EnableCacheManager "
                           "is configured.")  # the original's text first
    assert f"cache-manager mode ({selector}" in text
    assert "link_clusters' return codes" in text and "last_link_failure" in text
