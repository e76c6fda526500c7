"""The `nodeserve` command: run, check-config, devices, plan."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import NoReturn

from nodeserve import __version__


def _load_config(path: str, prefix: str, args: argparse.Namespace | None = None):
    """The validated config (file, NODESERVE_* variables, then command-line overrides), or None after printing
    the one-line reason."""
    from nodeserve.config import ConfigError, load_config

    overrides: dict = {}
    for flag, section, key in (("host", "server", "host"), ("port", "server", "port"), ("model", "model", "path")):
        value = getattr(args, flag, None)
        if value is not None:
            overrides.setdefault(section, {})[key] = value
    try:
        return load_config(path, overrides=overrides)
    except ConfigError as e:
        print(f"{prefix}{e}", file=sys.stderr)
        return None


STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def _end_process(code: int) -> NoReturn:
    """Flushes the logs and ends the process without the interpreter's shutdown. A stop during start-up leaves the
    load, warm-up or profile threads running torch code; at shutdown CPython (before 3.14) ends such daemon threads
    with pthread_exit as they wake for the GIL, which unwinds through torch's C++ frames and aborts (SIGABRT, a
    core dump for systemd). By now serve() has stopped and joined everything that holds data."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _stop_before_serving(notifier) -> None:
    """SIGTERM / SIGINT before serve() has its own handlers (config, re-exec, imports): nothing is running yet, so
    tell systemd and end with 0. The signals stay blocked across the jemalloc re-exec and are unblocked once this
    is in place, so a stop at any moment of start-up ends here or in serve()'s drain, never by the default action."""
    def on_signal(signum, frame) -> None:
        notifier.stopping()
        _end_process(0)

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _cmd_run(args: argparse.Namespace) -> int:
    from nodeserve.server.systemd import Notifier

    notifier = Notifier.from_env()
    _stop_before_serving(notifier)
    notifier.status("starting")
    return _end_process(_run(args))


