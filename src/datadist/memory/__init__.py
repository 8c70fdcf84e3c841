"""Memory that datadist allocates, and adapters for the memory users bring."""
