"""nodeserve.toml: frozen config dataclasses and a strict loader whose errors name the key and the fix."""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """The config is invalid; the message names the key and how to fix it."""


FLASHINFER_FLOAT32 = ("'devices.attention' = \"flashinfer\" with a float32 model: FlashInfer has no float32 kernels; "
                      "set model.dtype = \"bfloat16\" (or \"auto\"), or devices.attention = \"torch\"")


@dataclass(frozen=True)
class ModelSection:
    path: str = "smollm2-135m-instruct"   # a .gguf file, an HF checkpoint dir, or a bundled model name
    name: str = ""                        # the served model id; defaults to the path's base name
    dtype: str = "auto"                   # auto | float32 | bfloat16 | float16 (auto: bf16 where the hardware has it)
    max_model_len: int = 0                # 0: the checkpoint's context length
    # auto | none | int8 | int4 | fp16: CPU weight formats, float32 compute (model/block_quant.py, model/quant.py)
    quantization: str = "auto"
    # auto | int16 | int8 | bf16: how the projections of prompt tokens on block-quantized weights multiply (AVX-512
    # VNNI kernels): activations rounded per block of 32 to int16 or int8 (llama.cpp's), or bf16 products over
    # weights dequantized once a call (AVX512-BF16). auto: bf16 where the CPU has it, else int16. Decode rows
    # take decode_activations
    prompt_activations: str = "auto"
    # auto | int16 | int8: how the step's decode rows (and speculation's verify rows, which must round alike)
    # multiply on Q4_0/Q4_1 weights in the integer kernels. int8: llama.cpp's rounding, ~1.2x a batched step, less
    # close to the float32 reference than int16 (still closer than llama.cpp). auto: int8 on CPUs whose integer
    # kernels are AVX2's (no VNNI), int16 elsewhere (docs/performance.md "Decode activations")
    decode_activations: str = "auto"
    # auto | float32 | bfloat16: the products in prompt tokens' attention on CPU (csrc/prefill_attn.c, with
    # AVX512-BF16; sums and softmax stay float32). bfloat16: that attention ~1.6x, a 2k prompt ~1.14x on one core.
    # auto: bfloat16 with quantized weights where the CPU has AVX512-BF16, float32 on the exact path
    prompt_attention: str = "auto"
    aliases: tuple[str, ...] = ()         # more model ids clients may send (and /v1/models lists)
    tool_parser: str = "auto"             # auto | hermes | llama3 | none: how the model writes tool calls


@dataclass(frozen=True)
class ServerSection:
    host: str = "127.0.0.1"
    port: int = 8000
    access_log: bool = True               # one line per request: method, path, status, duration, request id
    stats_interval: float = 10.0          # seconds between stats lines in the log; 0: none
    max_waiting: int = 256                # requests queued for pages before new ones get 503
    max_queued_tokens: int = 262_144      # prompt tokens waiting to be prefilled before new requests get 503
    request_timeout: float = 600.0        # seconds a request may run before it is ended with an error (0: never)
    drain_timeout: float = 30.0           # on SIGTERM, seconds in-flight requests get to finish
    api_key: str = ""                     # if set (or NODESERVE_API_KEY is), clients must send Authorization: Bearer
    open_health: bool = True              # /health answers without the API key
    open_metrics: bool = True             # /metrics answers without the API key
    console: bool = True                  # GET / serves the live node console (docs/console.md)
    console_public: bool = False          # allow the console on a non-loopback host without an API key
    open_console: bool = False            # the console's live feed (/debug/events) answers without the API key
    max_tokens_limit: int = 1_000_000     # largest max_tokens a request may ask for
    default_max_tokens: int = 2048        # chat requests that give no max_tokens (rule: core resolve_max_tokens)
    max_n: int = 16
    max_stop: int = 16
    max_stop_bytes: int = 1024            # all of a request's stop strings together (UTF-8)
    max_logprobs: int = 20
    max_body_bytes: int = 4 * 1024 * 1024
    stall_dumps: bool = False             # log every thread's stack 0.3 s into an event-loop stall (diagnostic:
                                          # faulthandler reads running threads' frames unsafely, may crash)
    allocator: str = "auto"               # auto | jemalloc | glibc: the C allocator (auto: jemalloc when the
                                          # system has libjemalloc.so.2, else glibc; docs/operations.md)


