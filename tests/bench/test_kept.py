"""What bench/results keeps (bench/README.md): every path the README and the docs cite is there, and no file is over
bench/outputs.py's MAX_KEPT_BYTES (raw samples and logs are kept gzipped)."""

from __future__ import annotations

import gzip
import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _cited() -> set[str]:
    return {m.rstrip(".,;:)`'") for doc in DOCS for m in re.findall(r"bench/results/[A-Za-z0-9_./*-]+", doc.read_text())}


def test_every_cited_result_is_kept():
    missing = sorted(p for p in _cited() if "*" not in p and not (ROOT / p).exists()
                     and not (ROOT / (p + ".gz")).exists())
    assert missing == []


def test_no_kept_file_is_over_the_cap(load_bench):
    cap = load_bench("outputs").MAX_KEPT_BYTES
    big = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "bench" / "results").rglob("*")
                 if p.is_file() and p.stat().st_size > cap)
    assert big == []


def test_a_gzipped_result_reads_as_its_json(load_bench, tmp_path):
    data = {"targets": {"nodeserve": [1, 2, 3]}}
    with gzip.open(tmp_path / "results.json.gz", "wt") as f:
        json.dump(data, f)
    outputs = load_bench("outputs")
    assert outputs.load_json(str(tmp_path / "results.json")) == data == outputs.load_json(str(tmp_path / "results.json.gz"))


def test_benchmarks_write_outside_the_repository_by_default(load_bench, monkeypatch, tmp_path):
    outputs = load_bench("outputs")
    monkeypatch.setenv("NODESERVE_BENCH_DIR", str(tmp_path))
    assert outputs.out_path("compare", "results.json") == str(tmp_path / "compare" / "results.json")
    monkeypatch.delenv("NODESERVE_BENCH_DIR")
    assert not outputs.out_path("compare").startswith(str(ROOT))
