"""Where benchmarks write, and how they read what bench/results keeps.

By default a run writes outside the repository, under $NODESERVE_BENCH_DIR (else ~/.cache/nodeserve/bench): a
clone carries only the runs the docs cite (bench/README.md, "What bench/results keeps"). To keep a run, pass its
--out / --out-dir under bench/results/ and make it compact (gzip_large below)."""

from __future__ import annotations

import gzip
import json
import os

MAX_KEPT_BYTES = 1 << 20  # a file under bench/results larger than this is kept gzipped (tests/bench/test_kept.py)


def out_path(*parts: str) -> str:
    """A default output path: $NODESERVE_BENCH_DIR/<parts>, else ~/.cache/nodeserve/bench/<parts>."""
    root = os.environ.get("NODESERVE_BENCH_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nodeserve",
                                                                 "bench")
    return os.path.join(root, *parts)


def load_json(path: str):
    """A JSON file, or its gzipped copy (path + ".gz") where bench/results keeps it compressed."""
    if not os.path.exists(path) and os.path.exists(path + ".gz"):
        path += ".gz"
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return json.load(f)
