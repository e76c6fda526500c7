"""The node's assembly: every object the engine runs, built in dependency order, each given what it needs in its
constructor. Read top to bottom, build_node() is the node: what each device starts as (core/start.py), core lending,
the devices and their model replicas, the KV event log, the host tier, the pools, the transfers between them, the
prefix fetch and loaders, the workers, the router, the tiers and the event publisher.

Nothing here is set on an object after it is built: where two objects need each other (a worker and the transfers
that free its pages, or the loader that wakes it), the shared part (its inbox) is built first."""

from __future__ import annotations

import copy
import functools
import logging
import queue
import socket
from dataclasses import dataclass, field
from typing import Callable

import torch

from nodeserve.attention import auto_fallback, make_backend

from nodeserve.attention.flashinfer_backend import FlashInferAttention
from nodeserve.config import Config, ConfigError
from nodeserve.core.handoff import FreePages, MigrationOutcome
from nodeserve.core.load import Role
from nodeserve.core.placer import StaticPlacer
from nodeserve.core.request import Request, TokenEvent
from nodeserve.core.speculation import Speculator
from nodeserve.core.start import DeviceStart, start_plan
from nodeserve.device import Device, make_device
from nodeserve.device.collectives import make_all_reduce
from nodeserve.device.cpu import CPUDevice
from nodeserve.device.group import DeviceGroup
from nodeserve.kv.events import KVEventLog
from nodeserve.kv.pool import KVPool, kv_cache_dtype, kv_pages_for_device
from nodeserve.kv.window import split_pages
from nodeserve.model.block_quant import gemv_rows
from nodeserve.model.config import ModelConfig
from nodeserve.model.flashinfer_ops import DTYPES as FLASHINFER_OPS_DTYPES, FlashInferOps
from nodeserve.model.llama import LlamaModel
from nodeserve.model.loader import LoadedModel
from nodeserve.runtime.cuda_graphs import DecodeGraphs
from nodeserve.runtime.kv_events import KVEventPublisher, default_topic
from nodeserve.runtime.kv_tiers import KVTiers, host_tier, tiered_pool
from nodeserve.runtime.lending import LEND_GAP_SHARE, MIN_BACKLOG_TOKENS, CoreLending, SlackLending, slack_lenders
from nodeserve.runtime.memory import check_fits, weight_bytes
from nodeserve.runtime.model_runner import ModelRunner
from nodeserve.runtime.router import Router
from nodeserve.runtime.tp_group import GroupAttention, TPGroupModel
from nodeserve.runtime.transfer import KVTransfer
from nodeserve.runtime.worker import Worker
from nodeserve.sampling.sampler import Sampler
from nodeserve.speculative.draft_model import DraftModel
from nodeserve.speculative.prompt_lookup import PromptLookup

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeEvents:
    """What the engine hears from the node: from worker threads, a batch of token events, requests whose decode
    pages are back, a move that ended, a device with room no ended request made; from transfer threads, a
    handed-off request's copy; from the router (event loop), a move's outcome, a request put off for a prefix, a
    placement that raised."""

    emit_batch: Callable[[list[tuple[Request, TokenEvent]]], None]
    released: Callable[[list[Request]], None]
    migrated: Callable[[Request, MigrationOutcome, float, int], None]
    on_transfer: Callable[[float, int, int], None] | None
    on_migration: Callable[[str, float, int], None]
    on_prefix_wait: Callable[[], None]
    on_placement_failed: Callable[[Request], None]
    room: Callable[[], None] = lambda: None


@dataclass
class Node:
    prefill_workers: list[Worker]
    decode_workers: list[Worker]
    transfers: list[KVTransfer]
    router: Router
    tiers: KVTiers | None
    kv_events: KVEventPublisher | None
    lending: CoreLending | None
    warnings: list[str] = field(default_factory=list)  # said at start and shown in /health

    @property
    def workers(self) -> list[Worker]:
        return self.prefill_workers + self.decode_workers

    def start(self) -> None:
        """Starts every thread: tiers' loaders, the event publisher, the transfers, then the workers."""
        if self.tiers is not None:
            self.tiers.start()
        if self.kv_events is not None:
            self.kv_events.start()
        for t in self.transfers:
            t.start()
        for w in self.workers:
            w.start()


