"""Under CI=true a test that skips for a missing dependency fails; a GPU-only skip stays a skip."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def test_ci_turns_dependency_skips_into_failures(tmp_path):
    conftest = os.path.join(os.path.dirname(__file__), "conftest.py")
    (tmp_path / "conftest.py").write_text(open(conftest).read())
    (tmp_path / "test_x.py").write_text(textwrap.dedent('''
        import pytest

        def test_dep():
            pytest.importorskip("no_such_module_anywhere")

        @pytest.mark.skipif(True, reason="needs a CUDA GPU")
        def test_gpu():
            pass
    '''))
    run = lambda ci: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", str(tmp_path)],
        capture_output=True, text=True, env={**os.environ, "CI": ci}, cwd=tmp_path).stdout
    assert "2 skipped" in run("")
    strict = run("true")
    assert "1 failed" in strict and "1 skipped" in strict and "no_such_module_anywhere" in strict
