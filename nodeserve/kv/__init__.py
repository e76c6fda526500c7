"""nodeserve.kv."""
