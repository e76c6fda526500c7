"""The CUDA-path config keys (devices.attention, devices.cuda_graphs, kv.dtype, kv.memory_gib = 0,
kv.memory_headroom), the example DGX config, KV sizing from free GPU memory, and `nodeserve devices`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import nodeserve.device
from nodeserve.config import ConfigError, config_from_dict, load_config
from nodeserve.kv.pool import KVPool, kv_cache_dtype, kv_pages_for_device

REPO = Path(__file__).resolve().parent.parent
GPUS = {"mode": "disaggregated", "prefill": ["cuda:0"], "decode": ["cuda:1"]}


def _error(raw: dict) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw, check_devices=False)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_defaults():
    cfg = config_from_dict({}, check_devices=False)
    assert cfg.devices.attention == "auto" and cfg.devices.cuda_graphs is True
    assert cfg.kv.dtype == "auto" and cfg.kv.memory_headroom == 0.1


def test_cuda_options_load_for_gpu_devices():
    cfg = config_from_dict({"devices": {**GPUS, "attention": "flashinfer", "cuda_graphs": False},
                            "kv": {"dtype": "fp8_e4m3", "memory_gib": 0, "memory_headroom": 0.2}},
                           check_devices=False)
    assert cfg.devices.attention == "flashinfer" and cfg.devices.cuda_graphs is False
    assert cfg.kv.dtype == "fp8_e4m3" and cfg.kv.memory_gib == 0 and cfg.kv.memory_headroom == 0.2


@pytest.mark.parametrize("raw, words", [
    ({"devices": {"attention": "flashinfer"}}, ["'devices.attention'", "CUDA", "cpu:0"]),
    ({"kv": {"memory_gib": 0}}, ["'kv.memory_gib'", "CUDA", "GiB"]),
    ({"kv": {"memory_gib": -1}}, ["'kv.memory_gib'"]),
    ({"devices": {**GPUS, "attention": "triton"}}, ["'devices.attention'", "flashinfer"]),
    ({"kv": {"dtype": "int8"}}, ["'kv.dtype'", "fp8_e4m3"]),
    ({"kv": {"memory_headroom": 1.0}}, ["'kv.memory_headroom'"]),
    ({"kv": {"memory_headroom": -0.1}}, ["'kv.memory_headroom'"]),
    ({"devices": {"cuda_graphs": "yes"}}, ["'devices.cuda_graphs'"]),
    # FlashInfer has no float32 kernels: refused before anything loads, naming both ways out.
    ({"model": {"dtype": "float32"}, "devices": {**GPUS, "attention": "flashinfer"}},
     ["'devices.attention'", "float32", "model.dtype = \"bfloat16\"", "devices.attention = \"torch\""]),
])
def test_errors_name_the_key(raw, words):
    message = _error(raw)
    for word in words:
        assert word in message, message


@pytest.mark.parametrize("devices", [{}, {**GPUS, "attention": "torch"}, {"mode": "colocated", "devices": ["cpu:0"]}])
def test_fp8_kv_on_any_device_and_backend(devices):
    """The torch backend reads FP8 pools too, so FP8 KV is allowed on CPU devices and with attention = torch."""
    assert config_from_dict({"devices": devices, "kv": {"dtype": "fp8_e4m3"}}, check_devices=False).kv.dtype == \
        "fp8_e4m3"


def test_colocated_mix_of_cpu_and_gpu_rejects_cuda_only_options():
    assert "cpu:1" in _error({"devices": {"mode": "colocated", "devices": ["cuda:0", "cpu:1"],
                                          "attention": "flashinfer"}})


def test_example_dgx_config_loads(monkeypatch):
    """Full validation, device check included, on a pretend 8-GPU machine."""
    monkeypatch.setattr(nodeserve.device, "available_devices",
                        lambda: ["cpu:0", "cpu:1"] + [f"cuda:{i}" for i in range(8)])
    cfg = load_config(str(REPO / "examples" / "dgx-h100-8gpu.toml"))
    assert cfg.prefill_devices == ("cuda:0", "cuda:1")
    assert cfg.decode_devices == tuple(f"cuda:{i}" for i in range(2, 8))
    assert cfg.kv.memory_gib == 0 and cfg.dtype == "bfloat16"
    # This machine, without the GPUs: the config names devices it lacks.
    monkeypatch.setattr(nodeserve.device, "available_devices", lambda: ["cpu:0", "cpu:1"])
    with pytest.raises(ConfigError, match="cuda:0"):
        load_config(str(REPO / "examples" / "dgx-h100-8gpu.toml"))


def test_kv_pages_for_device():
    gib = 2 ** 30
    assert kv_pages_for_device(10 * gib, 0.1, gib) == 9
    assert kv_pages_for_device(10 * gib, 0.0, 3 * gib) == 3
    assert kv_pages_for_device(100, 0.5, 1000) == 1  # never zero pages: the pool fails loudly instead
    # An 8B Llama in bf16 (32 layers, 8 KV heads, head_dim 128): 2 MiB per 16-token page; 60 GiB free -> 27648.
    cfg = SimpleNamespace(kv_bytes_per_token=2 * 32 * 8 * 128)  # K and V x layers x KV heads x head_dim
    page = KVPool.bytes_per_page(cfg, 16, torch.bfloat16)
    assert page == 2 * 2**20
    assert kv_pages_for_device(60 * gib, 0.1, page) == 27648
    assert KVPool.bytes_per_page(cfg, 16, kv_cache_dtype("fp8_e4m3", torch.bfloat16)) == page // 2


def test_kv_cache_dtype():
    assert kv_cache_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert kv_cache_dtype("fp8_e4m3", torch.bfloat16) is torch.float8_e4m3fn


def test_devices_command_on_cpu():
    out = subprocess.run([sys.executable, "-m", "nodeserve", "devices", "--mib", "8"], capture_output=True,
                         text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("cpu: ") and "usable cores" in lines[0]
    assert "DRAM read bandwidth" in lines[1] and "GB/s on 1 core" in lines[1]
    if not torch.cuda.is_available():
        assert lines[2] == "cuda: no GPU visible to torch"
