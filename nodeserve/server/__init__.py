"""nodeserve.server."""
