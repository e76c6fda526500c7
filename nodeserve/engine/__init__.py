"""nodeserve.engine."""
