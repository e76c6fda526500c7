"""Pure statistics for the load generator (bench/serve.py) and `nodeserve plan`: no I/O, no clock, no network.

Definitions (all times in seconds, all measured at the client):

- **TTFT** (time to first token): first content chunk's arrival time minus the time the request was sent.
  A *content chunk* is an SSE data event that carries text (or logprobs); the final chunk that only carries
  `finish_reason`, the usage chunk and `[DONE]` are not content.
- **e2e** (end-to-end latency): time the stream ended (`[DONE]` / connection closed) minus the send time.
- **TPOT** (time per output token after the first): `(e2e - ttft) / (n_out - 1)`, where `n_out` is the
  server's `usage.completion_tokens` (or, when the server sends no usage, the number of content chunks).
  Undefined (None) when `n_out <= 1`.
- **ITL** (inter-token latency): every gap between consecutive content chunks of one request. A server may
  put several tokens in one chunk (e.g. while it holds back an incomplete UTF-8 sequence or a possible stop
  string), so ITL is really the inter-*chunk* gap; TPOT, which divides by the token count, is the per-token
  figure.
- **Percentiles** use linear interpolation between closest ranks, the same as numpy.percentile's default
  (`method="linear"`): for sorted values v[0..n-1] and q in [0, 100], rank r = q/100 * (n-1) and the
  result is v[floor(r)] + (r - floor(r)) * (v[ceil(r)] - v[floor(r)]). The percentile of no values is None.
- **SLO attainment**: the share of requests that met BOTH `ttft <= slo_ttft` and `tpot <= slo_tpot`,
  over every request sent (a failed request — error status, error event, connection error — counts as
  sent and not met, and so does one that got no content chunk). A request with one output token has no
  TPOT and meets the TPOT part trivially (its TTFT must still meet the TTFT SLO).
- **Goodput**: the highest Poisson arrival rate (requests/s) at which attainment >= target, found by
  `goodput_search` (geometric bracketing from `rate_min`, downwards too with `rate_floor`, then bisection to
  a tolerance). It assumes attainment does not increase with the rate; with measurement noise, the answer is
  the highest *probed* rate that met the target inside the final bracket.
- **Machine-derived SLOs** (DistServe's "SLO scale"): one request at a time, the unloaded TTFT of a few
  prompt lengths is fitted as TTFT(len) = a + b * len (`fit_ttft`) and the unloaded TPOT is the median TPOT
  of those requests (`calibrate`). At scale s the SLO is TTFT <= s * (a + b * len) and TPOT <= s * TPOT,
  which is the length-aware SLO above with slo_ttft = s*a, ttft_per_token = s*b, slo_tpot = s*TPOT
  (`DerivedSlo.at`). `best_slo` takes the lowest TTFT fit and the lowest TPOT over the targets calibrated,
  so every target is held to the best this machine showed.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

# Default SLOs for this machine (issue #4): TTFT <= 2.5 s and TPOT <= 100 ms, met by 90 % of requests.
DEFAULT_SLO_TTFT = 2.5
DEFAULT_SLO_TPOT = 0.100
DEFAULT_SLO_TARGET = 0.90

PERCENTILES = (50, 90, 99)


# ---- percentiles ------------------------------------------------------------------------------------------

def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (q in [0, 100]) with linear interpolation (numpy's default); None if no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    v = sorted(values)
    if not v:
        return None
    rank = q / 100 * (len(v) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (rank - lo) * (v[hi] - v[lo])


def distribution(values: Sequence[float], qs: Sequence[float] = PERCENTILES) -> dict:
    """count, mean, min, max and the given percentiles (keys "p50", "p90", ...); None fields if empty."""
    vals = list(values)
    out = {"count": len(vals), "mean": sum(vals) / len(vals) if vals else None,
           "min": min(vals) if vals else None, "max": max(vals) if vals else None}
    for q in qs:
        out[f"p{q:g}"] = percentile(vals, q)
    return out


# ---- per request ------------------------------------------------------------------------------------------

def request_metrics(t_send: float, chunk_times: Sequence[float], t_end: float,
                    completion_tokens: int | None = None) -> dict:
    """TTFT, TPOT, ITLs and e2e of one request from client timestamps.

    t_send: when the request was sent; chunk_times: arrival time of every content chunk, in order; t_end:
    when the stream ended; completion_tokens: usage.completion_tokens (None: count content chunks instead).
    With no content chunk, ttft is None (and so is tpot).
    """
    if any(b < a for a, b in zip(chunk_times, chunk_times[1:])):
        raise ValueError("chunk_times must be non-decreasing")
    n_out = len(chunk_times) if completion_tokens is None else int(completion_tokens)
    e2e = t_end - t_send
    ttft = chunk_times[0] - t_send if chunk_times else None
    itl = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    tpot = (e2e - ttft) / (n_out - 1) if ttft is not None and n_out > 1 else None
    return {"ttft": ttft, "tpot": tpot, "itl": itl, "e2e": e2e, "n_out": n_out, "n_chunks": len(chunk_times)}


# ---- SLO attainment ---------------------------------------------------------------------------------------

def ttft_limit(rec: dict, slo_ttft: float, ttft_per_token: float = 0.0) -> float:
    """The TTFT a request is allowed: slo_ttft, plus ttft_per_token seconds per prompt token when the SLO is
    length-aware (a prefill-bound machine cannot start a 3,000-token prompt in a fixed 2.5 s; see bench/README)."""
    return slo_ttft + ttft_per_token * (rec.get("prompt_len") or 0)


def meets_slo(rec: dict, slo_ttft: float = DEFAULT_SLO_TTFT, slo_tpot: float = DEFAULT_SLO_TPOT,
              ttft_per_token: float = 0.0) -> bool:
    """A request meets the SLO iff it succeeded, its TTFT <= ttft_limit(...) and its TPOT <= slo_tpot (a
    request with no TPOT, i.e. one output token, meets the TPOT part trivially)."""
    if not rec.get("ok", True) or rec.get("ttft") is None:
        return False
    if rec["ttft"] > ttft_limit(rec, slo_ttft, ttft_per_token):
        return False
    tpot = rec.get("tpot")
    return tpot is None or tpot <= slo_tpot


def slo_attainment(records: Sequence[dict], slo_ttft: float = DEFAULT_SLO_TTFT,
                   slo_tpot: float = DEFAULT_SLO_TPOT, ttft_per_token: float = 0.0) -> dict:
    """Share of all requests (failed ones included, as not met) meeting both SLOs; attainment None if none."""
    met = sum(1 for r in records if meets_slo(r, slo_ttft, slo_tpot, ttft_per_token))
    ok = [r for r in records if r.get("ok", True) and r.get("ttft") is not None]
    return {
        "slo_ttft": slo_ttft, "slo_tpot": slo_tpot, "slo_ttft_per_token": ttft_per_token,
        "total": len(records), "met": met,
        "attainment": met / len(records) if records else None,
        "met_ttft": sum(1 for r in ok if r["ttft"] <= ttft_limit(r, slo_ttft, ttft_per_token)),
        "met_tpot": sum(1 for r in ok if r.get("tpot") is None or r["tpot"] <= slo_tpot),
    }


# ---- summary ----------------------------------------------------------------------------------------------

def summarize(records: Sequence[dict], duration: float) -> dict:
    """p50/p90/p99 (plus mean/min/max) of TTFT, TPOT, ITL (every gap of every request, pooled) and e2e over
    the successful requests; request and output-token throughput over `duration` (seconds from the first
    send to the last response's end)."""
    ok = [r for r in records if r.get("ok", True)]
    out_tokens = sum(r.get("n_out") or 0 for r in ok)
    in_tokens = sum(r.get("prompt_tokens") or 0 for r in ok)
    return {
        "requests": len(records), "succeeded": len(ok), "failed": len(records) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else None,
        "output_token_throughput": out_tokens / duration if duration > 0 else None,
        "input_token_throughput": in_tokens / duration if duration > 0 else None,
        "total_output_tokens": out_tokens, "total_input_tokens": in_tokens,
        "ttft": distribution([r["ttft"] for r in ok if r.get("ttft") is not None]),
        "tpot": distribution([r["tpot"] for r in ok if r.get("tpot") is not None]),
        "itl": distribution([g for r in ok for g in r.get("itl") or ()]),
        "e2e": distribution([r["e2e"] for r in ok if r.get("e2e") is not None]),
    }


# ---- goodput search ---------------------------------------------------------------------------------------

@dataclass
class GoodputResult:
    """goodput: the highest probed rate meeting the target (None if even rate_min missed it).
    status: "found" (bracketed and bisected to tol), "below_min" (rate_min misses the target),
    "at_max" (rate_max still meets it: goodput is only a lower bound), "max_probes" (ran out of probes; the
    goodput is the best rate known to meet the target)."""

    goodput: float | None
    status: str
    target: float
    points: list[tuple[float, float]] = field(default_factory=list)  # (rate, attainment) in probe order
    bracket: tuple[float | None, float | None] = (None, None)

    def as_dict(self) -> dict:
        return {"goodput": self.goodput, "status": self.status, "target": self.target,
                "bracket": list(self.bracket),
                "points": [{"rate": r, "attainment": a} for r, a in self.points]}


def goodput_search(measure: Callable[[float], float], rate_min: float, rate_max: float,
                   target: float = DEFAULT_SLO_TARGET, tol: float = 0.1, growth: float = 2.0,
                   max_probes: int = 20, rate_floor: float | None = None, rel_tol: float = 0.0,
                   can_probe: Callable[[float], bool] | None = None) -> GoodputResult:
    """The highest rate in [rate_min, rate_max] (or [rate_floor, rate_max]) whose measured attainment >= target.

    measure(rate) -> attainment in [0, 1] (for a live server: one run at that Poisson rate). Probes
    rate_min; if it misses: without rate_floor, stops ("below_min"); with it, divides the rate by `growth`
    (not below rate_floor) until a rate meets the target, and stops ("below_min") if rate_floor misses too.
    If rate_min meets, brackets upwards by multiplying the rate by `growth` (capped at rate_max) until a rate
    misses; if rate_max still meets, stops ("at_max"). Then bisects the bracket [last meeting, first missing]
    until its width <= max(tol, rel_tol * low end) (req/s). Every probe is recorded; `bracket` is
    (highest rate known to meet, lowest rate known to miss), None where that side is unknown. The search
    stops early ("max_probes") after max_probes probes, or when can_probe(next rate) is false (a time budget).
    """
    if not 0 < rate_min <= rate_max:
        raise ValueError(f"need 0 < rate_min <= rate_max, got {rate_min}, {rate_max}")
    if growth <= 1 or tol < 0 or rel_tol < 0 or (tol == 0 and rel_tol == 0) or max_probes < 1:
        raise ValueError("need growth > 1, tol >= 0, rel_tol >= 0 (one of them > 0), max_probes >= 1")
    if rate_floor is not None and not 0 < rate_floor <= rate_min:
        raise ValueError(f"need 0 < rate_floor <= rate_min, got {rate_floor}, {rate_min}")
    points: list[tuple[float, float]] = []

    def probe(rate: float) -> bool:
        a = measure(rate)
        points.append((rate, a))
        return a is not None and a >= target

    def out_of_probes(rate: float) -> bool:
        return len(points) >= max_probes or (can_probe is not None and not can_probe(rate))

    lo: float | None
    hi: float | None
    if probe(rate_min):
        lo, hi = rate_min, None
    else:
        lo, hi = None, rate_min
        while lo is None:  # downwards: only with a floor
            if rate_floor is None or hi <= rate_floor:
                return GoodputResult(None, "below_min", target, points, (None, hi))
            nxt = max(hi / growth, rate_floor)
            if out_of_probes(nxt):
                return GoodputResult(None, "max_probes", target, points, (None, hi))
            if probe(nxt):
                lo = nxt
            else:
                hi = nxt
    while hi is None:
        if lo >= rate_max:
            return GoodputResult(lo, "at_max", target, points, (lo, None))
        nxt = min(lo * growth, rate_max)
        if out_of_probes(nxt):
            return GoodputResult(lo, "max_probes", target, points, (lo, None))
        if probe(nxt):
            lo = nxt
        else:
            hi = nxt
    while hi - lo > max(tol, rel_tol * lo):
        mid = (lo + hi) / 2
        if out_of_probes(mid):
            return GoodputResult(lo, "max_probes", target, points, (lo, hi))
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return GoodputResult(lo, "found", target, points, (lo, hi))


def bracket_from_points(points: Sequence[tuple[float, float | None]], target: float = DEFAULT_SLO_TARGET
                        ) -> tuple[float, float]:
    """The goodput bracket that probes already run give for a target (e.g. another SLO evaluated on the same
    runs): (highest rate that met it, or 0.0; lowest rate above that which missed it, or inf)."""
    met = [r for r, a in points if a is not None and a >= target]
    lo = max(met, default=0.0)
    hi = min((r for r, a in points if r > lo and (a is None or a < target)), default=math.inf)
    return lo, hi


# ---- machine-derived SLOs ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class LinearFit:
    """y = a + b * x."""

    a: float
    b: float

    def __call__(self, x: float) -> float:
        return self.a + self.b * x


def fit_ttft(prompt_lens: Sequence[float], ttfts: Sequence[float]) -> LinearFit:
    """Least-squares fit of TTFT = a + b * prompt_len with a, b >= 0.

    The constraint keeps a noisy calibration from giving a negative intercept (a TTFT SLO below zero for short
    prompts) or a negative slope. Two unknowns: the constrained optimum is the plain fit if it is feasible,
    else the best of the fits with a = 0 or b = 0 (the objective is convex).
    """
    xs, ys = [float(x) for x in prompt_lens], [float(y) for y in ttfts]
    if len(xs) != len(ys):
        raise ValueError("prompt_lens and ttfts differ in length")
    if len(set(xs)) < 2:
        raise ValueError("fitting TTFT needs at least two distinct prompt lengths")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    if a >= 0 and b >= 0:
        return LinearFit(a, b)
    xx = sum(x * x for x in xs)
    cands = [LinearFit(max(my, 0.0), 0.0), LinearFit(0.0, max(sum(x * y for x, y in zip(xs, ys)) / xx, 0.0))]
    return min(cands, key=lambda f: sum((f(x) - y) ** 2 for x, y in zip(xs, ys)))


@dataclass(frozen=True)
class DerivedSlo:
    """SLOs derived from unloaded latencies: at scale s, TTFT <= s * ttft(prompt_len), TPOT <= s * tpot."""

    ttft: LinearFit
    tpot: float

    def at(self, scale: float) -> tuple[float, float, float]:
        """(slo_ttft, slo_tpot, ttft_per_token) for slo_attainment / meets_slo at this scale."""
        return scale * self.ttft.a, scale * self.tpot, scale * self.ttft.b

    def as_dict(self) -> dict:
        return {"ttft_a": self.ttft.a, "ttft_b": self.ttft.b, "tpot": self.tpot}

    @classmethod
    def from_dict(cls, d: dict) -> DerivedSlo:
        return cls(LinearFit(d["ttft_a"], d["ttft_b"]), d["tpot"])


def calibrate(records: Sequence[dict]) -> DerivedSlo:
    """The unloaded SLO basis from calibration records (one request at a time, prompts of a few lengths):
    the TTFT fit over every successful request and the median of their TPOTs."""
    ok = [r for r in records if r.get("ok", True) and r.get("ttft") is not None]
    tpots = [r["tpot"] for r in ok if r.get("tpot") is not None]
    if not tpots:
        raise ValueError("calibration has no request with a TPOT (every one failed or made one token)")
    return DerivedSlo(fit_ttft([r["prompt_len"] for r in ok], [r["ttft"] for r in ok]), statistics.median(tpots))


def best_slo(slos: dict[str, DerivedSlo], prompt_lens: Sequence[float]) -> tuple[DerivedSlo, dict]:
    """The best unloaded behaviour over the targets: the TTFT fit with the lowest mean over `prompt_lens` (the
    workload's prompts) and the lowest TPOT, possibly from two targets; returns it and where each came from."""
    if not slos:
        raise ValueError("no calibrated target")
    lens = list(prompt_lens) or [0.0]
    ttft_from = min(slos, key=lambda k: sum(slos[k].ttft(x) for x in lens))
    tpot_from = min(slos, key=lambda k: slos[k].tpot)
    return DerivedSlo(slos[ttft_from].ttft, slos[tpot_from].tpot), {"ttft_from": ttft_from, "tpot_from": tpot_from}


def attainment_vs_scale(records: Sequence[dict], slo: DerivedSlo, scales: Sequence[float]) -> list[dict]:
    """slo_attainment of the same records at each SLO scale."""
    return [{"scale": s, **slo_attainment(records, *slo.at(s))} for s in scales]


def unloaded_service_time(slo: DerivedSlo, requests: Sequence[tuple[int, int]]) -> float:
    """Mean unloaded latency (fitted TTFT + (max_tokens - 1) * TPOT) of (prompt_len, max_tokens) requests: its
    inverse is the rate that keeps a one-request-at-a-time server busy, where a goodput search starts."""
    if not requests:
        raise ValueError("no requests")
    return sum(slo.ttft(p) + max(m - 1, 0) * slo.tpot for p, m in requests) / len(requests)
