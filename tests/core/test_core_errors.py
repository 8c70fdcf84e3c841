"""The binding raises datadist's own error classes (issue 36, item 3): one code-to-class table
in cpp/python/module.cc (``PyError``), no CoreError for Python to translate, and a checksum
mismatch told by its kind (ErrorKind::kChecksumMismatch), not by its message's first words.

Before (50b45c0): every core error came out as ``_core.CoreError(code, message)``, mapped by
core/native.py, which recognised a checksum mismatch by the prefix "checksum mismatch"; the
first three tests fail there (CoreError, not the class). The mismatch itself, end to end, is
tests/security/test_integrity*.py's (IntegrityError, for blocking and issued pulls)."""

from __future__ import annotations

import pytest

from datadist.core import errors, native
from datadist.core.config import EngineConfig

core = native.core_module()
pytestmark = pytest.mark.skipif(core is None, reason="the native core is not built")


def test_no_core_error_class_is_left() -> None:
    assert not hasattr(core, "CoreError")


def test_a_bad_option_is_invalid_argument() -> None:
    with pytest.raises(errors.InvalidArgument) as e:
        core.check_option("datadist.MaxConnections", "0")
    assert type(e.value) is errors.InvalidArgument
    assert e.value.code is errors.Code.PARAM_INVALID
    assert str(e.value) == "datadist.MaxConnections must be an integer in [1, 65535], got '0'"


def test_engine_errors_by_code() -> None:
    engine = native.NativeEngine(EngineConfig(cluster_id=1, role=2, transport="tcp"))
    try:
        with pytest.raises(errors.NotLinked) as e:
            engine._core.ping(99, 0.1)
        assert e.value.code is errors.Code.NOT_YET_LINK and "99" in str(e.value)
        with pytest.raises(errors.LinkFailed):  # nobody listens there
            engine._core.connect(5, "127.0.0.1", 1, 0.5, take_peer_id=False)
        with pytest.raises(errors.AlreadyLinked):
            owner = native.NativeEngine(EngineConfig(cluster_id=5, role=1, transport="tcp",
                                                     listen=("127.0.0.1", 0)))
            try:
                host, port = owner.listen_address
                engine._core.connect(5, host, port, 5.0, take_peer_id=False)
                engine._core.connect(5, host, port, 5.0, take_peer_id=False)
            finally:
                owner.close()
    finally:
        engine.close()


def test_unlink_of_an_unknown_cluster_is_not_linked() -> None:
    engine = native.NativeEngine(EngineConfig(cluster_id=1, role=2, transport="tcp"))
    try:
        with pytest.raises(errors.NotLinked):
            engine._core.unlink(42, 0.1, force=True, quiet_inbound=False)
    finally:
        engine.close()
