"""The policy core: requests, scheduling, placement, roles and admission. Pure: no threads, no torch."""
