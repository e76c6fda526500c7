"""Per-device timeline of a nodeserve run, from the server's own step records (GET /debug/steps).

Each device's worker records every step as [start, end, prefill tokens, decodes] in the server's monotonic
clock; each KV transfer records every copy as [start, end, bytes]. This module turns one such snapshot into
labelled intervals on a common axis (seconds since the run started, in the server's clock):

- a step with prefill tokens and decodes is ``mixed``, with only prefill tokens ``prefill``, with only decodes
  ``decode`` (a step with neither cannot happen; it would count as ``idle``);
- the gaps between a device's steps, and before its first and after its last step inside the window, are
  ``idle``;
- each transfer gets its own row of ``transfer`` intervals;
- in adaptive mode, a strip over each device's row shows its role (``role_spans``, from the role changes).

The busy share of a row is the time covered by its non-idle intervals over the window length, also split by
kind. The parsing, classification and shares are pure (tested on synthetic records in
tests/bench/test_timeline.py); `fetch` and `plot` do the I/O.

    python bench/timeline.py --url http://127.0.0.1:8000 --since 1234.5 --out timeline.png
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from dataclasses import dataclass, field

KINDS = ("prefill", "decode", "mixed", "transfer", "idle")
COLORS = {"prefill": "tab:orange", "decode": "tab:blue", "mixed": "tab:purple", "transfer": "tab:green",
          "idle": "#eeeeee"}
ROLE_COLORS = {"adaptive": "tab:gray", "prefill": "tab:red"}


@dataclass(frozen=True)
class Interval:
    start: float  # seconds since the window start
    end: float
    kind: str     # one of KINDS


@dataclass
class Row:
    """One row of the timeline: a device (label "cpu:0 (prefill)") or a transfer ("kv cpu:0->cpu:1")."""

    label: str
    intervals: list[Interval] = field(default_factory=list)


def classify(num_prefill_tokens: int, num_decodes: int) -> str:
    """The kind of one step: mixed, prefill, decode (idle if it did nothing)."""
    if num_prefill_tokens > 0 and num_decodes > 0:
        return "mixed"
    if num_prefill_tokens > 0:
        return "prefill"
    if num_decodes > 0:
        return "decode"
    return "idle"


def _clip(start: float, end: float, t0: float, t1: float) -> tuple[float, float] | None:
    s, e = max(start, t0), min(end, t1)
    return (s, e) if e > s else None


def busy_intervals(spans: list[tuple[float, float, str]], t0: float, t1: float) -> list[Interval]:
    """Spans (start, end, kind) in server time, clipped to [t0, t1] and shifted to start at 0, sorted, with
    the gaps between them filled by idle intervals. Overlapping spans (transfer copies may overlap) are kept
    as they are; the idle fill only covers time no span covers."""
    out: list[Interval] = []
    cursor = t0
    for start, end, kind in sorted(spans):
        c = _clip(start, end, t0, t1)
        if c is None:
            continue
        s, e = c
        if s > cursor:
            out.append(Interval(cursor - t0, s - t0, "idle"))
        out.append(Interval(s - t0, e - t0, kind))
        cursor = max(cursor, e)
    if t1 > cursor:
        out.append(Interval(cursor - t0, t1 - t0, "idle"))
    return out


def parse(snapshot: dict, t0: float, t1: float | None = None) -> list[Row]:
    """Rows for every device and every transfer in a /debug/steps snapshot, over [t0, t1] (server clock;
    t1 defaults to the snapshot's "now")."""
    t1 = snapshot["now"] if t1 is None else t1
    if t1 < t0:
        raise ValueError(f"window ends ({t1}) before it starts ({t0})")
    rows = []
    for dev in snapshot.get("devices", ()):
        spans = [(s, e, classify(p, d)) for s, e, p, d in dev["steps"]]
        rows.append(Row(f"{dev['device']} ({dev['role']})", busy_intervals(spans, t0, t1)))
    for tr in snapshot.get("transfers", ()):
        spans = [(s, e, "transfer") for s, e, _ in tr["copies"]]
        rows.append(Row(tr["name"], busy_intervals(spans, t0, t1)))
    return rows


def role_spans(snapshot: dict, t0: float, t1: float) -> dict[str, list[tuple[float, float, str]]]:
    """Adaptive mode: each device's roles over [t0, t1] as (start, end, role), seconds since t0, from the
    snapshot's role changes ([time, device, role, reason]). A device alternates between "adaptive" and
    "prefill", so its role before its first change in the window is the other one; a device with no change
    keeps the role the snapshot gives it."""
    out = {}
    for dev in snapshot.get("devices", ()):
        changes = [(t, r) for t, d, r, _ in snapshot.get("role_changes", ()) if d == dev["device"] and t <= t1]
        role = ({"prefill": "adaptive", "adaptive": "prefill"}[changes[0][1]] if changes else dev["role"])
        spans, cursor = [], t0
        for t, r in changes:
            if t > cursor:
                spans.append((cursor - t0, t - t0, role))
            cursor, role = max(cursor, t), r
        spans.append((cursor - t0, t1 - t0, role))
        out[dev["device"]] = spans
    return out


def _union_length(intervals: list[Interval]) -> float:
    total, cursor = 0.0, float("-inf")
    for iv in sorted(intervals, key=lambda i: i.start):
        s = max(iv.start, cursor)
        if iv.end > s:
            total += iv.end - s
        cursor = max(cursor, iv.end)
    return total


def busy_shares(row: Row) -> dict:
    """{"busy": share of the window covered by non-idle intervals, "<kind>": share of each kind} (shares of
    the row's window, i.e. from its first interval's start to its last one's end). Overlaps count once."""
    if not row.intervals:
        return {"busy": 0.0}
    span = max(i.end for i in row.intervals) - min(i.start for i in row.intervals)
    if span <= 0:
        return {"busy": 0.0}
    work = [i for i in row.intervals if i.kind != "idle"]
    out = {"busy": _union_length(work) / span}
    for kind in KINDS[:-1]:
        of_kind = [i for i in work if i.kind == kind]
        if of_kind:
            out[kind] = _union_length(of_kind) / span
    return out


def summary(rows: list[Row]) -> dict:
    """{row label: busy shares}, for results files."""
    return {r.label: busy_shares(r) for r in rows}


def _pcts(xs: list[float], scale: float = 1e3, unit: str = "_ms") -> dict:
    """{"n", "p50<unit>", "p99<unit>", "max<unit>"} of xs times scale (seconds to ms by default)."""
    if not xs:
        return {"n": 0}
    xs = sorted(xs)
    return {"n": len(xs), **{f"{q}{unit}": xs[min(len(xs) - 1, int(f * len(xs)))] * scale
                             for q, f in (("p50", 0.5), ("p99", 0.99))}, f"max{unit}": xs[-1] * scale}


def step_stats(snapshot: dict, t0: float) -> dict:
    """Per device, over the steps from t0 on: step times by kind (ms percentiles), the prompt tokens its mixed
    steps took, and the time between one step's end and the next one's start (lending, waiting for work):
    what a decode device's inter-token gap is made of."""
    out = {}
    for dev in snapshot.get("devices", ()):
        steps = sorted(tuple(x) for x in dev["steps"] if x[0] >= t0)
        by_kind: dict[str, list[float]] = {}
        for s, e, p, d in steps:
            by_kind.setdefault(classify(p, d), []).append(e - s)
        mixed = [p for _, _, p, d in steps if p > 0 and d > 0]
        between = [b[0] - a[1] for a, b in zip(steps, steps[1:]) if a[3] > 0 and b[3] > 0]
        out[f"{dev['device']} ({dev['role']})"] = {
            **{k: _pcts(v) for k, v in by_kind.items()},
            "mixed_prompt_tokens": _pcts([float(p) for p in mixed], 1.0, ""),
            "between_decode_steps": _pcts(between)}
    return out


# ---- I/O --------------------------------------------------------------------------------------------------

def fetch(url: str, since: float = 0.0, timeout: float = 30.0) -> dict:
    """GET /debug/steps?since=... from a nodeserve server."""
    # fixed-point: repr(1e18) would put a '+' in the query string, which decodes as a space
    with urllib.request.urlopen(f"{url.rstrip('/')}/debug/steps?since={since:.6f}", timeout=timeout) as r:
        return json.load(r)


def server_now(url: str) -> float:
    """The server's monotonic clock now: a snapshot filtered to nothing, for its "now"."""
    return fetch(url, since=1e18)["now"]


def plot(rows: list[Row], path: str, title: str = "", roles: dict | None = None) -> str:
    """One broken_barh row per device / transfer, coloured by kind, x = seconds since the window start; with
    `roles` (role_spans), a strip over each device's row shows its role (adaptive mode)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    height = 1.4 + 0.7 * max(1, len(rows))
    fig, ax = plt.subplots(figsize=(14, height))
    for y, row in enumerate(reversed(rows)):
        for kind in KINDS:
            bars = [(i.start, i.end - i.start) for i in row.intervals if i.kind == kind]
            if bars:
                ax.broken_barh(bars, (y - 0.35, 0.55), facecolors=COLORS[kind], linewidth=0)
        for role, color in ROLE_COLORS.items():
            spans = [(s, e - s) for s, e, r in (roles or {}).get(row.label.split(" ")[0], ()) if r == role]
            if spans:
                ax.broken_barh(spans, (y + 0.24, 0.14), facecolors=color, linewidth=0)
    labels = []
    for row in reversed(rows):
        sh = busy_shares(row)
        labels.append(f"{row.label}\nbusy {sh['busy'] * 100:.0f} %")
    ax.set_yticks(range(len(rows)), labels)
    end = max((i.end for r in rows for i in r.intervals), default=1.0)
    ax.set_xlim(0, end)
    ax.set_xlabel("seconds since run start (server clock)")
    # the legend sits in its own strip under the axis label
    handles = [Patch(color=COLORS[k], label=k) for k in KINDS]
    if roles:
        handles += [Patch(color=c, label=f"role: {r}") for r, c in ROLE_COLORS.items()]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False)
    if title:
        ax.set_title(title)
    fig.tight_layout(rect=(0, 0.4 / height, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_snapshot(snapshot: dict, path: str, title: str = "") -> str:
    """The whole snapshot (from its first step to its "now"), with the devices' roles."""
    t0 = min((s[0] for d in snapshot["devices"] for s in d["steps"]), default=snapshot["now"])
    return plot(parse(snapshot, t0), path, title, role_spans(snapshot, t0, snapshot["now"]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--since", type=float, default=0.0, help="window start, server monotonic seconds (0: all)")
    ap.add_argument("--out", default="timeline.png")
    args = ap.parse_args()
    snap = fetch(args.url, args.since)
    t0 = args.since or min((s[0] for d in snap["devices"] for s in d["steps"]), default=snap["now"])
    rows = parse(snap, t0)
    roles = role_spans(snap, t0, snap["now"]) if snap.get("role_changes") else None
    for label, sh in summary(rows).items():
        print(f"{label:<28} " + "  ".join(f"{k} {v * 100:5.1f} %" for k, v in sh.items()))
    print(f"-> {plot(rows, args.out, roles=roles)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
