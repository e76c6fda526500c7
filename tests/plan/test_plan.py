"""`nodeserve plan`: workload files, the report, and the CLI on a saved profile."""

from __future__ import annotations

import json

import pytest

from nodeserve.core.cost_model import CostModel, StepModel, StepShape
from nodeserve.plan.planner import format_report, plan, workload_from_dict
from nodeserve.cli import main
from nodeserve.config import ConfigError, config_from_dict
from nodeserve.workloads import Spec

CPU = [0.02, 0.005, 1e-7, 0.004, 2e-6]


def profile(names=("cpu:0", "cpu:1")) -> CostModel:
    models = {}
    for n in names:
        m = StepModel(coef=list(CPU))
        m.add(StepShape.of([(16, 0)]), 0.1)
        models[n] = m
    return CostModel(models, {("cpu:0", "cpu:1"): 5e9, ("cpu:1", "cpu:0"): 5e9}, 46080, 30)


def config(**slo):
    return config_from_dict({"devices": {"mode": "colocated", "devices": ["cpu:0", "cpu:1"]}, "slo": slo},
                            check_devices=False)


def test_workload_file():
    wl = workload_from_dict({"prompt": [50, 300], "output": [16, 64], "num_requests": 20, "seed": 3, "rates": [1],
                             "slo": {"ttft_s": 2, "tpot_s": 0.2, "target": 0.8}}, config())
    assert wl.spec == Spec((50, 300), (16, 64), None, 0.0) and wl.num_requests == 20 and wl.rates == (1.0,)
    assert (wl.slo.ttft_s, wl.slo.tpot_s, wl.target) == (2.0, 0.2, 0.8)
    assert all(50 <= p <= 300 and 16 <= o <= 64 for p, o in wl.requests())
    per_token = workload_from_dict({"slo": {"ttft_s": 0, "ttft_per_token_s": 0.025}}, config())  # bench's SLO
    assert (per_token.slo.ttft_s, per_token.slo.ttft_per_token_s) == (0.0, 0.025)
    default = workload_from_dict({}, config(ttft_s=4.0, ttft_per_token_s=0.01))
    assert default.spec == "bimodal" and default.slo.ttft_s == 4.0 and default.slo.ttft_per_token_s == 0.01


@pytest.mark.parametrize("raw, match", [
    ({"bogus": 1}, "unknown workload key 'bogus'"),
    ({"name": "multiturn"}, "multiturn"),
    ({"name": "agent", "prompt": [1, 2]}, "not both"),
    ({"prompt": [10, 5], "output": [1, 2]}, "'prompt'"),
    ({"prompt": [10, 20]}, "both 'prompt' and 'output'"),
    ({"slo": {"tpot_s": 0}}, "more than 0"),
    ({"slo": {"ttft_s": 0, "ttft_per_token_s": 0}}, "'slo.ttft_s' or 'slo.ttft_per_token_s'"),
    ({"slo": {"target": 2}}, "slo.target"),
    ({"slo": {"p99": 1}}, "unknown key 'slo.p99'"),
    ({"rates": [0]}, "'rates'"),
    ({"num_requests": 0}, "'num_requests'"),
])
def test_bad_workload_files_name_the_key(raw, match):
    with pytest.raises(ConfigError, match=match):
        workload_from_dict(raw, config())


def test_plan_report_recommends_the_best_mode_with_its_config():
    wl = workload_from_dict({"name": "agent", "num_requests": 40, "rates": [0.5]}, config())
    result = plan(config(), profile(), wl)
    assert [r["mode"] for r in result["modes"]] == ["colocated", "1P:1D", "adaptive"]
    by = {r["mode"]: r for r in result["modes"]}
    assert by["colocated"]["goodput"] > by["1P:1D"]["goodput"] > 0
    best = max(result["modes"], key=lambda r: r["goodput"])
    assert result["recommended"] == best["mode"]
    text = "\n".join(format_report(result, profile()))
    assert f"recommended: {best['mode']}" in text and f'mode = "{best["mode"]}"'.replace('"1P:1D"', '"disaggregated"') in text


def test_plan_needs_every_device_in_the_profile():
    wl = workload_from_dict({"name": "agent", "num_requests": 5}, config())
    with pytest.raises(ConfigError, match="no measurements for cpu:1"):
        plan(config(), profile(("cpu:0",)), wl)


def test_cli(tmp_path, capsys):
    prof, cfg, work, out = (tmp_path / n for n in ("p.json", "n.toml", "w.toml", "o.json"))
    prof.write_text(json.dumps(profile().as_dict()))
    cfg.write_text('[devices]\nmode = "colocated"\ndevices = ["cpu:0", "cpu:1"]\n')
    work.write_text('name = "agent"\nnum_requests = 30\n[slo]\nttft_s = 3.0\n')
    assert main(["plan", "--config", str(cfg), "--profile", str(prof), "--workload", str(work),
                 "--json", str(out)]) == 0
    assert "goodput (req/s)" in capsys.readouterr().out
    assert json.loads(out.read_text())["slo"]["ttft_s"] == 3.0
    bad = tmp_path / "bad.json"
    bad.write_text('{"pools": []}')
    assert main(["plan", "--config", str(cfg), "--profile", str(bad)]) == 2
    assert "not a nodeserve profile" in capsys.readouterr().err


def test_cli_saves_the_profile_it_measures(tmp_path, monkeypatch, capsys):
    import nodeserve.plan.planner as profiler

    monkeypatch.setattr(profiler, "measure_config", lambda config, budget: profile())  # no model loaded here
    cfg, saved = tmp_path / "n.toml", tmp_path / "p.json"
    cfg.write_text('[devices]\nmode = "colocated"\ndevices = ["cpu:0", "cpu:1"]\n')
    work = tmp_path / "w.toml"
    work.write_text('name = "agent"\nnum_requests = 10\n')
    assert main(["plan", "--config", str(cfg), "--measure", "--save-profile", str(saved),
                 "--workload", str(work)]) == 0
    first = capsys.readouterr().out
    assert main(["plan", "--config", str(cfg), "--profile", str(saved), "--workload", str(work)]) == 0
    assert capsys.readouterr().out == first  # the saved profile plans exactly as the measured one did
    assert main(["plan", "--config", str(cfg), "--profile", str(saved), "--save-profile", str(saved)]) == 2
    assert "--save-profile saves what --measure measures" in capsys.readouterr().err
