"""The benchmark's workloads live in nodeserve/workloads.py, where `nodeserve plan` simulates the same ones; this
re-export keeps `import workloads` working for the bench scripts and their tests."""

from nodeserve.workloads import *  # noqa: F401,F403
