"""nodeserve.attention."""
