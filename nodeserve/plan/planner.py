"""`nodeserve plan`: predicted goodput of every device layout for a workload, and the config it recommends.
(With --model-config, tensor-parallel layouts from a model's shape instead: plan/tp_planner.py.)

Inputs: the config's devices and scheduler limits, a cost model (a saved GET /debug/profile answer, or one
measured here by loading the model), and a workload file (TOML; every key optional):

    name = "bimodal"          # a benchmark workload (workloads.WORKLOADS), or the lengths of one's own:
    prompt = [50, 200]        #   prompt tokens, inclusive range
    output = [32, 256]        #   output tokens (max_tokens; requests run to it, as the benchmark's do)
    long_prompt = [1500, 3000]
    long_share = 0.2
    num_requests = 200        # the simulated workload (each probe rate replays it with Poisson arrivals;
                              #   with --model-config the default is 1000: a GPU group seats 256 at once)
    seed = 0
    rates = [0.2, 0.4]        # also report attainment at these rates (req/s)
    [slo]                     # defaults: the config's [slo]
    ttft_s = 2.5
    ttft_per_token_s = 0.0
    tpot_s = 0.1
    target = 0.9              # share of requests that must meet both
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from nodeserve import goodput, workloads
from nodeserve.core.cost_model import CostModel
from nodeserve.core.placement import SloTarget, StepLimits
from nodeserve.core.start import decode_prefill_chunk
from nodeserve.plan.simulate import attainment, candidate_modes, predict_goodput
from nodeserve.config import Config, ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass
class WorkloadPlan:
    spec: workloads.Spec | str = "bimodal"
    num_requests: int = 200
    seed: int = 0
    rates: tuple[float, ...] = ()
    slo: SloTarget = field(default_factory=lambda: SloTarget(2.5, 0.1))
    target: float = goodput.DEFAULT_SLO_TARGET

    def requests(self) -> list[tuple[int, int]]:
        """(prompt tokens, max_tokens) of the workload's requests, exactly as the benchmark draws them."""
        return [(r.prompt_len, r.max_tokens) for r in workloads.generate(self.spec, self.num_requests, self.seed)]

    def describe(self) -> str:
        s = self.spec
        what = s if isinstance(s, str) else (f"prompts {s.prompt[0]}-{s.prompt[1]}, outputs {s.output[0]}-"
                                             f"{s.output[1]}" + (f", {s.long_share:.0%} long prompts "
                                                                 f"{s.long_prompt[0]}-{s.long_prompt[1]}"
                                                                 if s.long_prompt else ""))
        return f"{what}, {self.num_requests} requests (seed {self.seed})"


WORKLOAD_KEYS = ("name", "prompt", "output", "long_prompt", "long_share", "num_requests", "seed", "rates", "slo")
SLO_KEYS = ("ttft_s", "ttft_per_token_s", "tpot_s", "target")


def _range(raw: dict, key: str) -> tuple[int, int] | None:
    v = raw.get(key)
    if v is None:
        return None
    if (not isinstance(v, list) or len(v) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in v)
            or not 1 <= v[0] <= v[1]):
        raise ConfigError(f"workload '{key}' must be an inclusive range [low, high] of positive integers, got {v!r}")
    return v[0], v[1]


