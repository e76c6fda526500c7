"""nodeserve.device."""
