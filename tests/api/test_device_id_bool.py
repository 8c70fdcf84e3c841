"""``LLMConfig.device_id = True`` as the original's setter takes it (issue 38, item 15).

hicann/hixl src/python/llm_datadist/llm_datadist/configs.py, ``device_id.setter``:
``check_isinstance("device_id", device_id, [list, tuple, int])`` (utils.py: plain
``isinstance``, so a bool is an int), ``device_id >= 0``, ``check_int32``; then
``generate_options`` writes ``str(self.device_id)``: "True".
"""

from __future__ import annotations

import pytest

import datadist as llm


@pytest.mark.parametrize("value, option", [(True, "True"), (False, "False"),
                                           ([0, True], "0;True"), ((True,), "True")])
def test_a_bool_device_id_is_accepted_and_written_as_the_original_writes_it(value, option):
    c = llm.LLMConfig()
    c.device_id = value
    assert c.device_id == value
    options = c.generate_options()
    assert options["ge.exec.deviceId"] == option
    assert options["ge.session_device_id"] == option.split(";")[0]


@pytest.mark.parametrize("value, error", [("0", TypeError), (1.0, TypeError), ([0, "1"], TypeError),
                                          (-1, llm.LLMException), (2**31, ValueError)])
def test_other_device_ids_are_still_refused(value, error):
    with pytest.raises(error):
        llm.LLMConfig().device_id = value
