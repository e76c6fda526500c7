"""Step times and memory of a model on a tensor-parallel group of GPUs, from the GPU's datasheet instead of a
measurement: the cost model behind `nodeserve plan --model-config`.

One step on a group of t ranks (Megatron's split: q/k/v and gate/up column-parallel, o_proj and down_proj
row-parallel, embedding and lm_head replicated) takes

    max over ranks of max(FLOPs / (peak FLOP/s x compute_efficiency), bytes read / (HBM bytes/s x memory_efficiency))
    + 2 x num_layers all-reduces of (rows x hidden) activations (one after o_proj, one after down_proj; none at t = 1)
    + a fixed host overhead per step

A rank's FLOPs: 2 per weight per row (rows = prefill tokens + decode rows) over its shard, the lm_head over the rows
that sample, and 4 x head_dim per query head per attended query-key pair. Its bytes: its shard and the lm_head (read
once a step whatever the rows) plus the KV its decode rows read and its prefill tokens write. Each rank's heads and
MLP columns come from model/tp_layout.tp_layout, so a degree that does not divide them pays for its largest rank.

Not modelled: activations' own traffic, attention kernels' inefficiency at short contexts, the all-reduce
overlapping compute, a host too slow to launch eager prefill steps (the roofline assumes it keeps up).
"""

from __future__ import annotations

from dataclasses import dataclass

from nodeserve.core.cost_model import StepModel, StepShape
from nodeserve.model.tp_layout import tp_layout
from nodeserve.model.config import ModelConfig

GIB = 2**30


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model's datasheet numbers, and the fractions of them a step reaches."""

    name: str
    memory_gib: float            # what an idle GPU reports free (torch.cuda.mem_get_info), not the label
    flops: float                 # dense bf16 FLOP/s
    hbm_bytes_per_s: float
    link_bytes_per_s: float      # NVLink, per direction per GPU (through NVSwitch: to any peer)
    link_latency_s: float = 15e-6    # per all-reduce call, whatever its size
    compute_efficiency: float = 0.7  # of peak FLOP/s a large bf16 GEMM reaches
    memory_efficiency: float = 0.8   # of peak HBM bandwidth a weight-streaming decode step reaches
    step_overhead_s: float = 0.002   # host work per step: scheduling, plan(), sampling, graph launch


# Datasheet numbers (NVIDIA's H100, H200 and A100 datasheets, SXM parts): dense bf16 without sparsity, HBM
# bandwidth, NVLink bandwidth halved to one direction (H100/H200 NVLink 4: 900 GB/s both ways; A100 NVLink 3:
# 600 GB/s). Usable memory: docs/cuda.md's ~78 GiB of an 80 GB H100 (the A100 80 GB taken as the same); ~139 GiB
# of an H200, as this project's device machine reports it. Not measured here: the all-reduce latency, 15 us a call,
# the middle of the 10-20 us usually quoted for small all-reduces on NVLink (NCCL, vLLM's custom all-reduce); the
# efficiencies; and the 2 ms host overhead per step (graph decode steps took 0.5-0.8 ms of host time for SmolLM2
# on the H200, docs/cuda.md; an 80-layer model on several ranks needs more).
GPUS: dict[str, GpuSpec] = {
    "h100-80gb": GpuSpec("h100-80gb", 78.0, 989e12, 3.35e12, 450e9),
    "h200-141gb": GpuSpec("h200-141gb", 139.0, 989e12, 4.8e12, 450e9),
    "a100-80gb": GpuSpec("a100-80gb", 78.0, 312e12, 2.039e12, 300e9),
}


@dataclass(frozen=True)
class RankWork:
    """What one rank holds and does per step, in numbers of elements (bytes follow from the dtypes)."""

    shard_params: int            # its q/k/v/o and gate/up/down weights (and q/k/v biases), every layer
    replicated_params: int       # embedding, lm_head (unless tied), norms: on every rank
    num_q_heads: int
    num_kv_heads: int


@dataclass(frozen=True)
class GroupShape:
    """A model split over `num_ranks` ranks: each rank's work (model/tp_layout's layout) and the shape numbers
    a step's time needs."""

    num_ranks: int
    ranks: tuple[RankWork, ...]
    num_layers: int
    hidden_size: int
    head_dim: int
    vocab_size: int

    @classmethod
    def of(cls, model: ModelConfig, num_ranks: int) -> GroupShape:
        """Raises ValueError (naming the valid degrees) when num_ranks cannot split this model."""
        # the runtime's split (model/tensor_parallel.layout_for): MLP columns in 32-column blocks, balanced
        unit = 32 if model.intermediate_size % 32 == 0 else 1
        layout = tp_layout(model.num_heads, model.num_kv_heads, model.intermediate_size, num_ranks, unit,
                           model.vocab_size, model.head_dim)
        h, d = model.hidden_size, model.head_dim
        replicated = (model.vocab_size * h * (1 if model.tie_word_embeddings else 2)  # embedding, lm_head
                      + model.num_layers * 2 * h + h)                                    # RMSNorm weights
        ranks = []
        for r in layout.ranks:
            q, kv, mlp = len(r.q_heads) * d, len(r.kv_heads) * d, len(r.mlp)
            attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if model.attention_bias else 0)
            ranks.append(RankWork(model.num_layers * (attn + 3 * h * mlp), replicated, len(r.q_heads),
                                  len(r.kv_heads)))
        return cls(num_ranks, tuple(ranks), model.num_layers, h, d, model.vocab_size)

    def kv_bytes_per_token(self, rank: RankWork, kv_bytes: int) -> int:
        """K and V of one token on one rank, every layer: its KV heads only."""
        return 2 * self.num_layers * rank.num_kv_heads * self.head_dim * kv_bytes


