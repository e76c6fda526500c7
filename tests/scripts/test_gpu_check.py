"""scripts/gpu_check.sh on CPU, with a stand-in python that records each call: every step runs even after one
fails, the exit status and summary report the failures, a missing nvcc is one of them, the CUDA tests get a
per-test timeout long enough for a cold JIT, and nothing is written into the repository."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _repo_files() -> str:
    status = subprocess.run(["git", "status", "--porcelain", "--ignored"], cwd=REPO, capture_output=True,
                            text=True).stdout
    return "\n".join(line for line in status.splitlines() if "__pycache__" not in line)


def test_every_step_runs_and_failures_are_summarised(tmp_path):
    calls = tmp_path / "calls.txt"
    stand_in = tmp_path / "python"
    # Fails the environment check (as on a host where torch sees no GPU) and the decode-host bench.
    stand_in.write_text(f"""#!/bin/sh
echo "$*" >> {calls}
case "$*" in
  *is_available*) echo "AssertionError: torch sees no GPU"; exit 1 ;;
  *decode_host*) exit 3 ;;
esac
exit 0
""")
    stand_in.chmod(0o755)
    before = _repo_files()
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": str(stand_in), "PATH": "/usr/bin:/bin"}  # no nvcc on this PATH
    env.pop("CUDA_HOME", None)
    r = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(out)], env=env, capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    ran = calls.read_text().splitlines()
    assert any("pytest tests/cuda" in c and "--timeout 3600" in c for c in ran), ran
    assert any("nodeserve devices" in c for c in ran) and any("handoff_bench.py" in c for c in ran)
    assert any("decode_host.py" in c and str(out / "decode_host.json") in c for c in ran), ran
    summary = r.stdout[r.stdout.index("== summary"):]
    assert "FAILED: environment (exit 1" in summary and "FAILED: decode-host (exit 3" in summary
    assert "FAILED: nvcc (not found)" in summary and "tests-cuda" not in summary
    assert {p.name for p in out.iterdir()} >= {"environment.log", "tests-cuda.log", "decode-host.log"}
    assert _repo_files() == before  # nothing new in the repository