@dataclass(frozen=True)
class DevicesSection:
    mode: str = "disaggregated"           # disaggregated | colocated | adaptive
    prefill: tuple[str, ...] = ("cpu:0",)
    decode: tuple[str, ...] = ("cpu:1",)
    devices: tuple[str, ...] = ()         # colocated and adaptive modes
    local_prefill_threshold: int = 0      # disaggregated: prompts shorter than this prefill on the decode device
    local_prefill_when_busy: int = 512    # disaggregated: ... and those shorter than this while every prefill
                                          # device has at least this many prompt tokens queued (0: never)
    attention: str = "auto"               # auto | torch | flashinfer (auto: flashinfer on CUDA when it imports)
    cuda_graphs: bool = True              # CUDA + flashinfer: replay decode steps from captured graphs; false: eager
    lend_idle_cores: bool = True          # CPU: an idle device's core takes half of a busy one's GEMM rows
    huge_pages: bool = True               # CPU: weights and KV pools advised for transparent huge pages
    lend_between_steps: bool = True       # CPU, disaggregated, with lend_idle_cores: a decode device also lends
                                          # its core between steps to a prefill device with a long queue, while
                                          # its streams' token gaps stay within 0.6 x slo.tpot_s


@dataclass(frozen=True)
class KVSection:
    page_size: int = 16
    memory_gib: float = 2.0               # KV pool size per device; 0 (CUDA only): free memory minus the headroom
    memory_headroom: float = 0.1          # with memory_gib = 0: fraction of free GPU memory left for activations
    dtype: str = "auto"                   # auto (the model's dtype) | float16 (CPU: half a float32 model's KV
                                          # bytes) | fp8_e4m3 (1 byte a value, any device and backend; per-layer
                                          # scales calibrated at warm-up)
    prefix_cache: bool = True             # reuse the KV of full pages whose prefix was computed before, per device
    window_pages: str = "free"            # free: sliding-window layers hold their window's pages only (the prefix
                                          # cache is then off for such models) | keep: every page (kv/window.py)
    host_memory_gib: float = -1.0         # host-memory tier below every pool; -1: auto (2x the pools, at most a
                                          # quarter of the host's RAM); 0: off (docs/kv-tiers.md)
    host_write: str = "back"              # back: pages enter the host tier when a pool evicts them | through: when
                                          # published
    disk_path: str = ""                   # disk tier directory, kept across restarts ("": off)
    disk_gib: float = 0.0                 # disk tier size; needs disk_path and the host tier
    disk_timeout: float = 5.0             # seconds a request waits for its pages on disk before computing them
    stop_flush_timeout: float = 15.0      # at a stop, seconds to write cached pages to disk (part of the 60 s stop)


@dataclass(frozen=True)
class KVEventsSection:
    """vLLM's KV events (docs/kv-events.md): every page entering or leaving a device pool or tier, for routers."""
    enabled: bool = False
    endpoint: str = ""                    # the PUB socket. "": bound on server.host's interface, on `port`. Else
                                          # vLLM's rule: bound if it has * or :: (or is ipc/inproc), else
                                          # connected to a subscriber that binds
    port: int = 5557                      # the PUB socket's port when endpoint is "" (vLLM's default port)
    replay_endpoint: str = ""             # the ROUTER socket that replays batches from a sequence number ("": none)
    include_tokens: bool = False          # BlockStored carries each page's token ids (vLLM always does; Dynamo's
                                          # router needs them): they are the prompts' and completions' text
    buffer_steps: int = 10_000            # batches kept for replay
    hwm: int = 10_000                     # batches queued per subscriber; past it that subscriber loses batches.
                                          # = buffer_steps: a subscriber further behind can't be caught up by replay
                                          # either, and a dead one holds ~6 MB, not vLLM's 100,000 (~60 MB, seen
                                          # as RSS growth in the one-hour soak)
    sndbuf: int = 0                       # kernel send buffer per subscriber connection, bytes (0: the OS's); with
                                          # hwm, bounds what a stalled subscriber holds before it loses batches
    max_queue_size: int = 100_000         # events waiting for the publisher; past it they are dropped and counted
    topic: str = ""                       # "": kv@<server.host>:<server.port>@<served model name>