@dataclass(frozen=True)
class Fit:
    """Whether a group fits its GPUs: weights per rank, the KV pool the rest leaves (nodeserve's kv.memory_gib = 0
    rule: free memory after the weights, less kv.memory_headroom of it), and why it does not fit, if it does not."""

    weight_gib: float            # the largest rank's
    kv_tokens: int               # tokens of KV the group's pool holds (its fullest rank bounds it)
    reason: str = ""             # empty when it fits

    @property
    def fits(self) -> bool:
        return not self.reason


def check_fit(group: GroupShape, gpu: GpuSpec, weight_bytes: int, kv_bytes: int, memory_headroom: float,
              min_kv_tokens: int, page_size: int = 16) -> Fit:
    """The rule: a group fits when each rank holds its weights and a KV pool of at least min_kv_tokens tokens (by
    default one sequence of max_model_len) in whole pages."""
    free = gpu.memory_gib * GIB
    weights = max(r.shard_params + r.replicated_params for r in group.ranks) * weight_bytes
    tokens = min(int((free - (r.shard_params + r.replicated_params) * weight_bytes) * (1 - memory_headroom)
                     // (group.kv_bytes_per_token(r, kv_bytes) * page_size)) * page_size for r in group.ranks)
    w = weights / GIB
    if weights > free:
        return Fit(w, 0, f"does not fit: {w:.1f} GiB of weights per rank, {gpu.name} has {gpu.memory_gib:g} GiB")
    if tokens < min_kv_tokens:
        return Fit(w, max(tokens, 0), f"does not fit: {w:.1f} GiB of weights per rank leave KV for "
                   f"{max(tokens, 0):,} tokens, under the {min_kv_tokens:,} required")
    return Fit(w, tokens)


class RooflineStepModel(StepModel):
    """A StepModel whose step time is the roofline above instead of a fit: the max of compute and memory time is
    not linear in the step's features (StepModel.refit on this formula's times for 16-2,048-token prefills and
    1-256-row decodes of a 70B model at TP 4 was 14 % under it at a 1,000-token prefill)."""

    def __init__(self, group: GroupShape, gpu: GpuSpec, weight_bytes: int = 2, kv_bytes: int = 2):
        super().__init__()
        self.group, self.gpu, self.weight_bytes, self.kv_bytes = group, gpu, weight_bytes, kv_bytes

    def step_time(self, shape: StepShape) -> float:
        if shape.empty:
            return 0.0
        g, gpu = self.group, self.gpu
        rows = shape.num_prefill_tokens + shape.num_decodes
        sampled = shape.num_decodes + (1 if shape.num_prefill_tokens else 0)  # lm_head rows (a prompt's last token)
        pairs = shape.prefill_pairs + shape.decode_context  # attended query-key pairs
        lm_head = g.vocab_size * g.hidden_size
        worst = 0.0
        for r in g.ranks:
            flops = (2 * rows * r.shard_params + 2 * sampled * lm_head
                     + 4 * g.head_dim * r.num_q_heads * g.num_layers * pairs)
            kv_token = g.kv_bytes_per_token(r, self.kv_bytes)
            read = ((r.shard_params + lm_head) * self.weight_bytes
                    + (shape.decode_context + shape.num_prefill_tokens) * kv_token)
            worst = max(worst, flops / (gpu.flops * gpu.compute_efficiency),
                        read / (gpu.hbm_bytes_per_s * gpu.memory_efficiency))
        return worst + 2 * g.num_layers * all_reduce_time(g.num_ranks, rows * g.hidden_size * self.weight_bytes,
                                                          gpu) + gpu.step_overhead_s


def all_reduce_time(num_ranks: int, num_bytes: float, gpu: GpuSpec) -> float:
    """A ring all-reduce: each rank sends and receives 2 (t - 1) / t of the buffer, plus a fixed latency."""
    if num_ranks <= 1:
        return 0.0
    return gpu.link_latency_s + 2 * (num_ranks - 1) / num_ranks * num_bytes / gpu.link_bytes_per_s