def build_node(config: Config, loaded: LoadedModel, max_model_len: int, events: NodeEvents,
               draft: LoadedModel | None = None) -> Node:
    """draft: speculative.method = "draft"'s model (speculative/draft_model.load_draft)."""
    cfg, model = config, loaded.model
    starts = start_plan(cfg, max_model_len)
    names = [s.name for s in starts]
    warnings: list[str] = []
    lending = core_lending(cfg, names)
    devices = {n: make_device(n, *(lending.hooks(i) if lending is not None else ())) for i, n in enumerate(names)}
    shared = shared_cores(devices.values(), warnings)
    singles = [d for d in devices.values() if not isinstance(d, DeviceGroup)]
    replicas = model_replicas(model, singles, cfg.kv.memory_gib)
    groups = {n: group_model(loaded, d, cfg.kv.memory_gib, shared) for n, d in devices.items()
              if isinstance(d, DeviceGroup)}
    kv_dtype = kv_cache_dtype(cfg.kv.dtype, model.dtype)
    num_pages = {n: kv_pages(cfg, loaded, d, kv_dtype) for n, d in devices.items()}
    chunks = {s.name: s.limits.max_num_batched_tokens for s in starts}
    window_pages = {n: window_split(cfg, loaded.config, num_pages[n], chunks[n]) for n in names}
    event_log = (KVEventLog(cfg.kv.page_size, cfg.kv_events.include_tokens, cfg.kv_events.max_queue_size)
                 if cfg.kv_events.enabled else None)  # config: needs the prefix cache
    sink = event_log.sink if event_log is not None else lambda name, chained=True: None
    host = None
    # The tiers and the cross-device fetch move whole-model pages: not where windowed layers keep window pages
    tiered = cfg.kv.prefix_cache and not any(window_pages[n][1] for n in names)
    if tiered:
        pool_bytes = sum(n * KVPool.bytes_per_page(loaded.config, cfg.kv.page_size, kv_dtype) for n in num_pages.values())
        page_shape = (loaded.config.num_layers, 2, cfg.kv.page_size, loaded.config.num_kv_heads, loaded.config.head_dim)
        host = host_tier(cfg.kv, pool_bytes, page_shape, kv_dtype, any(d.torch_device.type == "cuda" for d in
                                                                       devices.values()), sink("host", False))
    pools = {n: tiered_pool(loaded.config, window_pages[n][0], cfg.kv, kv_dtype, d.torch_device, host, sink(n),
                            groups[n].kv_shards() if n in groups else None, *window_pages[n][1:],
                            huge_pages=cfg.devices.huge_pages)
             for n, d in devices.items()}
    runners = {s.name: device_runner(cfg, s, devices[s.name], groups.get(s.name) or
                                     replicas[devices[s.name].torch_device], pools[s.name], warnings)
               for s in starts}
    inboxes: dict[str, queue.SimpleQueue] = {n: queue.SimpleQueue() for n in names}
    transfers = kv_transfers(starts, devices, pools, inboxes, events.on_transfer)
    wake: dict[str, Callable[[], None]] = {n: functools.partial(inboxes[n].put, None) for n in names}
    tiers = KVTiers(devices, pools, wake, host, cfg.kv, event_log) if tiered else None
    borrowers = slack_lending(cfg, starts, lending)
    workers: dict[str, Worker] = {}
    for s in starts:  # prefill workers first: a decode worker lending its core reads its borrower's backlog
        borrower = borrowers.get(s.name)
        workers[s.name] = Worker(
            devices[s.name], s.role, runners[s.name], Sampler(devices[s.name].torch_device,
                                                               eos_token_ids=loaded.tokenizer.eos_token_ids),
            loaded.tokenizer.eos_token_ids, s.limits, events.emit_batch, events.released, events.migrated,
            inboxes[s.name], transfers.get(s.name), tiers.loaders[s.name] if tiers is not None else None,
            SlackLending(backlog_of(workers[borrower]), LEND_GAP_SHARE * cfg.slo.tpot_s)
            if borrower is not None else None, on_room=events.room)
    if cfg.speculative.method != "off":
        for s in starts:
            if s.role is not Role.PREFILL:  # decodes nothing
                workers[s.name].scheduler.use_speculator(speculator(cfg, workers[s.name], devices[s.name], draft))
    prefill = [workers[s.name] for s in starts if s.role is Role.PREFILL]
    decode = [workers[s.name] for s in starts if s.role is not Role.PREFILL]
    router = Router(prefill, decode, cfg.devices.local_prefill_threshold, cfg.server.max_waiting,
                    cfg.server.max_queued_tokens,
                    StaticPlacer(cfg.devices.local_prefill_threshold, cfg.devices.local_prefill_when_busy),
                    fetch=tiers.fetch if tiers is not None else None, on_migration=events.on_migration, on_prefix_wait=events.on_prefix_wait,
                    on_placement_failed=events.on_placement_failed)
    publisher = None
    if event_log is not None:
        host_name = cfg.server.host if cfg.server.host not in ("", "0.0.0.0", "::") else socket.gethostname()
        topic = cfg.kv_events.topic or default_topic(host_name, cfg.server.port, cfg.served_model_name)
        publisher = KVEventPublisher(cfg.kv_events, topic, event_log, cfg.server.host)
    return Node(prefill, decode, [t for ts in transfers.values() for t in ts.values()], router, tiers, publisher,
                lending, warnings)