@dataclass(frozen=True)
class SchedulerSection:
    max_num_seqs: int = 64                # most sequences in one step on a device
    max_num_batched_tokens: int = 1024    # most tokens in one step: long prompts are chunked to fit
    prefill_order: str = "deadline"       # deadline: most prompts within slo.ttft_s first (core/prefill_order.py;
                                          # needs profile.startup, else fifo) | fifo: oldest first
    # disaggregated: prompt tokens a decode device adds to one step of its decode batch when it prefills a prompt
    # itself (devices.local_prefill_*), so its streams' inter-token gaps stay short; 0: auto, as many as the
    # device's own step model predicts keep the step within 0.6 x slo.tpot_s (core/side_prefill.py; without a
    # start-up profile a fixed chunk, core/start.py: CPU 32, CUDA 256)
    decode_prefill_chunk: int = 0


@dataclass(frozen=True)
class ProfileSection:
    startup: bool = True                  # measure the cost model at start-up (nodeserve/runtime/profiler.py)
    budget_s: float = 2.0                 # about how long that profile may take (all devices at once)


@dataclass(frozen=True)
class SloSection:
    ttft_s: float = 2.5                   # a request's TTFT target: ttft_s + ttft_per_token_s * prompt tokens
    ttft_per_token_s: float = 0.0
    tpot_s: float = 0.1                   # time per output token after the first
    admission: str = "off"                # off | reject: 503 at once when a predicted TTFT or TPOT misses its target
    margin: float = 0.25                  # reject only past (1 + margin) x the target (> -1)


@dataclass(frozen=True)
class SpeculativeSection:
    method: str = "prompt_lookup"         # off | prompt_lookup | draft: how decode devices guess tokens to verify
    num_speculative_tokens: int = 7       # most tokens guessed per request and step (k; the policy picks 0..k)
    prompt_lookup_min: int = 2            # prompt_lookup: shortest n-gram of the tail looked up in the request
    prompt_lookup_max: int = 4            # ... and the longest (tried first)
    draft_model: str = ""                 # draft: a model with the target's tokenizer (path or bundled name)
    adaptive: bool = True                 # the cost model and each request's acceptance pick k (false: always
                                          # the most found: for tests and measurements)


