"""bench/decode_host.py on CPU: the same measurement path a GPU run takes, eager only (graphs need CUDA)."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def decode_host(load_bench):
    return load_bench("decode_host")


def test_cpu_eager_rows(decode_host, tmp_path):
    out = tmp_path / "rows.json"
    rows = decode_host.main(["--device", "cpu", "--dtype", "fp32", "--batch", "1,3", "--context", "20",
                             "--steps", "3", "--warmup", "1", "--json", str(out)])
    assert [(r["mode"], r["batch"]) for r in rows] == [("eager", 1), ("eager", 3)]
    for r in rows:
        assert 0 < r["host_ms"] <= r["step_ms"] and r["backend"] == "TorchAttention" and not r["graphs_replayed"]
    assert json.loads(out.read_text())["rows"] == rows


def test_graphs_on_cpu_is_refused(decode_host):
    with pytest.raises(SystemExit, match="needs CUDA and FlashInfer"):
        decode_host.main(["--device", "cpu", "--dtype", "fp32", "--batch", "1", "--context", "4", "--steps", "1",
                          "--modes", "graphs"])