def workload_from_dict(raw: dict, config: Config, default_num_requests: int = 200) -> WorkloadPlan:
    """A workload file's contents; errors name the key. SLO defaults come from the config's [slo]."""
    for k in raw:
        if k not in WORKLOAD_KEYS:
            raise ConfigError(f"unknown workload key '{k}'; valid keys: {', '.join(WORKLOAD_KEYS)}")
    slo_raw = raw.get("slo", {})
    if not isinstance(slo_raw, dict):
        raise ConfigError("workload 'slo' must be a table: [slo] followed by key = value lines")
    for k, v in slo_raw.items():
        if k not in SLO_KEYS:
            raise ConfigError(f"unknown key 'slo.{k}'; valid keys: {', '.join(SLO_KEYS)}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise ConfigError(f"'slo.{k}' must be a number >= 0, got {v!r}")
    c = config.slo
    slo = SloTarget(float(slo_raw.get("ttft_s", c.ttft_s)), float(slo_raw.get("tpot_s", c.tpot_s)),
                    float(slo_raw.get("ttft_per_token_s", c.ttft_per_token_s)))
    if not slo.tpot_s > 0:
        raise ConfigError("'slo.tpot_s' must be more than 0")
    if not slo.ttft_s + slo.ttft_per_token_s > 0:  # as the config's [slo]: a per-token TTFT target alone will do
        raise ConfigError("'slo.ttft_s' or 'slo.ttft_per_token_s' must be more than 0")
    target = float(slo_raw.get("target", goodput.DEFAULT_SLO_TARGET))
    if not 0 < target <= 1:
        raise ConfigError(f"'slo.target' must be a share in (0, 1], got {target}")
    prompt, output, long_prompt = _range(raw, "prompt"), _range(raw, "output"), _range(raw, "long_prompt")
    name = raw.get("name")
    if name is not None and (prompt or output or long_prompt):
        raise ConfigError("give a workload 'name' or its lengths ('prompt', 'output', ...), not both")
    if name is not None and name not in workloads.WORKLOADS:
        raise ConfigError(f"workload 'name' must be one of {', '.join(workloads.WORKLOADS)}, got {name!r} "
                          "(multiturn needs a prefix cache and closed-loop turns the simulator does not model)")
    share = raw.get("long_share", 0.2 if long_prompt else 0.0)
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
        raise ConfigError(f"workload 'long_share' must be a share in [0, 1], got {share!r}")
    if prompt or output:
        if not (prompt and output):
            raise ConfigError("a workload of one's own needs both 'prompt' and 'output' ranges")
        spec: workloads.Spec | str = workloads.Spec(prompt, output, long_prompt, float(share) if long_prompt else 0.0)
    else:
        spec = name or "bimodal"
    num, seed, rates = raw.get("num_requests", default_num_requests), raw.get("seed", 0), raw.get("rates", [])
    if isinstance(num, bool) or not isinstance(num, int) or not 1 <= num <= 100_000:
        raise ConfigError(f"workload 'num_requests' must be an integer from 1 to 100000, got {num!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"workload 'seed' must be an integer, got {seed!r}")
    if not isinstance(rates, list) or not all(isinstance(r, (int, float)) and not isinstance(r, bool) and r > 0
                                               for r in rates):
        raise ConfigError(f"workload 'rates' must be a list of positive numbers (req/s), got {rates!r}")
    return WorkloadPlan(spec, num, seed, tuple(float(r) for r in rates), slo, target)


def load_workload(path: str, config: Config, default_num_requests: int = 200) -> WorkloadPlan:
    try:
        with open(path, "rb") as f:
            return workload_from_dict(tomllib.load(f), config, default_num_requests)
    except FileNotFoundError:
        raise ConfigError(f"workload file '{path}' not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None


def config_devices(config: Config) -> list[str]:
    return list(config.prefill_devices + config.decode_devices)


def simulation_settings(config: Config, cost: CostModel) -> dict:
    """The config's settings the simulator takes (simulate's keyword arguments), pools sized from kv.memory_gib."""
    devices = config_devices(config)
    return {"local_prefill_threshold": config.devices.local_prefill_threshold,
            "local_prefill_when_busy": config.devices.local_prefill_when_busy,
            "decode_prefill_chunk": decode_prefill_chunk(config.scheduler, devices[-1].split(":")[0]),
            "side_prefill": config.scheduler.decode_prefill_chunk == 0,
            "prefill_order": config.scheduler.prefill_order,
            "capacity_tokens": config.kv.memory_gib * 2**30 / cost.kv_bytes_per_token if cost.kv_bytes_per_token
            else float("inf")}


def plan(config: Config, cost: CostModel, wl: WorkloadPlan) -> dict:
    """Predicted goodput of every candidate mode, attainment at the asked rates, and the recommendation."""
    devices = config_devices(config)
    missing = [d for d in devices if d not in cost.devices or not cost.devices[d].samples]
    if missing:
        raise ConfigError(f"the profile has no measurements for {', '.join(missing)}: measure it on these devices "
                          "(GET /debug/profile of a server running this config, or --measure)")
    limits = StepLimits(config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs)
    reqs = wl.requests()
    kw = simulation_settings(config, cost)
    rows = []
    for mode in candidate_modes(devices):
        g = predict_goodput(cost, mode, limits, wl.slo, reqs, wl.seed, wl.target, **kw)
        at = {r: attainment(cost, mode, limits, wl.slo, reqs,
                            workloads.arrival_times("poisson", len(reqs), r, wl.seed), **kw) for r in wl.rates}
        rows.append({"mode": mode.name, "roles": mode.roles, "goodput": g.goodput or 0.0, "status": g.status,
                     "attainment": at, "config": mode.config_lines()})
    best = max(rows, key=lambda r: r["goodput"])
    return {"workload": wl.describe(), "slo": {"ttft_s": wl.slo.ttft_s, "ttft_per_token_s": wl.slo.ttft_per_token_s,
                                               "tpot_s": wl.slo.tpot_s, "target": wl.target},
            "modes": rows, "recommended": best["mode"]}


def format_report(result: dict, cost: CostModel) -> list[str]:
    slo = result["slo"]
    per_tok = f" + {slo['ttft_per_token_s'] * 1000:g} ms/prompt token" if slo["ttft_per_token_s"] else ""
    lines = [f"workload: {result['workload']}",
             f"SLO: TTFT <= {slo['ttft_s']:g} s{per_tok}, TPOT <= {slo['tpot_s'] * 1000:g} ms, "
             f"for {slo['target']:.0%} of requests",
             "profile: " + ", ".join(f"{d} ({len(m.samples)} steps, fit error "
                                     f"{'-' if m.rel_error is None else f'{m.rel_error:.0%}'})"
                                     for d, m in cost.devices.items())
             + "".join(f", copy {s}->{d} {bw / 1e9:.1f} GB/s" for (s, d), bw in cost.copy_bandwidth.items()),
             ""]
    rates = sorted({r for row in result["modes"] for r in row["attainment"]})
    head = f"{'mode':<12} {'goodput (req/s)':>16}" + "".join(f" {'@' + format(r, 'g') + ' req/s':>12}" for r in rates)
    lines += [head, "-" * len(head)]
    for row in result["modes"]:
        g = {"below_min": "< 0.001", "at_max": f">= {row['goodput']:.3f}"}.get(row["status"], f"{row['goodput']:.3f}")
        lines.append(f"{row['mode']:<12} {g:>16}" + "".join(f" {row['attainment'][r]:>12.0%}" for r in rates))
    by = {row["mode"]: row for row in result["modes"]}
    rec = by[result["recommended"]]
    lines += ["", f"recommended: {rec['mode']}", "[devices]", *rec["config"]]
    return lines


def measure_config(config, budget_s: float) -> CostModel:
    """`nodeserve plan --measure`: loads the model, starts the config's workers (no server) and profiles them."""
    import asyncio

    from nodeserve.model.loader import load_model, parse_dtype
    from nodeserve.runtime.engine import Engine
    from nodeserve.runtime.profiler import Profiler

    loaded = load_model(config.model.path, parse_dtype(config.dtype), quantization=config.quantization,
                        prompt_activations=config.model.prompt_activations, tp_degrees=config.tp_degrees,
                        decode_activations=config.model.decode_activations)
    engine = Engine(config, loaded)
    loop = asyncio.new_event_loop()  # the workers post results to it; nothing runs on them here
    engine.start(loop)
    try:
        profiler = Profiler(engine.workers)
        profiler.measure(budget_s)
        return profiler.model
    finally:
        engine.stop()
        loop.close()