@dataclass(frozen=True)
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    server: ServerSection = field(default_factory=ServerSection)
    devices: DevicesSection = field(default_factory=DevicesSection)
    kv: KVSection = field(default_factory=KVSection)
    kv_events: KVEventsSection = field(default_factory=KVEventsSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    profile: ProfileSection = field(default_factory=ProfileSection)
    slo: SloSection = field(default_factory=SloSection)
    speculative: SpeculativeSection = field(default_factory=SpeculativeSection)

    @property
    def prefill_devices(self) -> tuple[str, ...]:
        return self.devices.prefill if self.devices.mode == "disaggregated" else ()

    @property
    def decode_devices(self) -> tuple[str, ...]:
        return self.devices.decode if self.devices.mode == "disaggregated" else self.devices.devices

    @property
    def tp_degrees(self) -> frozenset[int]:
        """The tensor-parallel degrees of the devices named ("cpu:0+cpu:1" is 2; a single device 1)."""
        return frozenset(len(n.split("+")) for n in self.prefill_devices + self.decode_devices)

    @property
    def huge_pages(self) -> bool:
        """devices.huge_pages where a device named is a CPU core: its weights then go on huge pages
        (device/host_memory.py; a GPU node's would only be copied once more on the host)."""
        return self.devices.huge_pages and any(
            part.strip().lower().startswith("cpu") for n in self.prefill_devices + self.decode_devices
            for part in n.split("+"))

    @property
    def dtype(self) -> str:
        """model.dtype with "auto" resolved for these devices."""
        from nodeserve.device import auto_dtype

        if self.model.dtype != "auto":
            return self.model.dtype
        if self.quantization != "none":
            return "float32"  # the packed formats compute in float32
        return auto_dtype(self.prefill_devices + self.decode_devices)

    @property
    def quantization(self) -> str:
        """model.quantization with "auto" resolved: a GGUF file's own blocks on CPU devices; "none" (the model's
        dtype) on CUDA devices and for HF checkpoints."""
        q = self.model.quantization
        if q != "auto":
            return q
        if self.model.dtype not in ("auto", "float32"):  # an explicit bf16/fp16 model computes in that dtype
            return "none"
        on_cuda = any(n.strip().lower().startswith("cuda") for n in self.prefill_devices + self.decode_devices)
        return "none" if on_cuda or os.path.isdir(os.path.expanduser(self.model.path)) else "auto"

    @property
    def prompt_attention(self) -> str:
        """model.prompt_attention, "auto" kept only where the weights are quantized anyway (bf16 products where the
        CPU has them): the exact path, which matches transformers token for token, stays float32."""
        if self.model.prompt_attention == "auto" and self.quantization == "none":
            return "float32"
        return self.model.prompt_attention

    @property
    def api_key(self) -> str:
        """server.api_key, or the NODESERVE_API_KEY environment variable (which keeps it out of the file)."""
        return self.server.api_key or os.environ.get("NODESERVE_API_KEY", "")

    @property
    def served_model_name(self) -> str:
        if self.model.name:
            return self.model.name
        base = os.path.basename(os.path.normpath(self.model.path))
        return base.removesuffix(".gguf")


_SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}
_SECTION_TYPES = {"model": ModelSection, "server": ServerSection, "devices": DevicesSection,
                  "kv": KVSection, "kv_events": KVEventsSection, "scheduler": SchedulerSection, "profile": ProfileSection, "slo": SloSection,
                  "speculative": SpeculativeSection}


def _type_name(v: Any) -> str:
    return {bool: "boolean", int: "integer", float: "float", str: "string", list: "array", dict: "table"}.get(
        type(v), type(v).__name__)


def _coerce(section: str, key: str, value: Any, default: Any) -> Any:
    where = f"'{section}.{key}'"
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {_type_name(value)} {value!r}")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {_type_name(value)} {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {_type_name(value)} {value!r}")
        return float(value)
    if isinstance(default, str):
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {_type_name(value)} {value!r}")
        return value
    if isinstance(default, tuple):
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            raise ConfigError(f'{where} must be an array of strings like ["cpu:0"], got {value!r}')
        return tuple(value)
    raise ConfigError(f"{where}: unsupported value {value!r}")  # pragma: no cover


def config_from_dict(raw: dict[str, Any], check_devices: bool = True) -> Config:
    sections = {}
    for name, body in raw.items():
        if name not in _SECTION_TYPES:
            raise ConfigError(f"unknown section [{name}]; valid sections: {', '.join(f'[{s}]' for s in _SECTION_TYPES)}")
        if not isinstance(body, dict):
            raise ConfigError(f"'{name}' must be a table: write it as [{name}] followed by key = value lines")
        cls = _SECTION_TYPES[name]
        defaults = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
                    for f in dataclasses.fields(cls)}
        values = {}
        for key, value in body.items():
            if key not in defaults:
                raise ConfigError(f"unknown key '{name}.{key}'; valid keys in [{name}]: {', '.join(defaults)}")
            values[key] = _coerce(name, key, value, defaults[key])
        sections[name] = cls(**values)
    cfg = Config(**sections)
    validate(cfg, check_devices)
    return cfg


ENV_PREFIX = "NODESERVE_"
MAX_SPECULATIVE_TOKENS = 16  # a verify step's rows per request: past it a miss wastes more than a step


