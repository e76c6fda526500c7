"""The first processor's fields in /proc/cpuinfo: one reader for what the kernels' build key, their prefetch choice,
a build's fitness for this CPU, the CPU devices' bf16 check and `nodeserve devices` ask of it."""

from __future__ import annotations

IDENTITY = ("vendor_id", "cpu family", "model", "model name")  # a VM may name Zen 3 and Zen 4 alike "AMD EPYC"


def first_processor(path: str = "/proc/cpuinfo") -> dict[str, str]:
    """Field -> value of the first processor's block; {} where there is no such file (not Linux)."""
    fields: dict[str, str] = {}
    try:
        with open(path) as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def identity(fields: dict[str, str]) -> str:
    """Vendor, family, model and model name, e.g. "AuthenticAMD / 25 / 17 / AMD EPYC"."""
    return " / ".join(fields.get(k, "?") for k in IDENTITY)


def isa_flags(fields: dict[str, str]) -> frozenset[str] | None:
    """Its ISA extensions by /proc/cpuinfo's names (x86 "flags", Arm "Features"); None where the file has neither."""
    line = fields.get("flags", fields.get("Features"))
    return None if line is None else frozenset(line.split())
