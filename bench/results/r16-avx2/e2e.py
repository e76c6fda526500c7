"""One-off: single-stream and 32-stream decode tok/s (bench/compare.py's phases 1 and 2, FULL plan) of one
nodeserve server whose code comes from CODE, with the avx2 class environment (compare.CPU_CLASS_ENV)."""
import json, os, sys, tempfile, time
sys.path.insert(0, "/work/wt/avx2/bench")
import compare as C
from local_server import start_server

code, mode, out = sys.argv[1], sys.argv[2], sys.argv[3]
env = {**os.environ, **C.CPU_CLASS_ENV["avx2"], "PYTHONPATH": code}
res = {"code": code, "mode": mode, "env": C.CPU_CLASS_ENV["avx2"], "load_before": os.getloadavg()}
with tempfile.TemporaryDirectory() as tmp:
    log = os.path.join(tmp, "server.log")
    proc, url = start_server(mode, "auto", tmp, log, kv_extra="prefix_cache = false", env=env)
    try:
        res["kernels"] = C.kernels_lines(log)
        r = C.Runner(url, C.FULL, 0, (2.5, 0.1, 0.9), None, {}, 0.0)
        r.warmup()
        s = r.single()
        tpot = s["summary"]["tpot"]["p50"]
        res["single_tok_s"] = 1 / tpot
        c = r.concurrent()
        res["conc32_tok_s"] = c["summary"]["output_token_throughput"]
    finally:
        C._stop(proc)
res["load_after"] = os.getloadavg()
print(json.dumps(res))
with open(out, "a") as f:
    f.write(json.dumps(res) + "\n")
