"""Peers for tests, shipped in the wheel on purpose.

A project that serves with datadist tests its own PROMPT and DECODER code against real peer
processes and against peers that break on purpose; these are the ones datadist's own tests use:

- :mod:`datadist.testing.procs`: run a function in a fresh interpreter and talk to it;
- :mod:`datadist.testing.peers`: a PROMPT process driven over a pipe, public API only;
- :mod:`datadist.testing.fakes`: a fake owner that speaks the wire protocol just well enough to
  fail mid-transfer;
- :mod:`datadist.testing.engine`: the core's test hooks on a native engine (NIXL's agent, its
  registrations and leases), bound apart from the production ``Engine`` (``_core.testing``).

Nothing here is imported by ``import datadist``; the API of these modules may change between
minor versions.
"""