def speculator(cfg: Config, worker: Worker, device: Device, draft: LoadedModel | None) -> Speculator:
    """[speculative] for one decode device: prompt lookup's or a draft model's guesses, as many as its per-row
    kernels take in one step (past them a step runs as a GEMM whose rows round differently) and its step model
    finds worth it."""
    sp = cfg.speculative
    drafter: PromptLookup | DraftModel = PromptLookup(sp.prompt_lookup_min, sp.prompt_lookup_max)
    if sp.method == "draft":
        if draft is None:
            raise ConfigError("'speculative.method' = \"draft\": the draft model was not loaded")
        if isinstance(device, DeviceGroup):
            raise ConfigError(f"'speculative.method' = \"draft\" runs its draft on one device; {device.name} is a "
                              "tensor-parallel group: use \"prompt_lookup\" there")
        # its own pool, as many pages as the served model's here: every request seated here can have its draft
        pool = KVPool(draft.config, worker.pool.num_pages, cfg.kv.page_size, draft.model.dtype, device.torch_device)
        drafter = DraftModel(build_runner(draft.model.to(device.torch_device), pool, cfg.devices.attention, False,
                                          cfg.scheduler.max_num_seqs, cfg.prompt_attention))
    max_rows, _ = gemv_rows(worker.runner.model)
    # guesses never make a step longer than lending between steps may (its streams' gaps within 0.6 x tpot_s),
    # nor a step already past that any longer: where the batch is large the split's gaps stay what they were
    spec = Speculator(drafter, sp.num_speculative_tokens, sp.adaptive, max_rows, LEND_GAP_SHARE * cfg.slo.tpot_s)
    if worker.slack_lending is not None:  # a core lent between steps takes no guesses
        spec.yield_core_to(worker.slack_lending.wanted)
    return spec


def core_lending(cfg: Config, names: list[str]) -> CoreLending | None:
    """devices.lend_idle_cores: helpers on every core; off beside tensor-parallel groups, whose ranks' cores are
    busy every step of their group (lending is per device, and a group's ranks are not devices of their own)."""
    if not cfg.devices.lend_idle_cores:
        return None
    if any("+" in n for n in names):
        log.info("lend_idle_cores: off, as this node has tensor-parallel groups")
        return None
    return CoreLending.build(names)


def shared_cores(devices, warnings: list[str]) -> set[int]:
    """Cores that two CPU devices (or ranks) run on: those named past the cores this process may use share one
    (device/cpu.core_of). Said once at start and in /health, since two devices on one core each run at half speed."""
    cores: dict[int, list[str]] = {}
    for d in devices:
        for r in d.ranks if isinstance(d, DeviceGroup) else [d]:
            if isinstance(r, CPUDevice):
                cores.setdefault(r.core, []).append(r.name)
    for core, sharing in sorted(cores.items()):
        if len(sharing) > 1:
            warning = f"{' and '.join(sharing)} share core {core} (this machine has fewer cores than the devices named)"
            log.warning(warning)
            warnings.append(warning)
    return {core for core, sharing in cores.items() if len(sharing) > 1}


