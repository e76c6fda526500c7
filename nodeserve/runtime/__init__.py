"""The runtime that applies the core's decisions: the router, per-device workers, KV transfers, the engine."""
