"""The typed engine: geometry, registry, links, transfers. No CANN-isms, no sockets."""
