"""nodeserve.model."""
