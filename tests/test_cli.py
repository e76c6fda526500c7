"""The command line: settings layered file -> NODESERVE_* environment -> flags, --version, check-config's model check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nodeserve import __version__
from nodeserve.cli import _load_config, build_parser
from nodeserve.config import ConfigError, env_overrides, load_config

REPO = Path(__file__).resolve().parents[1]


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "nodeserve.toml"
    path.write_text(text)
    return str(path)


def test_environment_overrides_the_file_and_flags_override_both(tmp_path):
    path = _write(tmp_path, '[server]\nport = 8000\nhost = "127.0.0.1"\n[kv]\nmemory_gib = 1.0\n')
    env = {"NODESERVE_SERVER_PORT": "9001", "NODESERVE_KV_MEMORY_GIB": "0.5", "NODESERVE_API_KEY": "secret",
           "NODESERVE_DEVICES_DECODE": '["cpu:1"]', "NODESERVE_MODEL_PATH": "/models/x.gguf", "OTHER": "1"}
    cfg = load_config(path, check_devices=False, environ=env, overrides={"server": {"host": "0.0.0.0"}})
    assert (cfg.server.port, cfg.server.host, cfg.kv.memory_gib) == (9001, "0.0.0.0", 0.5)
    assert cfg.devices.decode == ("cpu:1",) and cfg.model.path == "/models/x.gguf"  # arrays and plain strings
    cfg = load_config(path, check_devices=False, environ=env, overrides={"server": {"port": 7000}})
    assert cfg.server.port == 7000


def test_a_mistyped_variable_is_an_error_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="NODESERVE_SERVER_PROT.*'server.prot'"):
        env_overrides({"NODESERVE_SERVER_PROT": "9"})
    path = _write(tmp_path, "")
    with pytest.raises(ConfigError, match="'server.port' must be an integer"):
        load_config(path, check_devices=False, environ={"NODESERVE_SERVER_PORT": "eighty"})


def test_run_flags_reach_the_config(tmp_path, monkeypatch):
    monkeypatch.setenv("NODESERVE_SERVER_PORT", "9100")
    path = _write(tmp_path, '[devices]\nprefill = ["cpu:0"]\ndecode = ["cpu:1"]\n')
    args = build_parser().parse_args(["run", "--config", path, "--host", "::1", "--model", "other.gguf"])
    monkeypatch.setattr("nodeserve.config.validate", lambda cfg, check_devices=True: None)
    cfg = _load_config(path, "", args)
    assert (cfg.server.host, cfg.server.port, cfg.model.path) == ("::1", 9100, "other.gguf")
    args = build_parser().parse_args(["run", "--config", path, "--port", "9200"])
    assert _load_config(path, "", args).server.port == 9200


def test_version():
    proc = subprocess.run([sys.executable, "-m", "nodeserve", "--version"], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.strip() == f"nodeserve {__version__}"


def test_check_config_checks_the_model_path(tmp_path):
    path = _write(tmp_path, '[model]\npath = "missing.gguf"\n[devices]\nprefill = ["cpu:0"]\ndecode = ["cpu:1"]\n')
    proc = subprocess.run([sys.executable, "-m", "nodeserve", "check-config", path], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2 and "'model.path'" in proc.stderr and "missing.gguf" in proc.stderr
    assert "Traceback" not in proc.stderr
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    model.chmod(0)
    if os.access(model, os.R_OK):  # root reads anything: nothing to check here
        return
    path = _write(tmp_path, f'[model]\npath = "{model}"\n[devices]\nprefill = ["cpu:0"]\ndecode = ["cpu:1"]\n')
    proc = subprocess.run([sys.executable, "-m", "nodeserve", "check-config", path], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2 and "not readable" in proc.stderr
