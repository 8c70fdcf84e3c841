"""The Python side of the engine: cache geometry and plans, how caches and keys are named,
local copies, and the binding's wrapper (:mod:`datadist.core.native`) that hands links, pulls and
pushes to the core, cpp/src (docs/engine.md). No CANN-isms here (those are ``datadist.api``'s)."""