def _env_value(text: str) -> Any:
    """An environment variable's value as TOML reads it (8080, 0.5, true, ["cpu:0"], "x"), else the plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def env_overrides(environ: dict[str, str]) -> dict[str, dict[str, Any]]:
    """NODESERVE_<SECTION>_<KEY> variables as {section: {key: value}}, e.g. NODESERVE_SERVER_PORT=8080.
    Variables outside the sections (NODESERVE_API_KEY, NODESERVE_CACHE_DIR) are not config keys."""
    out: dict[str, dict[str, Any]] = {}
    for name, text in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX):].lower()
        section = next((s for s in _SECTION_TYPES if rest.startswith(s + "_")), None)
        if section is None:
            continue
        key = rest[len(section) + 1:]
        valid = [f.name for f in dataclasses.fields(_SECTION_TYPES[section])]
        if key not in valid:
            raise ConfigError(f"environment variable {name}: unknown key '{section}.{key}'; valid keys in "
                              f"[{section}]: {', '.join(valid)}")
        out.setdefault(section, {})[key] = _env_value(text)
    return out


def load_config(path: str, check_devices: bool = True, overrides: dict[str, dict[str, Any]] | None = None,
                environ: dict[str, str] | None = None) -> Config:
    """The file, then NODESERVE_<SECTION>_<KEY> environment variables, then `overrides` (the command line)."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file '{path}' not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    for layer in (env_overrides(os.environ if environ is None else environ), overrides or {}):
        for section, values in layer.items():
            if not isinstance(raw.get(section, {}), dict):
                raise ConfigError(f"'{section}' must be a table: write it as [{section}] followed by key = value lines")
            raw.setdefault(section, {}).update(values)
    return config_from_dict(raw, check_devices)


ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


def _validate_kv_events(cfg: Config) -> None:
    ev = cfg.kv_events
    for key, value in (("endpoint", ev.endpoint), ("replay_endpoint", ev.replay_endpoint)):
        if value and not value.startswith(ZMQ_SCHEMES):
            raise ConfigError(f"'kv_events.{key}' must be a ZMQ address like \"tcp://*:5557\", got {value!r}")
    if ev.sndbuf < 0:
        raise ConfigError(f"'kv_events.sndbuf' must be 0 (the OS default) or a size in bytes, got {ev.sndbuf}")
    if not 0 < ev.port < 65536:
        raise ConfigError(f"'kv_events.port' must be a TCP port (1-65535), got {ev.port}")
    if ev.buffer_steps < 1 or ev.hwm < 1 or ev.max_queue_size < 1:
        raise ConfigError(f"'kv_events.buffer_steps', 'kv_events.hwm' and 'kv_events.max_queue_size' must be at "
                          f"least 1, got {ev.buffer_steps}, {ev.hwm} and {ev.max_queue_size}")
    if ev.enabled and not cfg.kv.prefix_cache:
        raise ConfigError("KV events ('kv_events.enabled') report the prefix cache's pages: they need "
                          "kv.prefix_cache = true")


