"""The `nodeserve` command: run, check-config, devices."""

from __future__ import annotations

import argparse
import logging
import sys


def _load_config(path: str, prefix: str):
    """The validated config, or None after printing the one-line reason."""
    from nodeserve.config import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as e:
        print(f"{prefix}{e}", file=sys.stderr)
        return None


def _cmd_run(args: argparse.Namespace) -> int:
    from nodeserve.config import ConfigError
    from nodeserve.model.config import LoadError

    config = _load_config(args.config, "nodeserve: config error: ")
    if config is None:
        return 2
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
    d = config.devices
    devices = f"prefill={list(d.prefill)} decode={list(d.decode)}" if d.mode == "disaggregated" \
        else f"devices={list(d.devices)}"
    print(f"{args.config}: OK: model={config.model.path} ({config.dtype}) mode={d.mode} {devices} "
          f"listen={config.server.host}:{config.server.port}")
    return 0


def _cmd_devices(args: argparse.Namespace) -> int:
    from nodeserve.device.inventory import inventory

    for line in inventory(int(args.mib * 2**20)):
        print(line, flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nodeserve", description="Single-node LLM server with disaggregated "
                                     "prefill and decode in one process.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="start the server", description="Start the OpenAI-compatible server.")
    p.add_argument("--config", default="nodeserve.toml", help="path to nodeserve.toml (default: %(default)s)")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, getattr(args, "log_level", "info").upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
