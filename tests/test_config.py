"""nodeserve.toml: the strict schema, its one-line errors, and `nodeserve check-config`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nodeserve.config import Config, ConfigError, config_from_dict, load_config
from nodeserve.device import available_devices

REPO = Path(__file__).resolve().parent.parent
HAVE = available_devices()
DEV_A = HAVE[0]  # a device this machine has, whatever its core numbering
MISSING_CPU = next(f"cpu:{n}" for n in [99, *range(100, 100000)] if f"cpu:{n}" not in HAVE)


def _error(raw: dict, check_devices: bool = True) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw, check_devices)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_defaults_load():
    cfg = config_from_dict({}, check_devices=False)
    assert cfg == Config()
    assert cfg.model.path == "smollm2-135m-instruct" and cfg.model.dtype == "auto"
    assert cfg.dtype in ("bfloat16", "float32")  # auto: bf16 only where the CPU multiplies it in hardware
    assert cfg.server.port == 8000 and cfg.kv.page_size == 16
    assert cfg.devices.mode == "disaggregated"
    assert cfg.prefill_devices == ("cpu:0",) and cfg.decode_devices == ("cpu:1",)
    assert cfg.served_model_name == "smollm2-135m-instruct"


@pytest.mark.skipif(not {"cpu:0", "cpu:1"} <= set(HAVE), reason="the default config names cpu:0 and cpu:1")
def test_repo_config_loads():
    cfg = load_config(str(REPO / "nodeserve.toml"))
    assert cfg.model.name == "smollm2-135m-instruct"
    assert cfg.devices.prefill == ("cpu:0",) and cfg.devices.decode == ("cpu:1",)


def test_valid_config_values():
    cfg = config_from_dict({
        "model": {"path": "/models/x.gguf", "dtype": "float32", "max_model_len": 512},
        "server": {"host": "0.0.0.0", "port": 0},
        "kv": {"page_size": 8, "memory_gib": 1},  # an integer where a float is expected is fine
        "scheduler": {"max_num_seqs": 4},
        "devices": {"mode": "colocated", "devices": [DEV_A]},
    })
    assert cfg.model.max_model_len == 512 and cfg.server.port == 0
    assert cfg.kv.memory_gib == 1.0 and isinstance(cfg.kv.memory_gib, float)
    assert cfg.devices.devices == (DEV_A,)
    assert cfg.prefill_devices == () and cfg.decode_devices == (DEV_A,)
    assert cfg.served_model_name == "x"


def test_unknown_section():
    msg = _error({"sever": {"port": 1}})
    assert "[sever]" in msg and "[server]" in msg and "[model]" in msg


def test_unknown_key_names_it_and_lists_valid_keys():
    msg = _error({"server": {"prot": 8000}})
    assert "'server.prot'" in msg
    for key in ("host", "port", "max_waiting"):
        assert key in msg.split("valid keys")[1]


def test_wrong_type():
    msg = _error({"server": {"port": "abc"}})
    assert "'server.port'" in msg and "integer" in msg and "'abc'" in msg


@pytest.mark.parametrize("raw, key", [
    ({"server": {"port": True}}, "server.port"),           # a bool is not an integer
    ({"server": {"port": 8000.0}}, "server.port"),
    ({"kv": {"memory_gib": "2"}}, "kv.memory_gib"),
    ({"model": {"path": 7}}, "model.path"),
    ({"devices": {"prefill": "cpu:0"}}, "devices.prefill"),  # a string where an array is expected
    ({"devices": {"decode": [1]}}, "devices.decode"),
])
def test_wrong_types_name_the_key(raw, key):
    assert f"'{key}'" in _error(raw, check_devices=False)


def test_section_that_is_not_a_table():
    assert "'server'" in _error({"server": 8000})


@pytest.mark.parametrize("raw, key", [
    ({"server": {"port": 70000}}, "server.port"),
    ({"server": {"port": -1}}, "server.port"),
    ({"kv": {"page_size": 0}}, "kv.page_size"),
    ({"kv": {"memory_gib": 0}}, "kv.memory_gib"),
    ({"model": {"dtype": "float8"}}, "model.dtype"),
    ({"model": {"path": ""}}, "model.path"),
    ({"scheduler": {"max_num_batched_tokens": 1}}, "scheduler.max_num_batched_tokens"),
])
def test_out_of_range_values(raw, key):
    assert f"'{key}'" in _error(raw, check_devices=False)


def test_a_gpu_that_does_not_exist_is_refused_and_a_cpu_past_the_core_count_shares_a_core():
    missing_gpu = next(f"cuda:{n}" for n in range(99, 100000) if f"cuda:{n}" not in HAVE)
    msg = _error({"devices": {"prefill": [DEV_A], "decode": [missing_gpu]}})
    assert "'devices.decode'" in msg and missing_gpu in msg and "available" in msg
    msg = _error({"devices": {"prefill": [DEV_A], "decode": [f"cpu:1+{missing_gpu}"]}})
    assert "one kind" in msg
    # CPU devices past the core count share cores (a warning at start), so any grouping runs on 2 cores.
    config_from_dict({"devices": {"prefill": [DEV_A], "decode": [MISSING_CPU]}})


def test_tensor_parallel_group_names():
    cfg = config_from_dict({"devices": {"prefill": ["cpu:0"], "decode": ["cpu:1 + CPU:2"]}}, check_devices=False)
    assert cfg.decode_devices == ("cpu:1 + CPU:2",)
    msg = _error({"devices": {"prefill": ["cpu:0+cpu:1"], "decode": ["cpu:1+cpu:2"]}}, check_devices=False)
    assert "'cpu:1'" in msg and "twice" in msg
    msg = _error({"devices": {"mode": "colocated", "devices": ["cpu:0+cpu:0"]}}, check_devices=False)
    assert "twice" in msg
    msg = _error({"devices": {"mode": "colocated", "devices": ["cpu:0+"]}}, check_devices=False)
    assert "'devices.devices'" in msg and "'+'" in msg
    msg = _error({"devices": {"mode": "colocated", "devices": ["cpu:0+cpu:1"]}, "kv": {"dtype": "fp8_e4m3"}},
                 check_devices=False)
    assert "tensor-parallel" in msg


def test_bad_device_name():
    msg = _error({"devices": {"prefill": ["gpu0"], "decode": ["cpu:1"]}}, check_devices=False)
    assert "'devices.prefill'" in msg and "gpu0" in msg


def test_device_in_both_roles():
    msg = _error({"devices": {"prefill": ["cpu:0"], "decode": ["cpu:0", "cpu:1"]}}, check_devices=False)
    assert "'cpu:0'" in msg and "both" in msg


def test_duplicate_device():
    msg = _error({"devices": {"mode": "colocated", "devices": ["cpu:0", "cpu:0"]}}, check_devices=False)
    assert "'devices.devices'" in msg and "twice" in msg
    # The same device spelled two ways is still a duplicate.
    msg = _error({"devices": {"mode": "colocated", "devices": ["cpu:1", "CPU:01"]}}, check_devices=False)
    assert "twice" in msg


def test_bad_mode():
    msg = _error({"devices": {"mode": "split"}}, check_devices=False)
    assert "'devices.mode'" in msg and "'split'" in msg


def test_colocated_without_devices():
    msg = _error({"devices": {"mode": "colocated"}}, check_devices=False)
    assert "'devices.devices'" in msg and "colocated" in msg


def test_disaggregated_needs_both_roles():
    msg = _error({"devices": {"prefill": []}}, check_devices=False)
    assert "'devices.prefill'" in msg
    msg = _error({"devices": {"devices": ["cpu:0"]}}, check_devices=False)
    assert "'devices.devices'" in msg


def test_load_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[server\nport = 1\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(str(bad))


# ---- nodeserve check-config ----

def _check_config(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nodeserve", "check-config", str(path)],
                          capture_output=True, text=True, timeout=60, cwd=REPO)


@pytest.mark.skipif(not {"cpu:0", "cpu:1"} <= set(HAVE), reason="the repo config names cpu:0 and cpu:1")
def test_check_config_ok_on_repo_config():
    proc = _check_config(REPO / "nodeserve.toml")
    assert proc.returncode == 0, proc.stderr
    assert "OK" in proc.stdout and "mode=disaggregated" in proc.stdout
    assert proc.stderr == ""


@pytest.mark.parametrize("body, key", [
    ('[server]\nprot = 8000\n', "server.prot"),
    ('[server]\nport = "abc"\n', "server.port"),
    ('[devices]\nmode = "sideways"\n', "devices.mode"),
])
def test_check_config_rejects_bad_config(tmp_path, body, key):
    path = tmp_path / "nodeserve.toml"
    path.write_text(body)
    proc = _check_config(path)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"'{key}'" in lines[0] and str(path) in lines[0]
    assert "Traceback" not in proc.stderr


def test_auto_dtype_follows_the_hardware(monkeypatch):
    import nodeserve.device.cpu as cpu

    cfg = config_from_dict({"model": {"quantization": "none"}}, check_devices=False)
    monkeypatch.setattr(cpu, "has_fast_bf16", lambda: True)
    assert cfg.dtype == "bfloat16"
    monkeypatch.setattr(cpu, "has_fast_bf16", lambda: False)
    assert cfg.dtype == "float32"
    assert config_from_dict({"model": {"dtype": "float16"}}, check_devices=False).dtype == "float16"


def test_auto_quantization_keeps_gguf_blocks_on_cpu_only(monkeypatch, tmp_path):
    import nodeserve.device.cpu as cpu

    monkeypatch.setattr(cpu, "has_fast_bf16", lambda: True)
    cfg = config_from_dict({}, check_devices=False)  # the bundled GGUF on cpu:0 / cpu:1
    assert (cfg.model.quantization, cfg.quantization, cfg.dtype) == ("auto", "auto", "float32")
    cuda = {"devices": {"prefill": ["cuda:0"], "decode": ["cuda:1"]}}
    assert config_from_dict(cuda, check_devices=False).quantization == "none"
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    hf = config_from_dict({"model": {"path": str(hf_dir)}}, check_devices=False)
    assert (hf.quantization, hf.dtype) == ("none", "bfloat16")  # an HF checkpoint keeps the hardware's dtype
    # an explicit bf16 model computes in bf16: auto leaves its weights dense instead of refusing
    assert config_from_dict({"model": {"dtype": "bfloat16"}}, check_devices=False).quantization == "none"
    for fmt in ("int8", "int4"):
        msg = _error({"model": {"quantization": fmt}, **cuda}, check_devices=False)
        assert "'model.quantization'" in msg and "cuda" in msg


def test_fp16_weights_compute_in_float32(monkeypatch):
    import nodeserve.device.cpu as cpu

    monkeypatch.setattr(cpu, "has_fast_bf16", lambda: True)  # auto would pick bf16 without quantization
    assert config_from_dict({"model": {"quantization": "fp16"}}, check_devices=False).dtype == "float32"
    msg = _error({"model": {"quantization": "fp16", "dtype": "bfloat16"}}, check_devices=False)
    assert "'model.quantization" in msg and "float32" in msg
    assert "'model.quantization'" in _error({"model": {"quantization": "int3"}}, check_devices=False)
    msg = _error({"model": {"quantization": "fp16"}, "devices": {"prefill": ["cuda:0"], "decode": ["cuda:1"]}},
                 check_devices=False)
    assert "'model.quantization'" in msg and "cuda" in msg


def test_slo_and_profile_defaults():
    cfg = config_from_dict({})
    assert cfg.slo.admission == "off" and cfg.slo.ttft_s == 2.5 and cfg.slo.tpot_s == 0.1
    assert cfg.profile.startup and cfg.profile.budget_s == 2.0
    cfg = config_from_dict({"slo": {"admission": "reject", "ttft_s": 5, "ttft_per_token_s": 0.005, "margin": 0}})
    assert cfg.slo.ttft_s == 5.0 and cfg.slo.margin == 0.0


@pytest.mark.parametrize("raw, key", [
    ({"slo": {"admission": "queue"}}, "slo.admission"),
    ({"slo": {"ttft_s": 0}}, "slo.ttft_s"),
    ({"slo": {"ttft_s": -1, "ttft_per_token_s": 0.01}}, "slo.ttft_s"),
    ({"slo": {"tpot_s": -1}}, "slo.tpot_s"),
    ({"slo": {"margin": -1}}, "slo.margin"),
    ({"slo": {"margin": float("nan")}}, "slo.margin"),
    ({"slo": {"ttft_per_token_s": -1}}, "slo.ttft_per_token_s"),
    ({"profile": {"budget_s": -1}}, "profile.budget_s"),
    ({"slo": {"admission": "reject"}, "profile": {"startup": False}}, "slo.admission"),
])
def test_bad_slo_and_profile_values_name_the_key(raw, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_from_dict(raw)


@pytest.mark.parametrize("kv, match", [
    ({"host_memory_gib": -2}, "kv.host_memory_gib"),
    ({"host_write": "sometimes"}, "kv.host_write"),
    ({"disk_gib": 1.0}, "kv.disk_path"),
    ({"disk_gib": 1.0, "disk_path": "/tmp/x", "host_memory_gib": 0}, "host tier"),
    ({"disk_gib": -1.0}, "kv.disk_gib"),
])
def test_kv_tier_settings_are_checked(kv, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict({"kv": kv}, check_devices=False)


def test_kv_tier_defaults():
    kv = config_from_dict({}, check_devices=False).kv
    assert kv.host_memory_gib == -1 and kv.host_write == "back" and kv.disk_path == "" and kv.disk_gib == 0


@pytest.mark.parametrize("raw, match", [
    ({"kv_events": {"endpoint": "5557"}}, "kv_events.endpoint"),
    ({"kv_events": {"replay_endpoint": "localhost:5558"}}, "kv_events.replay_endpoint"),
    ({"kv_events": {"hwm": 0}}, "kv_events.hwm"),
    ({"kv_events": {"buffer_steps": 0}}, "kv_events.buffer_steps"),
    ({"kv_events": {"max_queue_size": 0}}, "kv_events.max_queue_size"),
    ({"kv_events": {"port": 0}}, "kv_events.port"),
    ({"kv_events": {"sndbuf": -1}}, "kv_events.sndbuf"),
    ({"kv_events": {"enabled": True}, "kv": {"prefix_cache": False}}, "kv.prefix_cache = true"),
])
def test_kv_event_settings_are_checked(raw, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict(raw, check_devices=False)


def test_kv_events_are_off_by_default_with_vllms_settings():
    ev = config_from_dict({}, check_devices=False).kv_events
    # not vLLM's tcp://*:5557: bound on server.host's interface (127.0.0.1 by default), and no token ids
    assert not ev.enabled and ev.endpoint == "" and ev.replay_endpoint == "" and ev.topic == ""
    assert not ev.include_tokens and ev.port == 5557
    # vLLM's buffer and queue; hwm not vLLM's 100,000 but the replay buffer's size (a dead subscriber's bound)
    assert ev.buffer_steps == 10_000 and ev.hwm == 10_000 and ev.max_queue_size == 100_000


def test_prompt_attention_is_bf16_where_weights_are_quantized_and_float32_on_the_exact_path():
    assert config_from_dict({}, check_devices=False).prompt_attention == "auto"  # bf16 where the CPU has it
    assert config_from_dict({"model": {"quantization": "none"}}, check_devices=False).prompt_attention == "float32"
    assert config_from_dict({"model": {"quantization": "none", "prompt_attention": "bfloat16"}},
                            check_devices=False).prompt_attention == "bfloat16"
    assert config_from_dict({"model": {"prompt_attention": "float32"}},
                            check_devices=False).prompt_attention == "float32"
    with pytest.raises(ConfigError, match=r"model\.prompt_attention"):
        config_from_dict({"model": {"prompt_attention": "fp8"}}, check_devices=False)


def test_decode_activations_take_auto_int16_or_int8():
    assert config_from_dict({}, check_devices=False).model.decode_activations == "auto"
    for kind in ("int16", "int8"):
        assert config_from_dict({"model": {"decode_activations": kind}},
                                check_devices=False).model.decode_activations == kind
    with pytest.raises(ConfigError, match=r"model\.decode_activations"):
        config_from_dict({"model": {"decode_activations": "bf16"}}, check_devices=False)


def test_prompt_activations_take_auto_int16_int8_or_bf16():
    assert config_from_dict({}, check_devices=False).model.prompt_activations == "auto"
    for kind in ("int16", "int8", "bf16"):
        assert config_from_dict({"model": {"prompt_activations": kind}},
                                check_devices=False).model.prompt_activations == kind
    with pytest.raises(ConfigError, match=r"model\.prompt_activations"):
        config_from_dict({"model": {"prompt_activations": "int4"}}, check_devices=False)
