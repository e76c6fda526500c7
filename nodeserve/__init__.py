"""nodeserve: a single-node LLM server with disaggregated prefill and decode in one process."""

__version__ = "0.1.0"
