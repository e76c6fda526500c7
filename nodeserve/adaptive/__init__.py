"""Adaptive serving: a measured cost model, per-request placement and SLO admission, and `nodeserve plan`."""
