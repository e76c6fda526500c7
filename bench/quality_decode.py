"""Teacher-forced top-1 agreement through the decode rows, in process: bench/quality.py's (b) for the arithmetic of
decode steps.

quality.py's teacher-forced figure sends prompt + reference[:i] to a server with max_tokens 1, so every scored token
comes from a prompt row; with `model.decode_activations = "int8"` (int8 decode rows, int16 prompt rows) it cannot
see the change. This loads the model in this process with each decode_activations setting, runs each quality.json
prompt as a prompt chunk, then feeds the reference continuation one token a step as decode rows (the native
decoder, as a server's decode-only steps run), and counts where the argmax is the reference's next token. The
first token of each continuation comes from the prompt's last row (prompt_activations), the rest from decode rows.
llama.cpp computes every row alike, so its teacher-forced figure in quality.py is its decode rows' as well.

    python bench/quality.py --cpu-class avx2 --out-dir /tmp/quality-avx2   # the reference continuations
    python bench/quality_decode.py /tmp/quality-avx2/quality.json --cpu-class avx2
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cpu_class import CPU_CLASS_ENV  # noqa: E402


def agreement(quality_json: dict, decode_activations: str, prompt_activations: str) -> tuple[int, int]:
    """(matches, scored positions) over every prompt's reference continuation."""
    import torch

    from nodeserve.attention.torch_ref import TorchAttention
    from nodeserve.kv.pool import KVPool, pages_for
    from nodeserve.model.loader import load_model
    from nodeserve.runtime.model_runner import ModelRunner, SeqChunk

    loaded = load_model(quality_json["model"]["file"], torch.float32, quantization="auto",
                        prompt_activations=prompt_activations, decode_activations=decode_activations,
                        huge_pages=True)
    matches = total = 0
    for prompt, ref in zip(quality_json["prompts"], quality_json["reference"]["ids"]):
        ids = prompt["ids"]
        pool = KVPool(loaded.config, pages_for(len(ids) + len(ref) + 1, 16) + 1, 16, torch.float32,
                      torch.device("cpu"))
        runner = ModelRunner(loaded.model, TorchAttention(pool, loaded.config, loaded.model.dtype))
        table = pool.manager.allocate(pages_for(len(ids) + len(ref) + 1, 16))
        logits = runner.run([SeqChunk(ids, 0, table, is_prompt=True)])
        for i, want in enumerate(ref):  # the reference's token ids (its end of sequence is not scored)
            matches += int(logits.argmax(-1)) == want
            total += 1
            if i + 1 < len(ref):
                logits = runner.run([SeqChunk([want], len(ids) + i, table)])
    return matches, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("quality_json", help="a bench/quality.py quality.json (its prompts and reference ids)")
    ap.add_argument("--cpu-class", choices=sorted(CPU_CLASS_ENV), help="the kernels that class of CPU runs")
    ap.add_argument("--prompt-activations", default="int16")
    args = ap.parse_args()
    if args.cpu_class:  # before the kernels load: they read it once
        os.environ.update(CPU_CLASS_ENV[args.cpu_class])
    import torch

    torch.set_num_threads(1)
    with open(args.quality_json) as f:
        quality_json = json.load(f)
    for kind in ("int16", "int8"):
        matches, total = agreement(quality_json, kind, args.prompt_activations)
        print(f"decode_activations = {kind!r} (prompt_activations = {args.prompt_activations!r}): teacher-forced "
              f"top-1 through decode rows {matches / total * 100:.1f} % ({matches}/{total})", flush=True)


if __name__ == "__main__":
    main()
