"""examples/: the Grafana dashboard queries only metrics nodeserve exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from nodeserve.metrics import Metrics, PoolStats

GRAFANA = Path(__file__).resolve().parents[1] / "examples" / "grafana"


def test_every_dashboard_query_names_an_exported_metric():
    m = Metrics("smol")
    m.set_state_source(lambda: [PoolStats("cpu:0", "prefill", 10, 10, 0, 0), PoolStats("cpu:1", "decode", 3, 10, 1, 0)])
    m.observe_transfer(0.001, 4096)
    exported = {s.name for f in text_string_to_metric_families(generate_latest(m.registry).decode()) for s in f.samples}
    dashboard = json.loads((GRAFANA / "nodeserve-dashboard.json").read_text())
    queried = {name for panel in dashboard["panels"] for t in panel["targets"]
               for name in re.findall(r"nodeserve:[a-z0-9_]+", t["expr"])}
    assert len(queried) >= 15
    assert queried <= exported, sorted(queried - exported)
