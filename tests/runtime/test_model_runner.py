"""ModelRunner on the meta device: a step that mixes decodes, a whole prompt and a prompt extending its cached
prefix runs end to end without touching data. A host read of a device value (.item(), .tolist(), a bool of a
tensor), or a CPU tensor in arithmetic with the step's tensors, raises on meta exactly where it would put a sync
(or an error) in every CUDA step: the CPU-only guard for the no-host-sync path. CPU index tensors pass (torch
accepts them on any device)."""

from __future__ import annotations

import pytest
import torch

from nodeserve.attention.torch_ref import TorchAttention
from nodeserve.device import Device
from nodeserve.device.collectives import RankThreadsNCCL
from nodeserve.model.tensor_parallel import layout_for, shard_models
from nodeserve.runtime.tp_group import GroupAttention, TPGroupModel
from nodeserve.runtime.model_runner import ModelRunner, SeqChunk
from nodeserve.kv.pool import KVPool
from nodeserve.model.config import ModelConfig
from nodeserve.model.llama import LlamaModel

META = torch.device("meta")


def _tiny_config() -> ModelConfig:
    return ModelConfig("llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=128, tie_word_embeddings=True)


def _meta_runner(kv_dtype: torch.dtype = torch.float32, backend: type = TorchAttention) -> ModelRunner:
    cfg = _tiny_config()
    model = LlamaModel(cfg).to_empty(device=META)
    model.fuse()
    pool = KVPool(cfg, num_pages=8, page_size=4, dtype=kv_dtype, device=META)
    return ModelRunner(model, backend(pool, cfg, torch.float32))


MIXED_STEP = [
    SeqChunk([5, 6, 7], 0, [0]),               # a whole prompt
    SeqChunk([9], 5, [1, 2]),                  # a decode
    SeqChunk([1, 2, 3, 4, 5], 4, [3, 4, 5]),   # a chunk extending a 4-token cached prefix
    SeqChunk([11], 8, [6, 7, 5]),              # another decode, in a different length group
]


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn], ids=["fp32", "fp8"])
def test_mixed_step_runs_on_the_meta_device(kv_dtype):
    runner = _meta_runner(kv_dtype)
    logits = runner.run(MIXED_STEP)
    assert logits.device == META
    assert logits.shape == (len(MIXED_STEP), _tiny_config().vocab_size)


def test_layer_hook_sees_every_layer_on_the_meta_device():
    runner = _meta_runner()
    done: list[int] = []
    runner.run(MIXED_STEP[:1], on_layer_done=done.append)
    assert done == [0, 1]


def test_a_host_read_in_the_forward_would_fail_here():
    """The guard works: a backend that reads a device value on the host fails on meta."""
    class HostReadingAttention(TorchAttention):
        def forward(self, layer_id, q, k, v):
            self.meta.seq_lens.max().item()  # the kind of sync the real backends must not do
            return super().forward(layer_id, q, k, v)

    runner = _meta_runner(backend=HostReadingAttention)
    with pytest.raises((RuntimeError, NotImplementedError)):
        runner.run(MIXED_STEP)


def test_upload_on_cpu_and_meta():
    from nodeserve.device import upload

    t = upload([1, 2, 3], torch.device("cpu"), torch.int64)
    assert t.dtype == torch.int64 and t.tolist() == [1, 2, 3]
    assert upload([0.5, 2.0], torch.device("cpu")).dtype == torch.float32
    host = torch.arange(4)
    assert upload(host, torch.device("cpu")) is host  # no copy on the host
    assert upload(host, META).device == META


class _MetaRank(Device):
    """A rank of a group of GPUs as the meta device stands in for one."""

    def __init__(self, index: int):
        self.name, self.torch_device = f"cuda:{index}", META


@pytest.mark.parametrize("num_ranks", [2, 3, 4])
def test_a_tensor_parallel_group_runs_a_mixed_step_on_the_meta_device(monkeypatch, num_ranks):
    """A group of GPUs as a GPU-less machine can check it: the shards (uneven for 3 ranks; replicated KV heads for
    4), each rank's thread, the rendezvous all-reduce (NCCL's call itself stubbed: it needs GPUs) and the per-rank
    attention, with no host read of a device value anywhere in the step."""
    cfg = _tiny_config()
    full = LlamaModel(cfg).to_empty(device=META)
    shards = shard_models(full, num_ranks)
    for s in shards:
        s.fuse()
    ranks = [_MetaRank(i) for i in range(num_ranks)]
    all_reduce = RankThreadsNCCL([torch.device("cuda", i) for i in range(num_ranks)])
    calls: list[int] = []
    monkeypatch.setattr(all_reduce._nccl, "all_reduce", lambda tensors, streams: calls.append(len(tensors)))
    model = TPGroupModel(cfg, shards, ranks, all_reduce)
    pool = KVPool(cfg, num_pages=8, page_size=4, dtype=torch.float32, device=META,
                  shards=[(META, heads) for _, heads in model.kv_shards()])
    runner = ModelRunner(model, GroupAttention(pool, [TorchAttention(p, s.cfg, torch.float32)
                                                      for s, p in zip(shards, pool.shards)]))
    done: list[int] = []
    logits = runner.run(MIXED_STEP, on_layer_done=done.append, before_layer=lambda i: None)
    assert logits.device == META and logits.shape == (len(MIXED_STEP), cfg.vocab_size)
    assert done == [0, 1]
    # two reduces per layer, plus one barrier per layer for before_layer, each one NCCL call over every rank
    assert calls == [num_ranks] * (3 * cfg.num_layers)
    assert [len(h) for h in pool.heads] == [len(r.kv_heads) for r in layout_for(cfg, num_ranks).ranks]
