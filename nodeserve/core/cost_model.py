"""Cost model: how long one step takes on each device, and how long a request's KV takes to move between two.

A step's time is linear in seven features (`StepShape.features`):

    t = c_step + c_tok * prefill_tokens + c_attn * prefill_pairs + c_dec * num_decodes + c_ctx * decode_context
        + c_pass * row_passes + c_gemm * gemm

prefill_pairs counts the query-key pairs the prefill chunks attend (a chunk of n tokens after s cached ones
attends n * (s + n / 2)), decode_context the tokens the decode rows attend. Weights and activations cost per
token, attention per pair, so the model holds from a 16-token chunk to a 1,024-token one and from batch 1 to
max_num_seqs. The last two follow how the linear layers run the step's M = prefill_tokens + num_decodes rows
(`LinearKernels`): block-quantized weights take up to 32 rows in passes of 8 over the weights (row_passes =
ceil(M / 8)), more rows as one dequantize + GEMM (gemm = 1), whose fixed cost a 50-token prefill pays as much as
a 500-token one; measured on the 2-core EPYC, decode steps of 9 rows take 79 ms where 8 take 58 ms, and a
purely per-token model put a 50-token prefill at 205 ms (measured 274) and a 226-token one at 909 ms (756).
Fitted by least squares with non-negative coefficients (a noisy profile must not predict a negative time), each
sample weighted by 1 / its time so short decode steps count as much as long prefills.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

FEATURES = ("step", "prefill_tokens", "prefill_pairs", "decodes", "decode_context", "row_passes", "gemm")
MAX_ONLINE_SAMPLES = 512  # per device: recent step records kept next to the start-up profile's samples


@dataclass(frozen=True)
class LinearKernels:
    """How a device's linear layers run a step's rows: up to max_gemv_rows rows in passes of rows_per_pass over the
    weights, more as one GEMM (model/block_quant.py). The default, 0: always a GEMM (dense weights)."""

    max_gemv_rows: int = 0
    rows_per_pass: int = 1

    def __post_init__(self) -> None:
        if self.max_gemv_rows < 0 or self.rows_per_pass < 1:
            raise ValueError(f"linear kernels need max_gemv_rows >= 0 and rows_per_pass >= 1, got {self}")


@dataclass(frozen=True)
class StepShape:
    """What one step computes: prefill chunks (tokens and attended pairs) and decode rows (count, context)."""

    num_prefill_tokens: int = 0
    prefill_pairs: float = 0.0
    num_decodes: int = 0
    decode_context: float = 0  # a count, fractional where a prediction spreads a device's total over its rows

    @staticmethod
    def of(chunks: Iterable[tuple[int, int]] = (), decode_contexts: Iterable[float] = ()) -> StepShape:
        """chunks: (num_tokens, num_cached_tokens) per prefill chunk; decode_contexts: tokens each decode attends."""
        chunks, ctx = list(chunks), list(decode_contexts)
        return StepShape(sum(n for n, _ in chunks), sum(n * (s + n / 2) for n, s in chunks), len(ctx), sum(ctx))

    @property
    def empty(self) -> bool:
        return self.num_prefill_tokens == 0 and self.num_decodes == 0

    def row(self) -> list[float]:
        """The shape as a sample stores it: [1, prefill tokens, pairs, decodes, decode context]."""
        return [1.0, float(self.num_prefill_tokens), float(self.prefill_pairs), float(self.num_decodes),
                float(self.decode_context)]

    @staticmethod
    def from_row(row: Sequence[float]) -> StepShape:
        return StepShape(int(row[1]), float(row[2]), int(row[3]), int(row[4]))

    def features(self, kernels: LinearKernels = LinearKernels()) -> list[float]:
        """row() and the linear kernels' two: passes over the weights, or 1 for the switch to a GEMM (both 0 on a
        device that always runs a GEMM: its cost is then the step's and the tokens')."""
        m = self.num_prefill_tokens + self.num_decodes
        if not kernels.max_gemv_rows:
            return [*self.row(), 0.0, 0.0]
        small = m <= kernels.max_gemv_rows
        return [*self.row(), float(-(-m // kernels.rows_per_pass)) if small else 0.0, 0.0 if small else 1.0]


def fit_nonnegative(xs: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Least squares of ys ~ xs @ c with c >= 0 and relative weights (each row divided by its y).

    Active set (Lawson-Hanson, simplified): solve, pin the most negative coefficient at 0, re-solve the rest;
    five features need at most five rounds. Hand-written because it is ten lines; scipy is not a dependency.
    """
    x = np.asarray(xs, dtype=np.float64).reshape(len(xs), -1)        # [N, F]
    y = np.asarray(ys, dtype=np.float64)                              # [N]
    w = 1.0 / np.maximum(y, 1e-6)
    x, y = x * w[:, None], y * w                                      # rows scaled to relative error
    scale = np.maximum(np.abs(x).max(0, initial=0.0), 1e-12)          # [F]: columns to unit size, for conditioning
    active = [j for j in range(x.shape[1]) if np.abs(x[:, j]).sum() > 0]  # a feature never seen stays at 0
    coef = np.zeros(x.shape[1], dtype=np.float64)
    while active:
        sol = np.linalg.lstsq(x[:, active] / scale[active], y, rcond=None)[0]  # LAPACK gelsd, as before
        sol = sol / scale[active]
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(sol.argmin()))
    return coef.tolist()


