"""Per-layer FP8 KV scales from one calibration prefill: the largest |K| (after RoPE) and |V| each layer writes
while a fixed text runs through the model in its serving dtype, turned into scale = amax * SCALE_MARGIN / 448.

The calibration pass attends over a scratch pool in the model's dtype, so the recorded values are those an
unquantized cache would hold; the pool being calibrated is not touched, only its k_scales / v_scales.
"""

from __future__ import annotations

from importlib.resources import files
from typing import Sequence

import torch

from nodeserve.attention.torch_ref import FP8_E4M3_MAX, TorchAttention
from nodeserve.core.scheduler import SeqChunk
from nodeserve.runtime.model_runner import ModelRunner
from nodeserve.kv.pool import KVPool, pages_for
from nodeserve.kv.reservation import scratch_pages
from nodeserve.model.llama import LlamaModel

# Headroom above the calibrated amax. e4m3 keeps 3 mantissa bits across its whole normal range (2^-6 to 448,
# about 15 binades), so shrinking every value by 2 costs only the smallest binade, whose values barely move a
# dot product; a value above the range is clamped, an error on exactly the largest entries. Serving text can
# exceed what a short calibration text produced, so trade one binade for room to twice the calibrated amax.
SCALE_MARGIN = 2.0
CALIBRATION_PAGE_SIZE = 16

# Prose, dialogue, code, numbers, a recipe, SQL and a few languages: the kinds of text a server sees, in one
# prefill chunk. Kept as a data file next to this module.
CALIBRATION_TEXT = (files("nodeserve.runtime") / "calibration_text.txt").read_text(encoding="utf-8")


def calibration_token_ids(tokenizer) -> list[int]:
    """CALIBRATION_TEXT as a chat turn, so that the template's special tokens are calibrated too."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": CALIBRATION_TEXT}])
    return tokenizer.encode(text)


class _AmaxRecorder(TorchAttention):
    """The reference backend over a scratch pool, keeping the running max of |K| and |V| each layer writes. The max
    stays on the device: one transfer at the end, not a sync per layer."""

    def __init__(self, pool: KVPool, model: LlamaModel):
        super().__init__(pool, model.cfg, model.dtype)
        self.amax = torch.zeros(len(pool.layers), 2, dtype=torch.float32, device=pool.device)  # [layer, K|V]

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        step = torch.stack([k.abs().amax(), v.abs().amax()]).float()
        torch.maximum(self.amax[layer_id], step, out=self.amax[layer_id])
        return super().forward(layer_id, q, k, v)


def measure_kv_amax(model: LlamaModel, token_ids: Sequence[int],
                    device: torch.device) -> tuple[list[float], list[float]]:
    """(K amax per layer, V amax per layer) over one prefill of `token_ids`, in the model's dtype on `device`."""
    ids = list(token_ids)[:model.cfg.max_position_embeddings]
    scratch = KVPool(model.cfg, pages_for(len(ids), CALIBRATION_PAGE_SIZE), CALIBRATION_PAGE_SIZE, model.dtype, device)
    recorder = _AmaxRecorder(scratch, model)
    with scratch_pages(scratch.manager, scratch.num_pages) as pages:
        ModelRunner(model, recorder).run([SeqChunk(ids, 0, pages, want_logits=False)])
    k_amax, v_amax = recorder.amax.t().tolist()
    return k_amax, v_amax


def scales_from_amax(amax: Sequence[float], margin: float = SCALE_MARGIN) -> list[float]:
    """amax * margin / 448 per layer. A layer with nothing to scale (amax 0) or an overflow (inf, NaN) keeps
    1.0: a zero scale would divide by zero on write, and no finite scale represents an infinite amax."""
    return [a * margin / FP8_E4M3_MAX if 0.0 < a < float("inf") else 1.0 for a in amax]


def calibrate_kv_scales(model: LlamaModel, pool: KVPool, token_ids: Sequence[int],
                        margin: float = SCALE_MARGIN) -> None:
    """Sets pool.k_scales and pool.v_scales from a calibration prefill of `token_ids` on the pool's device.
    Pools that hand KV to each other need equal scales (the transfer copies bytes): the same ids through the same
    weights, dtype and kind of device give them (bit for bit on CPU, as tests/kv/test_fp8_kv.py checks)."""
    k_amax, v_amax = measure_kv_amax(model, token_ids, pool.device)
    pool.use_scales(scales_from_amax(k_amax, margin), scales_from_amax(v_amax, margin))
