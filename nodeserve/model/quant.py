"""fp16 weight storage for CPU serving: Linear layers repacked for fbgemm's fp16-weight, fp32-compute GEMM.

fbgemm keeps the weights as float16 in its packed layout and widens them to float32 inside the kernel:
activations and accumulation stay float32, so each output is the float32 product with the weights rounded to
float16 (relative error <= 2^-11 per weight), and a request's result does not depend on what it is batched
with. The GGUF block formats (`auto`, `int8`, `int4`) live in model/block_quant.py; bench/README.md has the
measurements behind both, and what was tried and left out. The two fbgemm fp16 entry points warn (once) that
they are deprecated in torch 2.13.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

FORMATS = ("none", "fp16")


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W held in an fbgemm packed format. x: [..., in] float32 -> [..., out] float32."""

    def __init__(self, linear: nn.Linear, fmt: str):
        super().__init__()
        weight = linear.weight.detach().float()
        self.fmt = fmt
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.bias = None if linear.bias is None else linear.bias.detach().float().clone()
        if fmt != "fp16":
            raise ValueError(f"unknown weight format '{fmt}' (expected one of {', '.join(FORMATS[1:])})")
        with warnings.catch_warnings():
            # Both fbgemm fp16 ops warn once per process that they are deprecated (see the module docstring);
            # one call here takes that warning out of the server log.
            warnings.filterwarnings("ignore", message="fbgemm_", category=UserWarning)
            self.packed = torch.fbgemm_pack_gemm_matrix_fp16(weight)
            self.forward(torch.zeros(1, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).float()
        y = torch.fbgemm_linear_fp16_weight_fp32_activation(x2, self.packed, self.bias)
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, format={self.fmt}"


def supported(fmt: str) -> str | None:
    """None if this torch build can run `fmt` (a model.quantization value), else why not."""
    if fmt in ("none", "auto", "int8", "int4"):  # the block formats need the native kernels: see block_quant
        return None
    if fmt not in FORMATS:
        return f"unknown weight format '{fmt}' (expected one of none, auto, {', '.join(FORMATS[1:])}, int8, int4)"
    if "fbgemm" not in torch.backends.quantized.supported_engines:  # non-x86 torch builds
        return f"weight format '{fmt}' needs a torch build with fbgemm (x86 CPUs)"
    return None


def quantize_linears(model: nn.Module, fmt: str) -> int:
    """Replaces every nn.Linear below `model` with a PackedLinear in `fmt`, in place; returns how many.

    Embeddings are left alone (a tied lm_head gets its own packed copy; the embedding table keeps the dense one).
    """
    if fmt == "none":
        return 0
    why = supported(fmt)
    if why:
        raise ValueError(why)
    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    for name, mod in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, PackedLinear(mod, fmt))
    return len(targets)
