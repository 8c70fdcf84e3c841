"""The LLM-DataDist facade: CANN names, argument parsing and error semantics over the core."""