def validate(cfg: Config, check_devices: bool = True) -> None:
    from nodeserve.device import DeviceNameError, available_devices, group_ranks, parse_device_name

    m, s, d, kv, sch = cfg.model, cfg.server, cfg.devices, cfg.kv, cfg.scheduler
    if m.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ConfigError(f"'model.dtype' must be one of auto, float32, bfloat16, float16, got {m.dtype!r}")
    if m.quantization not in ("auto", "none", "int8", "int4", "fp16"):
        raise ConfigError(f"'model.quantization' must be one of auto, none, int8, int4, fp16, got {m.quantization!r}")
    if m.prompt_activations not in ("auto", "int16", "int8", "bf16"):
        raise ConfigError(f"'model.prompt_activations' must be \"auto\", \"int16\", \"int8\" or \"bf16\", "
                          f"got {m.prompt_activations!r}")
    if m.decode_activations not in ("auto", "int16", "int8"):
        raise ConfigError(f"'model.decode_activations' must be \"auto\", \"int16\" or \"int8\", "
                          f"got {m.decode_activations!r}")
    if m.prompt_attention not in ("auto", "float32", "bfloat16"):
        raise ConfigError(f"'model.prompt_attention' must be \"auto\", \"float32\" or \"bfloat16\", "
                          f"got {m.prompt_attention!r}")
    if cfg.quantization != "none":
        if m.dtype not in ("auto", "float32"):
            raise ConfigError(f"'model.quantization = \"{m.quantization}\"' computes in float32: set "
                              f"model.dtype to \"auto\" or \"float32\", or quantization to \"none\"")
        # "auto" never gets here with cuda devices: it resolves to "none" there
        if any(n.strip().lower().startswith("cuda") for n in cfg.prefill_devices + cfg.decode_devices):
            raise ConfigError("'model.quantization' is a CPU weight format; use \"none\" with cuda devices")
    if not m.path:
        raise ConfigError("'model.path' is empty: give a .gguf file, an HF checkpoint directory or a bundled model name")
    for key, value, low in (("server.port", s.port, 0), ("server.max_waiting", s.max_waiting, 1),
                            ("server.default_max_tokens", s.default_max_tokens, 1), ("server.max_n", s.max_n, 1),
                            ("server.max_stop", s.max_stop, 0), ("server.max_stop_bytes", s.max_stop_bytes, 1),
                            ("server.max_logprobs", s.max_logprobs, 0),
                            ("server.max_body_bytes", s.max_body_bytes, 1024), ("kv.page_size", kv.page_size, 1),
                            ("server.max_queued_tokens", s.max_queued_tokens, 1),
                            ("server.max_tokens_limit", s.max_tokens_limit, 1),
                            ("scheduler.max_num_seqs", sch.max_num_seqs, 1),
                            ("scheduler.max_num_batched_tokens", sch.max_num_batched_tokens, 16),
                            ("scheduler.decode_prefill_chunk", sch.decode_prefill_chunk, 0),
                            ("model.max_model_len", m.max_model_len, 0),
                            ("devices.local_prefill_threshold", d.local_prefill_threshold, 0),
                            ("devices.local_prefill_when_busy", d.local_prefill_when_busy, 0)):
        if value < low:
            raise ConfigError(f"'{key}' must be at least {low}, got {value}")
    if sch.prefill_order not in ("deadline", "fifo"):
        raise ConfigError(f"'scheduler.prefill_order' must be deadline or fifo, got {sch.prefill_order!r}")
    if m.tool_parser not in ("auto", "hermes", "llama3", "none"):
        raise ConfigError(f"'model.tool_parser' must be one of auto, hermes, llama3, none, got {m.tool_parser!r}")
    if any(not a.strip() for a in m.aliases):
        raise ConfigError("'model.aliases' has an empty name")
    if s.port > 65535:
        raise ConfigError(f"'server.port' must be at most 65535, got {s.port}")
    if s.allocator not in ("auto", "jemalloc", "glibc"):
        raise ConfigError(f"'server.allocator' must be one of auto, jemalloc, glibc, got {s.allocator!r}")
    for key, value in (("server.request_timeout", s.request_timeout), ("server.drain_timeout", s.drain_timeout),
                       ("server.stats_interval", s.stats_interval)):
        if value < 0:
            raise ConfigError(f"'{key}' must be 0 or more seconds, got {value}")
    _validate_slo(cfg)
    _validate_speculative(cfg)
    if kv.host_memory_gib < 0 and kv.host_memory_gib != -1:
        raise ConfigError(f"'kv.host_memory_gib' must be 0 (off), a size in GiB, or -1 (auto), got "
                          f"{kv.host_memory_gib}")
    if kv.host_write not in ("back", "through"):
        raise ConfigError(f"'kv.host_write' must be back or through, got {kv.host_write!r}")
    if kv.disk_gib < 0:
        raise ConfigError(f"'kv.disk_gib' must be 0 (off) or a size in GiB, got {kv.disk_gib}")
    if kv.disk_timeout <= 0 or kv.stop_flush_timeout < 0:
        raise ConfigError(f"'kv.disk_timeout' must be positive and 'kv.stop_flush_timeout' 0 or more, got "
                          f"{kv.disk_timeout} and {kv.stop_flush_timeout}")
    if kv.disk_gib > 0 and not kv.disk_path:
        raise ConfigError("'kv.disk_gib' is set but 'kv.disk_path' is empty: give the directory to keep pages in")
    if kv.window_pages not in ("free", "keep"):
        raise ConfigError(f"'kv.window_pages' must be \"free\" or \"keep\", got {kv.window_pages!r}")
    if kv.disk_gib > 0 and (kv.host_memory_gib == 0 or not kv.prefix_cache):
        raise ConfigError("the disk tier ('kv.disk_gib') sits below the host tier and the prefix cache: it needs "
                          "kv.prefix_cache = true and kv.host_memory_gib other than 0")
    _validate_kv_events(cfg)
    if kv.memory_gib < 0:
        raise ConfigError(f"'kv.memory_gib' must be positive (or 0 on CUDA: fill free memory), got {kv.memory_gib}")
    if not 0 <= kv.memory_headroom < 1:
        raise ConfigError(f"'kv.memory_headroom' must be a fraction in [0, 1), got {kv.memory_headroom}")
    if kv.dtype not in ("auto", "float16", "fp8_e4m3"):
        raise ConfigError(f"'kv.dtype' must be \"auto\", \"float16\" or \"fp8_e4m3\", got {kv.dtype!r}")
    if kv.dtype == "float16" and any(n.strip().lower().startswith("cuda")
                                     for n in cfg.prefill_devices + cfg.decode_devices):
        raise ConfigError("'kv.dtype' = \"float16\" is for CPU devices (a float32 model's KV in half the bytes); "
                          "on cuda devices use \"auto\" (the model's dtype) or \"fp8_e4m3\"")
    if d.attention not in ("auto", "torch", "flashinfer"):
        raise ConfigError(f"'devices.attention' must be \"auto\", \"torch\" or \"flashinfer\", got {d.attention!r}")
    if d.mode == "disaggregated":
        if d.devices:
            raise ConfigError("'devices.devices' is for colocated mode; in disaggregated mode list "
                              "'devices.prefill' and 'devices.decode' instead")
        if not d.prefill or not d.decode:
            raise ConfigError("disaggregated mode needs at least one device in both 'devices.prefill' and "
                              "'devices.decode', e.g. prefill = [\"cpu:0\"], decode = [\"cpu:1\"]")
        both = sorted(set(d.prefill) & set(d.decode))
        if both:
            raise ConfigError(f"'{both[0]}' is listed in both 'devices.prefill' and 'devices.decode'; a device has "
                              "one role: remove it from one list, or use mode = \"colocated\"")
        names = [("devices.prefill", x) for x in d.prefill] + [("devices.decode", x) for x in d.decode]
    elif d.mode in ("colocated", "adaptive"):
        if not d.devices:
            raise ConfigError(f"{d.mode} mode needs 'devices.devices', e.g. devices = [\"cpu:0\", \"cpu:1\"]")
        if d.mode == "adaptive" and len(d.devices) < 2:
            raise ConfigError("adaptive mode places each request on a pair of devices: list at least two in "
                              "'devices.devices' (one device is colocated mode)")
        if d.mode == "adaptive" and not cfg.profile.startup:
            raise ConfigError("adaptive mode places requests with the cost model measured at start-up: "
                              "set [profile] startup = true")
        names = [("devices.devices", x) for x in d.devices]
    else:
        raise ConfigError(f"'devices.mode' must be \"disaggregated\", \"colocated\" or \"adaptive\", got {d.mode!r}")
    seen: set[str] = set()
    groups = []
    for key, name in names:
        try:
            parsed = parse_device_name(name)
        except DeviceNameError as e:
            raise ConfigError(f"'{key}': {e}") from None
        if "+" in parsed:
            groups.append(parsed)
        for rank in group_ranks(parsed):
            if rank in seen:
                raise ConfigError(f"'{key}' lists '{rank}' twice (in '{name}'); each device appears once, in one "
                                  "group at most")
            seen.add(rank)
            # CPU devices past the core count share cores (with a warning at start), so any grouping can be tried
            # on a small machine; a GPU that is not there cannot be.
            if check_devices and rank.startswith("cuda:") and rank not in (have := available_devices()):
                raise ConfigError(f"'{key}' lists '{rank}', which this machine does not have "
                                  f"(available: {', '.join(have)}); remove it or pick one of those")
    if groups and kv.dtype == "fp8_e4m3":
        raise ConfigError(f"'kv.dtype' = \"fp8_e4m3\" is not supported with tensor-parallel groups ('{groups[0]}') "
                          "yet: its scales are calibrated per pool; use \"auto\"")
    _validate_cuda_only(cfg, sorted(n for n in seen if n.startswith("cpu:")))
    if d.attention == "flashinfer" and m.dtype == "float32":  # decided here, before minutes of loading
        raise ConfigError(FLASHINFER_FLOAT32)


