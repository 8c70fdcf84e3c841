"""Fixtures of the core's tests: the two in-process engines of the API tests (api/conftest.py),
for the tests here that drive ``NativeEngine`` directly."""

from api.conftest import make_side, pair  # noqa: F401 - fixtures, found by name

