"""scripts/gpu_tp_check.py on CPU devices (--cpu), so the script a lent GPU machine runs is known to work before it
gets there; and scripts/gpu_check.sh runs it as its `tp` step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~25 s: a tokenizer trained, transformers' reference, groups of 1 and 2, an Engine run
def test_cpu_run_passes_every_check():
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_tp_check.py"), "--cpu"], capture_output=True,
                       text=True, timeout=600, cwd=REPO, env={k: v for k, v in os.environ.items() if k != "DEVICES"})
    out = r.stdout
    assert r.returncode == 0, out + r.stderr[-3000:]
    passed = [line for line in out.splitlines() if line.startswith("PASS")]
    for name in ("all-reduce cpu:0+cpu:1", "group cpu:0 float32 = transformers", "group cpu:0+cpu:1 float32 = "
                 "transformers", "group cpu:0+cpu:1 logits within", "engine colocated cpu:0+cpu:1 float32"):
        assert any(name in line for line in passed), (name, out)
    assert "FAIL" not in out and out.rstrip().endswith("ALL PASS")
    assert "SKIP  engine, disaggregated" in out  # two devices: it says what did not run


def test_gpu_check_runs_it_as_the_tp_step(tmp_path):
    calls = tmp_path / "calls.txt"
    stand_in = tmp_path / "python"
    stand_in.write_text(f'#!/bin/sh\necho "$*" >> {calls}\necho ran\nexit 0\n')
    stand_in.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": str(stand_in), "PATH": "/usr/bin:/bin"}
    subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(out)], env=env, capture_output=True,
                   text=True, timeout=120, cwd=tmp_path)
    assert any(c.strip() == "scripts/gpu_tp_check.py" for c in calls.read_text().splitlines())
    assert (out / "tp.log").read_text() == "ran\n"