def _run(args: argparse.Namespace) -> int:
    from nodeserve.config import ConfigError
    from nodeserve.model.config import LoadError
    from nodeserve.runtime import memory

    config = _load_config(args.config, "nodeserve: config error: ", args)
    if config is None:
        return 2
    try:
        env = memory.jemalloc_environ(config.server.allocator, os.environ, memory.find_jemalloc())
    except ConfigError as e:
        print(f"nodeserve: config error: {e}", file=sys.stderr)
        return 2
    if env is not None:  # the same command again, jemalloc preloaded: same PID, so systemd sees one service
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # pending until the new image's handlers exist
        os.execve(sys.executable, sys.orig_argv, env)
    if memory.allocator_in_use() == "glibc":
        memory.limit_malloc_arenas()  # before the worker, copy and tokenizer threads exist
        memory.fix_malloc_thresholds()
    from nodeserve.server.serve import run

    try:
        return run(config)
    except LoadError as e:
        print(f"nodeserve: cannot load model: {e}", file=sys.stderr)
        return 1
    except ConfigError as e:  # found only once devices are up, e.g. flashinfer missing on a GPU
        print(f"nodeserve: config error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. the port is taken
        print(f"nodeserve: {e.strerror or e}", file=sys.stderr)
        return 1


def _cmd_check_config(args: argparse.Namespace) -> int:
    config = _load_config(args.config, f"{args.config}: ")
    if config is None:
        return 2
    from nodeserve.model.config import LoadError
    from nodeserve.model.loader import resolve_path

    try:
        model_path = resolve_path(config.model.path)
    except LoadError as e:
        print(f"{args.config}: 'model.path': {e}", file=sys.stderr)
        return 2
    if not os.access(model_path, os.R_OK | (os.X_OK if os.path.isdir(model_path) else 0)):
        print(f"{args.config}: 'model.path': {model_path} is not readable by this user", file=sys.stderr)
        return 2
    d = config.devices
    devices = f"prefill={list(d.prefill)} decode={list(d.decode)}" if d.mode == "disaggregated" \
        else f"devices={list(d.devices)}"
    print(f"{args.config}: OK: model={config.model.path} ({config.dtype}, weights {config.quantization}) "
          f"mode={d.mode} {devices} listen={config.server.host}:{config.server.port}")
    return 0


def _cmd_devices(args: argparse.Namespace) -> int:
    from nodeserve.device.inventory import inventory

    for line in inventory(int(args.mib * 2**20)):
        print(line, flush=True)
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    import json

    from nodeserve.core.cost_model import CostModel
    from nodeserve.plan.planner import format_report, load_workload, plan, workload_from_dict
    from nodeserve.config import ConfigError

    if args.model_config:
        return _cmd_plan_tp(args)
    for flag in ("gpu", "gpus", "min_kv_tokens", "jobs", "top"):
        if getattr(args, flag) is not None:
            print(f"nodeserve plan: --{flag.replace('_', '-')} goes with --model-config", file=sys.stderr)
            return 2
    config = _load_config(args.config or "nodeserve.toml", "nodeserve: config error: ")
    if config is None:
        return 2
    try:
        wl = load_workload(args.workload, config) if args.workload else workload_from_dict({}, config)
        if args.save_profile and not args.measure:
            raise ConfigError("--save-profile saves what --measure measures: give both")
        if args.measure:
            from nodeserve.plan.planner import measure_config

            cost = measure_config(config, args.budget)
            if args.save_profile:  # to plan other workloads later without loading the model again
                with open(args.save_profile, "w") as f:
                    json.dump(cost.as_dict(), f)
        else:
            try:
                with open(args.profile) as f:
                    cost = CostModel.from_dict(json.load(f))
            except (OSError, ValueError) as e:
                raise ConfigError(f"--profile {args.profile}: {e}") from None
        result = plan(config, cost, wl)
    except ConfigError as e:
        print(f"nodeserve plan: {e}", file=sys.stderr)
        return 2
    for line in format_report(result, cost):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


# Without --config, `plan --model-config` plans with the scheduler limits of examples/dgx-h100-8gpu.toml, not the
# CPU defaults (64 sequences, 1,024 tokens a step), and every other setting at its default.
GPU_SCHEDULER = {"max_num_seqs": 256, "max_num_batched_tokens": 8192}


def _cmd_plan_tp(args: argparse.Namespace) -> int:
    """`nodeserve plan --model-config`: every tensor-parallel layout of a node, from the model's shape alone."""
    import json

    from nodeserve.config import ConfigError, config_from_dict, load_config
    from nodeserve.model.config import LoadError, config_from_hf
    from nodeserve.plan.planner import load_workload, workload_from_dict
    from nodeserve.plan.roofline import GPUS
    from nodeserve.plan.tp_planner import SimSettings, default_jobs, format_tp_report, node_spec, plan_tp

    if args.gpu not in GPUS:
        print(f"nodeserve plan: --model-config needs --gpu, one of {', '.join(GPUS)} (got {args.gpu}); another GPU "
              "is a line in nodeserve/plan/roofline.py's GPUS", file=sys.stderr)
        return 2
    if args.save_profile:
        print("nodeserve plan: --save-profile saves what --measure measures; --model-config measures nothing",
              file=sys.stderr)
        return 2
    num_gpus = 8 if args.gpus is None else args.gpus
    jobs = default_jobs() if args.jobs is None else args.jobs
    try:
        if num_gpus < 1 or (args.min_kv_tokens is not None and args.min_kv_tokens < 1) or jobs < 1:
            raise ConfigError("--gpus, --min-kv-tokens and --jobs must be at least 1")
        if args.top is not None and args.top < 0:
            raise ConfigError("--top must be 0 (every row) or more")
        # Planned from a laptop: the config's devices need not be this machine's.
        config = (load_config(args.config, check_devices=False) if args.config
                  else config_from_dict({"scheduler": GPU_SCHEDULER}, check_devices=False))
        model = config_from_hf(args.model_config)
        wl = (load_workload(args.workload, config, default_num_requests=1000) if args.workload
              else workload_from_dict({}, config, default_num_requests=1000))
        node = node_spec(config, model, GPUS[args.gpu], num_gpus, args.min_kv_tokens)
        result = plan_tp(model, node, SimSettings.of(config), wl, jobs=jobs)
    except (ConfigError, LoadError) as e:
        print(f"nodeserve plan: {e}", file=sys.stderr)
        return 2
    for line in format_tp_report(result, args.top if args.top is not None else 20):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nodeserve", description="Single-node LLM server with disaggregated "
                                     "prefill and decode in one process.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="start the server", description="Start the OpenAI-compatible server. "
                       "Settings come from the file, then NODESERVE_<SECTION>_<KEY> environment variables "
                       "(e.g. NODESERVE_SERVER_PORT=8080), then these flags.")
    p.add_argument("--config", default="nodeserve.toml", help="path to nodeserve.toml (default: %(default)s)")
    p.add_argument("--host", help="server.host")
    p.add_argument("--port", type=int, help="server.port")
    p.add_argument("--model", help="model.path: a .gguf file, an HF checkpoint directory or a bundled model name")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=_cmd_run)
    p = sub.add_parser("check-config", help="validate a config file and exit",
                       description="Validate nodeserve.toml; prints what is wrong and how to fix it.")
    p.add_argument("config", help="path to nodeserve.toml")
    p.set_defaults(func=_cmd_check_config)
    p = sub.add_parser("devices", help="list this machine's devices and measure their bandwidth",
                       description="CPU cores and DRAM read bandwidth; per GPU: memory, peer access, copy bandwidth.")
    p.add_argument("--mib", type=float, default=256, help="buffer size for the bandwidth measurements "
                   "(default: %(default)s)")
    p.set_defaults(func=_cmd_devices)
    p = sub.add_parser("plan", help="predict goodput of every device layout for a workload",
                       description="Simulates colocated, every prefill:decode split and adaptive placement on a "
                       "measured cost model and prints the predicted goodput of each and the [devices] section "
                       "it recommends. With --model-config: every tensor-parallel layout of a node of --gpus "
                       "GPUs, on a cost model from the model's shape and the GPU's datasheet (no weights, no GPU "
                       "needed; docs/tensor-parallel-planning.md).")
    p.add_argument("--config", help="its devices, scheduler limits, KV size and [slo] (default: nodeserve.toml; "
                   "with --model-config its scheduler, kv and [slo] settings, and without it the defaults with "
                   "256 sequences and 8,192 tokens a step)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", help="a saved GET /debug/profile answer of a server on these devices")
    src.add_argument("--measure", action="store_true", help="load the model and measure the profile here")
    src.add_argument("--model-config", help="an HF config.json (or the checkpoint directory holding it): plan "
                     "tensor-parallel layouts from the model's shape")
    p.add_argument("--gpu", help="with --model-config: the GPU model (h100-80gb, h200-141gb, a100-80gb)")
    p.add_argument("--gpus", type=int, help="with --model-config: GPUs in the node (default: 8)")
    p.add_argument("--min-kv-tokens", type=int, help="with --model-config: the KV a group must hold besides its "
                   "weights to count as fitting (default: model.max_model_len, else the model's context length)")
    p.add_argument("--jobs", type=int, help="with --model-config: layouts simulated at once (default: one per "
                   "CPU core)")
    p.add_argument("--top", type=int, help="with --model-config: rows of the ranked table to print (default: 20; "
                   "0: all; --json has all)")
    p.add_argument("--budget", type=float, default=5.0, help="seconds of profiling with --measure "
                   "(default: %(default)s)")
    p.add_argument("--save-profile", help="with --measure: also write the measured profile here (for --profile)")
    p.add_argument("--workload", help="a workload TOML (see nodeserve/plan/planner.py); default: bimodal chat")
    p.add_argument("--json", help="also write the predictions to this file")
    p.set_defaults(func=_cmd_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, getattr(args, "log_level", "info").upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