def _validate_slo(cfg: Config) -> None:
    slo, prof = cfg.slo, cfg.profile
    if not slo.tpot_s > 0:
        raise ConfigError(f"'slo.tpot_s' must be more than 0 seconds, got {slo.tpot_s}")
    for key, value in (("slo.ttft_s", slo.ttft_s), ("slo.ttft_per_token_s", slo.ttft_per_token_s),
                       ("profile.budget_s", prof.budget_s)):
        if not value >= 0:  # NaN too
            raise ConfigError(f"'{key}' must be 0 or more, got {value}")
    if not slo.margin > -1:  # below 0 rejects before the target: room for the prediction's error
        raise ConfigError(f"'slo.margin' must be more than -1, got {slo.margin}")
    if not slo.ttft_s + slo.ttft_per_token_s > 0:
        raise ConfigError("the TTFT target 'slo.ttft_s' + 'slo.ttft_per_token_s' x prompt tokens is 0: set either "
                          "above 0")
    if slo.admission not in ("off", "reject"):
        raise ConfigError(f"'slo.admission' must be \"off\" or \"reject\", got {slo.admission!r}")
    if slo.admission == "reject" and not prof.startup:
        raise ConfigError("'slo.admission' = \"reject\" predicts TTFT from the start-up profile: set "
                          "profile.startup = true, or slo.admission = \"off\"")


