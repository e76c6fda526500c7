"""The bench/ scripts are not a package: tests load them by path."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

_BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")


@pytest.fixture(scope="session")
def load_bench():
    """load_bench("soak") -> bench/soak.py as a module (registered in sys.modules: dataclasses look it up there)."""
    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"nodeserve_bench_{name}", os.path.join(_BENCH, f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod
    return load