@dataclass
class StepModel:
    """One device's step-time model and the samples it was fitted from."""

    coef: list[float] = field(default_factory=lambda: [0.0] * len(FEATURES))
    profile_samples: list[tuple[list[float], float]] = field(default_factory=list)   # (StepShape.row, seconds)
    online_samples: deque[tuple[list[float], float]] = field(default_factory=lambda: deque(maxlen=MAX_ONLINE_SAMPLES))
    rel_error: float | None = None  # RMS relative error of the fit over its samples
    kernels: LinearKernels = LinearKernels()

    def __post_init__(self) -> None:
        self.coef = list(self.coef) + [0.0] * (len(FEATURES) - len(self.coef))  # a shorter list: the rest are 0

    @property
    def samples(self) -> list[tuple[list[float], float]]:
        return self.profile_samples + list(self.online_samples)

    def add(self, shape: StepShape, seconds: float, online: bool = False) -> None:
        if shape.empty or not seconds > 0:
            return
        (self.online_samples.append if online else self.profile_samples.append)((shape.row(), seconds))

    def refit(self) -> None:
        samples = self.samples
        if len(samples) < 2:
            return
        xs = [StepShape.from_row(r).features(self.kernels) for r, _ in samples]
        self.coef = fit_nonnegative(xs, [s for _, s in samples])
        errs = [(self._dot(f) - s) / s for f, (_, s) in zip(xs, samples)]
        self.rel_error = math.sqrt(sum(e * e for e in errs) / len(errs))

    def _dot(self, features: Sequence[float]) -> float:
        return sum(c * f for c, f in zip(self.coef, features))

    def step_time(self, shape: StepShape) -> float:
        """Seconds one step of this shape takes; 0 for a step with nothing in it."""
        return 0.0 if shape.empty else max(self._dot(shape.features(self.kernels)), 0.0)

    def as_dict(self) -> dict[str, Any]:
        return {"coefficients": dict(zip(FEATURES, self.coef)), "rel_error": self.rel_error,
                "linear_kernels": [self.kernels.max_gemv_rows, self.kernels.rows_per_pass],
                "num_profile_samples": len(self.profile_samples), "num_online_samples": len(self.online_samples),
                "samples": [[*r, s] for r, s in self.samples]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepModel:
        saved = d["coefficients"]
        rows = [(list(map(float, r[:5])), float(r[-1])) for r in d.get("samples", [])]
        num_profile = int(d.get("num_profile_samples", len(rows)))
        m = cls([float(saved.get(k, 0.0)) for k in FEATURES], rows[:num_profile],
                deque(rows[num_profile:], maxlen=MAX_ONLINE_SAMPLES), d.get("rel_error"),
                LinearKernels(*map(int, d.get("linear_kernels", (0, 1)))))
        if any(k not in saved for k in FEATURES):  # saved before a feature existed: fitted again from its samples
            m.refit()
        return m


@dataclass
class CostModel:
    """Step models per device, KV copy bandwidth per ordered device pair, and the KV bytes a token takes."""

    devices: dict[str, StepModel] = field(default_factory=dict)
    copy_bandwidth: dict[tuple[str, str], float] = field(default_factory=dict)  # bytes/s
    kv_bytes_per_token: int = 0
    num_layers: int = 1

    def step_time(self, device: str, shape: StepShape) -> float:
        return self.devices[device].step_time(shape)

    def transfer_time(self, src: str, dst: str, num_tokens: int) -> float:
        """Seconds to copy num_tokens tokens of KV from src to dst (0 on the same device or without a measure)."""
        bw = self.copy_bandwidth.get((src, dst))
        return 0.0 if src == dst or not bw else num_tokens * self.kv_bytes_per_token / bw

    def transfer_tail(self, src: str, dst: str, num_tokens: int, prefill_seconds: float) -> float:
        """What the handoff adds after the prefill ends: layers are copied while later layers compute, so only
        the last layer's copy, or whatever of the whole copy outlasts the prefill, is left."""
        whole = self.transfer_time(src, dst, num_tokens)
        return max(whole / self.num_layers, whole - prefill_seconds)

    def as_dict(self) -> dict[str, Any]:
        return {"features": list(FEATURES), "kv_bytes_per_token": self.kv_bytes_per_token,
                "num_layers": self.num_layers,
                "devices": {name: m.as_dict() for name, m in self.devices.items()},
                "copy_bandwidth": [{"src": s, "dst": d, "bytes_per_s": bw}
                                   for (s, d), bw in self.copy_bandwidth.items()]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostModel:
        """The inverse of as_dict (a saved /debug/profile answer). Raises ValueError on a malformed one."""
        try:
            return cls({name: StepModel.from_dict(m) for name, m in d["devices"].items()},
                       {(c["src"], c["dst"]): float(c["bytes_per_s"]) for c in d.get("copy_bandwidth", [])},
                       int(d.get("kv_bytes_per_token", 0)), int(d.get("num_layers", 1)))
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise ValueError(f"not a nodeserve profile (GET /debug/profile): {e!r}") from None
