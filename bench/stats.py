"""The benchmark's statistics (percentiles, SLO attainment, goodput search, derived SLOs) live in
nodeserve/goodput.py, where `nodeserve plan` scores its simulations the same way; this re-export keeps
`import stats` working for the bench scripts and their tests."""

from nodeserve.goodput import *  # noqa: F401,F403
