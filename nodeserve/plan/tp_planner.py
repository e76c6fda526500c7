"""`nodeserve plan --model-config`: which tensor-parallel layout of one node serves a workload best, from a model's
config.json and a GPU's datasheet (no weights, no GPU).

DistServe's search (arXiv 2401.09670, its simdistserve/), on one node: every layout of num_prefill groups of
prefill_tp GPUs plus num_decode groups of decode_tp GPUs that fits the node's GPUs, and every colocated layout (n
groups of one degree, each prefilling and decoding). Each is simulated by plan/simulate.py (the engine's own router
and scheduler) on the roofline cost model of plan/roofline.py and scored by its predicted goodput, the highest
Poisson rate at which the SLO target share of requests meets both TTFT and TPOT. Degrees come from
model/tp_layout.valid_degrees; a degree whose group does not fit a GPU (weights per rank plus KV for
min_kv_tokens tokens: roofline.check_fit) is rejected with the reason, and so is every layout that uses it.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial

from nodeserve import goodput
from nodeserve.config import Config
from nodeserve.core.cost_model import CostModel, StepModel, StepShape
from nodeserve.core.load import SloTarget, StepLimits
from nodeserve.core.start import decode_prefill_chunk
from nodeserve.model.tp_layout import tp_layout, valid_degrees
from nodeserve.model.config import ModelConfig
from nodeserve.plan.planner import WorkloadPlan
from nodeserve.plan.roofline import Fit, GpuSpec, GroupShape, RooflineStepModel, check_fit
from nodeserve.plan.simulate import Mode, predict_goodput

RATE_MAX = 1000.0   # req/s: the search's ceiling (a row that meets the SLO even there prints ">= 1000")
REL_TOL = 0.03      # the goodput search stops within 3 %: rows closer than that rank by chance


@dataclass(frozen=True)
class Layout:
    """num_prefill groups of prefill_tp GPUs that prefill and num_decode groups of decode_tp GPUs that decode, or
    (num_prefill = 0) num_decode colocated groups of decode_tp GPUs that do both."""

    num_prefill: int
    prefill_tp: int
    num_decode: int
    decode_tp: int

    @property
    def colocated(self) -> bool:
        return self.num_prefill == 0

    @property
    def num_gpus(self) -> int:
        return self.num_prefill * self.prefill_tp + self.num_decode * self.decode_tp

    @property
    def degrees(self) -> set[int]:
        return {self.decode_tp} if self.colocated else {self.prefill_tp, self.decode_tp}

    @property
    def prefill(self) -> str:
        return "colocated" if self.colocated else f"{self.num_prefill} x TP{self.prefill_tp}"

    @property
    def decode(self) -> str:
        return f"{self.num_decode} x TP{self.decode_tp}"

    @property
    def name(self) -> str:
        return f"{self.decode} colocated" if self.colocated else f"{self.prefill} P + {self.decode} D"

    def groups(self) -> list[tuple[str, int, str]]:
        """(device name, degree, role) per group: GPUs numbered from cuda:0, prefill groups first; a group of
        several GPUs is named by joining theirs with '+' (cuda:0+cuda:1)."""
        out, gpu = [], 0
        spec = [] if self.colocated else [("prefill", self.prefill_tp)] * self.num_prefill
        spec += [("colocated" if self.colocated else "decode", self.decode_tp)] * self.num_decode
        for role, tp in spec:
            out.append(("+".join(f"cuda:{i}" for i in range(gpu, gpu + tp)), tp, role))
            gpu += tp
        return out

    def mode(self) -> Mode:
        return Mode(self.name, {name: role for name, _, role in self.groups()})


def enumerate_layouts(degrees: list[int], num_gpus: int) -> list[Layout]:
    """Every disaggregated layout (at least one group of each role) and every colocated one on at most num_gpus."""
    out = [Layout(0, 0, n, t) for t in degrees for n in range(1, num_gpus // t + 1)]
    for tp in degrees:
        for np_ in range(1, num_gpus // tp + 1):
            for td in degrees:
                out += [Layout(np_, tp, nd, td) for nd in range(1, (num_gpus - np_ * tp) // td + 1)]
    return out


@dataclass(frozen=True)
class NodeSpec:
    """The node: its GPUs, the dtypes' sizes, and the fit rule's numbers (roofline.check_fit)."""

    gpu: GpuSpec
    num_gpus: int = 8
    weight_bytes: int = 2          # bf16 / fp16
    kv_bytes: int = 2              # 1 with kv.dtype = "fp8_e4m3"
    memory_headroom: float = 0.1   # kv.memory_headroom
    min_kv_tokens: int = 8192      # a group must hold at least this much KV (default: one max_model_len sequence)
    page_size: int = 16


@dataclass(frozen=True)
class SimSettings:
    """The config's settings the simulator takes (simulate's keyword arguments) besides the pools."""

    limits: StepLimits
    local_prefill_threshold: int = 0
    local_prefill_when_busy: int = 512
    decode_prefill_chunk: int = 256
    prefill_order: str = "deadline"

    @classmethod
    def of(cls, config: Config) -> SimSettings:
        s, d = config.scheduler, config.devices
        return cls(StepLimits(s.max_num_batched_tokens, s.max_num_seqs), d.local_prefill_threshold,
                   d.local_prefill_when_busy, decode_prefill_chunk(s, "cuda"), s.prefill_order)


def node_spec(config: Config, model: ModelConfig, gpu: GpuSpec, num_gpus: int,
              min_kv_tokens: int | None = None) -> NodeSpec:
    """The node as the config describes it: model.dtype (float32: 4 bytes, else 2), kv.dtype, kv.memory_headroom,
    and min_kv_tokens defaulting to model.max_model_len (or the model's own context length)."""
    weight_bytes = 4 if config.model.dtype == "float32" else 2
    return NodeSpec(gpu, num_gpus, weight_bytes, 1 if config.kv.dtype == "fp8_e4m3" else weight_bytes,
                    config.kv.memory_headroom,
                    min_kv_tokens or config.model.max_model_len or model.max_position_embeddings, config.kv.page_size)


def degree_fits(model: ModelConfig, node: NodeSpec) -> dict[int, Fit]:
    """Every degree up to the node's GPUs: its fit, or (reason only) why the model's heads cannot be split so."""
    valid = valid_degrees(model.num_heads, model.num_kv_heads, model.intermediate_size, max_degree=node.num_gpus)
    out = {}
    for t in range(1, node.num_gpus + 1):
        if t not in valid:
            try:
                tp_layout(model.num_heads, model.num_kv_heads, model.intermediate_size, t)
                reason = "not a valid degree for this model's heads"
            except ValueError as e:
                reason = str(e)
            out[t] = Fit(0.0, 0, reason)
            continue
        out[t] = check_fit(GroupShape.of(model, t), node.gpu, node.weight_bytes, node.kv_bytes,
                           node.memory_headroom, node.min_kv_tokens, node.page_size)
    return out


def cost_model(layout: Layout, model: ModelConfig, node: NodeSpec) -> CostModel:
    """The roofline per group; a prefill group's KV reaches a decode group over min(degrees) NVLinks at once (each
    rank sends its heads to the ranks that hold them, every GPU on its own link)."""
    groups = layout.groups()
    shapes = {t: GroupShape.of(model, t) for t in layout.degrees}
    devices: dict[str, StepModel] = {n: RooflineStepModel(shapes[t], node.gpu, node.weight_bytes, node.kv_bytes)
                                     for n, t, _ in groups}
    bandwidth = {(p, d): node.gpu.link_bytes_per_s * min(tp, td) for p, tp, rp in groups if rp == "prefill"
                 for d, td, rd in groups if rd == "decode"}
    kv_bytes_per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * node.kv_bytes
    return CostModel(devices, bandwidth, kv_bytes_per_token, model.num_layers)


def capacity_estimate(cost: CostModel, layout: Layout, settings: SimSettings, slo: SloTarget,
                      requests: list[tuple[int, int]]) -> float:
    """A rough guess of the rate (req/s) the layout serves, so that the goodput search starts near it (at half of
    it) instead of doubling up from 0.05 req/s: prefill at full chunks, decode at the largest batch whose step
    meets the TPOT target, each role's groups at once (colocated: one group's time shared between the two)."""
    prompt = sum(p for p, _ in requests) / len(requests)
    output = sum(o for _, o in requests) / len(requests)
    chunk = settings.limits.max_num_batched_tokens

    def rates(name: str) -> tuple[float, float]:
        prefill = chunk / cost.step_time(name, StepShape.of([(chunk, 0)]))
        best = 0.0
        for batch in range(1, settings.limits.max_num_seqs + 1):
            step = cost.step_time(name, StepShape.of([], [prompt + output / 2] * batch))
            if step > slo.tpot_s and best:
                break
            best = batch / step
        return prefill, best  # tokens/s

    groups = layout.groups()
    if layout.colocated:
        p, d = rates(groups[0][0])
        return layout.num_decode / (prompt / p + output / d)
    p, _ = rates(groups[0][0])
    _, d = rates(groups[-1][0])
    return min(layout.num_prefill * p / prompt, layout.num_decode * d / output)


def evaluate(layout: Layout, model: ModelConfig, node: NodeSpec, settings: SimSettings, wl: WorkloadPlan,
             fits: dict[int, Fit]) -> dict:
    """One layout's row: predicted goodput, P90 TTFT and TPOT at that rate, and which target binds there."""
    cost = cost_model(layout, model, node)
    requests = wl.requests()
    estimate = capacity_estimate(cost, layout, settings, wl.slo, requests)
    probes: dict[float, list[dict]] = {}
    g = predict_goodput(cost, layout.mode(), settings.limits, wl.slo, requests, wl.seed, wl.target,
                        rate_min=min(max(estimate / 2, 0.01), RATE_MAX), rate_max=RATE_MAX, rel_tol=REL_TOL,
                        on_probe=probes.__setitem__, stop_early=True,
                        local_prefill_threshold=settings.local_prefill_threshold,
                        local_prefill_when_busy=settings.local_prefill_when_busy,
                        decode_prefill_chunk=settings.decode_prefill_chunk, prefill_order=settings.prefill_order,
                        capacity_tokens={n: float(fits[t].kv_tokens) for n, t, _ in layout.groups()})
    at = probes[g.goodput] if g.goodput is not None else []  # the records of the probe at the goodput
    ttft = goodput.distribution([r["ttft"] for r in at if r["ok"]])["p90"]
    tpot = goodput.distribution([r["tpot"] for r in at if r["ok"] and r["tpot"] is not None])["p90"]
    return {"layout": asdict(layout), "name": layout.name, "prefill": layout.prefill, "decode": layout.decode,
            "num_gpus": layout.num_gpus, "goodput": g.goodput or 0.0, "status": g.status,
            "goodput_per_gpu": (g.goodput or 0.0) / layout.num_gpus, "ttft_p90_s": ttft, "tpot_p90_s": tpot,
            "binds": binding(at, wl.slo), "kv_tokens": {t: fits[t].kv_tokens for t in sorted(layout.degrees)},
            "devices": layout.mode().config_lines()}


def binding(records: list[dict], slo: SloTarget) -> str | None:
    """The target closest to being missed at the goodput rate (P90 of each request's TTFT over its limit against
    P90 TPOT over its target): what a higher rate misses first."""
    done = [r for r in records if r["ok"]]
    ttft = goodput.percentile([r["ttft"] / slo.ttft_limit(r["prompt_len"]) for r in done], 90)
    tpot = goodput.percentile([r["tpot"] / slo.tpot_s for r in done if r["tpot"] is not None], 90)
    if ttft is None:
        return None
    return "TTFT" if tpot is None or ttft >= tpot else "TPOT"


def plan_tp(model: ModelConfig, node: NodeSpec, settings: SimSettings, wl: WorkloadPlan,
            jobs: int = 1) -> dict:
    """Every layout of the node, ranked by predicted goodput (then fewer GPUs), those that cannot run with why."""
    fits = degree_fits(model, node)
    rejected = [{"name": lay.name, "num_gpus": lay.num_gpus,
                 "reason": "; ".join(f"TP{t}: {fits[t].reason}" for t in sorted(lay.degrees) if not fits[t].fits)}
                for lay in enumerate_layouts(list(range(1, node.num_gpus + 1)), node.num_gpus)
                if not all(fits[t].fits for t in lay.degrees)]
    layouts = enumerate_layouts([t for t, f in fits.items() if f.fits], node.num_gpus)
    run = partial(evaluate, model=model, node=node, settings=settings, wl=wl, fits=fits)
    if jobs > 1 and len(layouts) > 1:
        # A fresh process per layout: no simulator state outlives one, and a worker lives 10-80 s, not the whole
        # search (on the 2-core machine this was written on, workers that ran ~15 minutes were killed).
        with ProcessPoolExecutor(min(jobs, len(layouts)), max_tasks_per_child=1) as pool:
            rows = list(pool.map(run, layouts))
    else:
        rows = [run(lay) for lay in layouts]
    rows.sort(key=lambda r: (-r["goodput"], r["num_gpus"], r["name"]))
    return {"model": {"num_layers": model.num_layers, "hidden_size": model.hidden_size,
                      "num_heads": model.num_heads, "num_kv_heads": model.num_kv_heads,
                      "intermediate_size": model.intermediate_size, "vocab_size": model.vocab_size},
            "node": {**asdict(node), "gpu": asdict(node.gpu)},
            "workload": wl.describe(),
            "slo": {"ttft_s": wl.slo.ttft_s, "ttft_per_token_s": wl.slo.ttft_per_token_s, "tpot_s": wl.slo.tpot_s,
                    "target": wl.target},
            "degrees": {t: {"weight_gib": f.weight_gib, "kv_tokens": f.kv_tokens, "reason": f.reason}
                        for t, f in fits.items()},
            "ranked": rows, "rejected": rejected, "reason": reason(rows, fits, model, node, settings, wl.slo)}


def reason(rows: list[dict], fits: dict[int, Fit], model: ModelConfig, node: NodeSpec, settings: SimSettings,
           slo: SloTarget) -> list[str]:
    """Why the first row, a sentence each: its goodput against the rows within the search's tolerance (or the
    next), the best of the other kind (colocated or disaggregated), which target binds at its goodput, its groups'
    step times and pools, and the degrees that cannot run."""
    if not rows:
        return ["no layout fits: " + "; ".join(f"TP{t}: {f.reason}" for t, f in fits.items())]
    best = rows[0]
    out = [f"{best['name']} has the highest predicted goodput, {best['goodput']:.2f} req/s "
           f"({best['goodput_per_gpu']:.2f} per GPU)"]
    ties = [r for r in rows[1:] if r["goodput"] >= best["goodput"] * (1 - REL_TOL)]
    if ties:
        out[-1] += (f"; {len(ties)} more within the search's {REL_TOL:.0%} of it, as good as it within what this "
                    "model can tell: " + ", ".join(f"{r['name']} ({r['goodput']:.2f})" for r in ties))
    elif len(rows) > 1:
        out[-1] += f", {best['goodput'] / max(rows[1]['goodput'], 1e-9) - 1:.0%} above the next, {rows[1]['name']}"
    colocated = best["layout"]["num_prefill"] == 0
    other = next((r for r in rows if (r["layout"]["num_prefill"] == 0) != colocated), None)
    if other is not None and other not in ties:
        out.append(f"the best {'disaggregated' if colocated else 'colocated'} layout, {other['name']}, predicts "
                   f"{other['goodput']:.2f} req/s ({other['goodput'] / best['goodput'] - 1:+.0%})")
    if best["binds"]:
        out.append(f"at that rate {best['binds']} binds (P90 TTFT {best['ttft_p90_s']:.2f} s against "
                   f"{slo.ttft_s:g} s" + (" + per token" if slo.ttft_per_token_s else "")
                   + f", P90 TPOT {best['tpot_p90_s'] * 1e3:.0f} ms against {slo.tpot_s * 1e3:g} ms): "
                   + ("prompt throughput sets the rate" if best["binds"] == "TTFT" else "decode speed sets the rate"))
    lay, chunk = Layout(**best["layout"]), settings.limits.max_num_batched_tokens
    for tp in sorted(lay.degrees):
        sm = RooflineStepModel(GroupShape.of(model, tp), node.gpu, node.weight_bytes, node.kv_bytes)
        out.append(f"a TP{tp} group prefills {chunk:,} tokens in {sm.step_time(StepShape.of([(chunk, 0)])) * 1e3:.0f}"
                   f" ms, steps 64 decodes at 1,024 tokens of context in "
                   f"{sm.step_time(StepShape.of([], [1024] * 64)) * 1e3:.1f} ms, and holds KV for "
                   f"{fits[tp].kv_tokens:,} tokens")
    out += [f"TP{t} is rejected: {f.reason}" for t, f in fits.items() if not f.fits]
    return out


def default_jobs() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


def format_tp_report(result: dict, top: int = 0) -> list[str]:
    """The ranked table (its first `top` rows, 0: all), the rejected layouts with why, the pick and its reason."""
    node, slo = result["node"], result["slo"]
    per_tok = f" + {slo['ttft_per_token_s'] * 1000:g} ms/prompt token" if slo["ttft_per_token_s"] else ""
    lines = [f"node: {node['num_gpus']} x {node['gpu']['name']} ({node['gpu']['memory_gib']:g} GiB usable each); "
             f"weights {node['weight_bytes']} B, KV {node['kv_bytes']} B a value; a group must hold KV for "
             f"{node['min_kv_tokens']:,} tokens",
             f"workload: {result['workload']}",
             f"SLO: TTFT <= {slo['ttft_s']:g} s{per_tok}, TPOT <= {slo['tpot_s'] * 1000:g} ms, "
             f"for {slo['target']:.0%} of requests (P90s below: at the predicted goodput)",
             "per degree: weights per rank, and the KV a group holds or why it cannot run"]
    for t, d in result["degrees"].items():
        lines.append(f"  TP{t:<2} " + (f"{d['weight_gib']:6.1f} GiB  {d['kv_tokens']:>10,} tokens" if not d["reason"]
                                      else d["reason"]))
    lines.append("")
    head = (f"{'#':>3} {'prefill':<10} {'decode':<9} {'GPUs':>4} {'goodput (req/s)':>15} {'per GPU':>8} "
            f"{'TTFT p90':>9} {'TPOT p90':>9}  binds")
    lines += [head, "-" * len(head)]
    rows = result["ranked"][:top] if top else result["ranked"]
    for i, r in enumerate(rows, 1):
        g = {"below_min": "< 0.01", "at_max": f">= {r['goodput']:.2f}"}.get(r["status"], f"{r['goodput']:.2f}")
        ttft = "-" if r["ttft_p90_s"] is None else f"{r['ttft_p90_s']:.2f} s"
        tpot = "-" if r["tpot_p90_s"] is None else f"{r['tpot_p90_s'] * 1000:.0f} ms"
        lines.append(f"{i:>3} {r['prefill']:<10} {r['decode']:<9} {r['num_gpus']:>4} {g:>15} "
                     f"{r['goodput_per_gpu']:>8.2f} {ttft:>9} {tpot:>9}  {r['binds'] or '-'}")
    if top and len(result["ranked"]) > top:
        lines.append(f"    ... {len(result['ranked']) - top} more (--top 0 for all)")
    if result["rejected"]:
        lines += ["", f"rejected: {len(result['rejected'])} layouts, each with a group that cannot run:"]
        by_reason: dict[str, list[str]] = {}
        for r in result["rejected"]:
            by_reason.setdefault(r["reason"], []).append(r["name"])
        for why, names in by_reason.items():
            shown = ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")
            lines.append(f"  {shown}: {why}")
    if result["ranked"]:
        best = result["ranked"][0]
        lines += ["", f"recommended: {best['name']}", "[devices]", *best["devices"]]
    lines += ["", "why:", *(f"  - {sentence}." for sentence in result["reason"])]
    return lines