def _validate_speculative(cfg: Config) -> None:
    sp = cfg.speculative
    if sp.method not in ("off", "prompt_lookup", "draft"):
        raise ConfigError(f"'speculative.method' must be \"off\", \"prompt_lookup\" or \"draft\", got {sp.method!r}")
    if sp.method == "draft" and not sp.draft_model:
        raise ConfigError("'speculative.method' = \"draft\" needs 'speculative.draft_model': a model with the "
                          "served model's tokenizer (a .gguf file, an HF checkpoint directory or a bundled name)")
    if not 1 <= sp.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        raise ConfigError(f"'speculative.num_speculative_tokens' must be 1 to {MAX_SPECULATIVE_TOKENS}, "
                          f"got {sp.num_speculative_tokens}")
    if not 1 <= sp.prompt_lookup_min <= sp.prompt_lookup_max <= MAX_SPECULATIVE_TOKENS:
        raise ConfigError(f"'speculative.prompt_lookup_min' and 'prompt_lookup_max' need 1 <= min <= max <= "
                          f"{MAX_SPECULATIVE_TOKENS}, got {sp.prompt_lookup_min} and {sp.prompt_lookup_max}")


def _validate_cuda_only(cfg: Config, cpu_devices: list[str]) -> None:
    """Options that exist only on CUDA devices, rejected up front when any device is a CPU core."""
    if not cpu_devices:
        return
    kv, where = cfg.kv, f"{cpu_devices[0]} is a CPU device"
    if cfg.devices.attention == "flashinfer":
        raise ConfigError(f"'devices.attention' = \"flashinfer\" needs CUDA devices, but {where}; "
                          "use \"auto\" or \"torch\"")
    if kv.memory_gib == 0:
        raise ConfigError(f"'kv.memory_gib' = 0 (size the pool from free GPU memory) needs CUDA devices, but "
                          f"{where}; give the pool size in GiB, e.g. memory_gib = 2.0")