def group_model(loaded: LoadedModel, group: DeviceGroup, kv_memory_gib: float, shared: set[int]) -> TPGroupModel:
    """A tensor-parallel group's shards (cut at load, model/tensor_parallel.py) on its ranks, joined by the all-reduce
    for their kind of device: on CPU the ranks share the shards' weights with every group of that degree; each GPU
    gets its own shard, once it is checked to fit beside its share of the KV pool."""
    shards = loaded.shards[group.num_ranks]
    placed = []
    for rank, shard in zip(group.ranks, shards):
        if rank.torch_device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(rank.torch_device)
            check_fits(rank.name, free, weight_bytes(shard), int(kv_memory_gib * 2**30) // group.num_ranks)
            shard = copy.deepcopy(shard).to(rank.torch_device)
        placed.append(shard)
    all_reduce = make_all_reduce(group.torch_device.type, group.num_ranks,
                                 any(isinstance(r, CPUDevice) and r.core in shared for r in group.ranks),
                                 [r.torch_device for r in group.ranks])
    log.info("%s: tensor parallel over %d ranks, all-reduce: %s", group.name, group.num_ranks, all_reduce.name)
    return TPGroupModel(loaded.config, placed, group.ranks, all_reduce)


def backlog_of(worker: Worker) -> Callable[[], int]:
    """A worker's queued prompt tokens, read by the core it borrows (SlackLending)."""
    return lambda: worker.num_outstanding_prefill_tokens


def model_replicas(model: LlamaModel, devices, kv_memory_gib: float) -> dict[torch.device, LlamaModel]:
    """The weights on each device: CPU devices share one set (read-only); each GPU gets its own replica, once it is
    checked to fit beside its KV pool."""
    replicas: dict[torch.device, LlamaModel] = {}
    for d in devices:
        if d.torch_device in replicas:
            continue
        if d.torch_device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(d.torch_device)
            check_fits(d.name, free, weight_bytes(model), int(kv_memory_gib * 2**30))
            replicas[d.torch_device] = copy.deepcopy(model).to(d.torch_device)
        else:
            replicas[d.torch_device] = model.to(d.torch_device)
    return replicas


def kv_pages(cfg: Config, loaded: LoadedModel, device: Device, kv_dtype: torch.dtype) -> int:
    """A device's KV pool in pages: kv.memory_gib, or with 0 (CUDA only, config checks) what is free once the
    weights are there."""
    page_bytes = KVPool.bytes_per_page(loaded.config, cfg.kv.page_size, kv_dtype)
    if cfg.kv.memory_gib == 0:
        free, _ = torch.cuda.mem_get_info(device.torch_device)
        return kv_pages_for_device(free, cfg.kv.memory_headroom, page_bytes)
    return KVPool.num_pages_for_bytes(loaded.config, int(cfg.kv.memory_gib * 2**30), cfg.kv.page_size, kv_dtype)


def window_split(cfg: Config, model: ModelConfig, num_pages: int, max_chunk: int) -> tuple[int, int, int]:
    """(full-layer pages, window pages, the largest prompt chunk) of a device whose whole-model pages would be
    num_pages: with kv.window_pages = "free" and windowed layers, split (kv/window.py); else (num_pages, 0, 0)."""
    windows = [model.window(i) for i in range(model.num_layers)]
    if cfg.kv.window_pages != "free" or not any(windows):
        return num_pages, 0, 0
    num_full, num_window = split_pages(num_pages, model.num_layers, sum(1 for w in windows if w), max(windows),
                                       cfg.kv.page_size, cfg.scheduler.max_num_seqs, max_chunk)
    return num_full, num_window, max_chunk


def device_runner(cfg: Config, start: DeviceStart, device: Device, replica: LlamaModel | TPGroupModel, pool: KVPool,
                  warnings: list[str]) -> ModelRunner:
    """A device's model runner, logged; a warning (once) where its attention backend falls back."""
    # CUDA graphs bake in one page table per step: a pool with window pages has two
    runner = build_runner(replica, pool, cfg.devices.attention, cfg.devices.cuda_graphs and start.role is not
                          Role.PREFILL and pool.window is None, cfg.scheduler.max_num_seqs, cfg.prompt_attention)
    windows = f" + {pool.num_window_pages} window pages ({len(pool.window_layers)} windowed layers)" \
        if pool.window is not None else ""
    log.info("%s: %s attention (prompts: %s), %d KV pages%s of %s%s", start.name, type(runner.backend).__name__,
             runner.backend.prompt_kernel, pool.num_pages, windows, pool.dtype,
             ", CUDA graphs at warm-up" if runner.graphs is not None else "")
    fallback = auto_fallback(cfg.devices.attention, device.torch_device, replica.dtype)
    if fallback is not None and fallback not in warnings:
        log.warning(fallback)
        warnings.append(fallback)
    return runner


def build_runner(replica: LlamaModel | TPGroupModel, pool: KVPool, attention: str, cuda_graphs: bool,
                 max_num_seqs: int, prompt_attention: str = "float32") -> ModelRunner:
    """A device's step runner: the attention backend `attention` asks for (prompt_attention: see make_backend);
    with FlashInfer, its norm, RoPE and SiLU kernels on the replica (set once, before any graph capture) and, if
    `cuda_graphs`, decode graphs for batches up to max_num_seqs (captured at warm-up). A tensor-parallel group:
    one backend per rank over its shard of the pool, no graphs yet."""
    if isinstance(replica, TPGroupModel):
        return ModelRunner(replica, GroupAttention(pool, [
            make_backend(attention, shard_pool, shard.cfg, shard.dtype, prompt_attention)
            for shard, shard_pool in zip(replica.shards, pool.shards)]))
    backend = make_backend(attention, pool, replica.cfg, replica.dtype, prompt_attention)
    if not isinstance(backend, FlashInferAttention):
        return ModelRunner(replica, backend)
    if replica.dtype in FLASHINFER_OPS_DTYPES and not isinstance(replica.ops, FlashInferOps):
        replica.use_kernels(lambda rope: FlashInferOps(rope, replica.cfg.max_position_embeddings, pool.device))
    graphs = DecodeGraphs(replica, backend, max_num_seqs) if cuda_graphs else None
    return ModelRunner(replica, backend, graphs)


def kv_transfers(starts: list[DeviceStart], devices: dict[str, Device], pools: dict[str, KVPool],
                 inboxes: dict[str, queue.SimpleQueue],
                 on_transfer: Callable[[float, int, int], None] | None) -> dict[str, dict[str, KVTransfer]]:
    """{source: {target: transfer}}: prefill devices send to decode devices; decode devices to each other (a
    request moved between them, and in adaptive mode any device prefilling for another). The source's pages go
    back through its inbox once the copy has read them."""
    targets = [s.name for s in starts if s.role is not Role.PREFILL]
    out: dict[str, dict[str, KVTransfer]] = {}
    for src in (s.name for s in starts):
        for dst in (t for t in targets if t != src):
            free = lambda pages, read, inbox=inboxes[src]: inbox.put(FreePages(pages, read))  # noqa: E731
            out.setdefault(src, {})[dst] = KVTransfer(devices[src], pools[src], devices[dst], pools[dst], free,
                                                      on_transfer)
    return out


def slack_lending(cfg: Config, starts: list[DeviceStart], lending: CoreLending | None) -> dict[str, str]:
    """devices.lend_between_steps: {decode device: the prefill device it lends its core to between steps}."""
    if lending is None or not cfg.devices.lend_between_steps:
        return {}
    pairs = slack_lenders([(s.name, s.role) for s in starts])
    for lender, borrower in pairs.items():
        log.info("lend_between_steps: %s lends its core to %s between steps while %s has %d or more prompt tokens "
                 "queued (inter-token gaps up to %.0f ms)", lender, borrower, borrower, MIN_BACKLOG_TOKENS,
                 LEND_GAP_SHARE * cfg.slo.tpot_s * 1000)
    return pairs
