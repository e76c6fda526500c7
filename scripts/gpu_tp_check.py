"""The tensor-parallel path on the GPUs of a lent machine: a tiny random Llama checkpoint (gpu_smoke.py's), its
shards on groups of 1..N GPUs wired by hand (DeviceGroup, TPGroupModel over RankThreadsNCCL, a KVPool with one
shard per GPU, GroupAttention over TorchAttention per rank, ModelRunner), then through the Engine.

Checks, each printed as PASS / FAIL (or SKIP) with its numbers; the exit status is non-zero if any fails:
  1. the all-reduce of each group size n = 1..N: every rank's input written by a slow kernel on its own thread's
     stream just before the reduce, and the sum right on every GPU (NCCL must wait for that kernel); its median
     time on a [1, hidden] float32 tensor is printed;
  2. the group of n, float32: greedy tokens of 4 prompts (prefill, then decode steps) equal transformers' on the
     first device token for token, its logits are within 1e-4 of one device's ModelRunner, and its pool is whole
     after; the host time per decode step (runner.run of one decode row, median of 50) is printed;
  3. with 2+ devices, the Engine: colocated on the first two as one group and, with 3+, disaggregated prefill on
     the first and decode on a group of the rest, greedy tokens equal transformers', pools whole after. With fewer
     devices it prints SKIP lines: nothing with 2+ GPUs has run then.

    python scripts/gpu_tp_check.py            # every GPU torch sees; DEVICES=cuda:0,cuda:1 picks them
    python scripts/gpu_tp_check.py --cpu      # the same on cpu:0, cpu:1 (make_all_reduce("cpu", n)), no GPU needed
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_smoke as smoke  # noqa: E402  (the checkpoint, transformers' tokens, the Engine run and check())
from nodeserve.attention.torch_ref import TorchAttention  # noqa: E402
from nodeserve.device import make_device  # noqa: E402
from nodeserve.device.collectives import make_all_reduce  # noqa: E402
from nodeserve.device.group import DeviceGroup  # noqa: E402
from nodeserve.kv.pool import KVPool, pages_for  # noqa: E402
from nodeserve.model.hf_loader import load_hf  # noqa: E402
from nodeserve.model.llama import LlamaModel  # noqa: E402
from nodeserve.model.loader import load_model  # noqa: E402
from nodeserve.model.tensor_parallel import shard_models  # noqa: E402
from nodeserve.runtime.model_runner import ModelRunner, SeqChunk  # noqa: E402
from nodeserve.runtime.tp_group import GroupAttention, TPGroupModel  # noqa: E402

PAGE_SIZE = 4  # small pages: decode steps cross page boundaries
NUM_PAGES = 128
LOGIT_TOL = 1e-4
HOST_STEPS = 50
REDUCE_ITERS = 200
check = smoke.check


def skip(name: str, why: str) -> None:
    print(f"SKIP  {name}: {why}", flush=True)


def device_names(cpu: bool) -> list[str]:
    if os.environ.get("DEVICES"):
        return os.environ["DEVICES"].split(",")
    if cpu:
        return ["cpu:0", "cpu:1"]
    return [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def sync(devices) -> None:
    for d in devices:
        if d.torch_device.type == "cuda":
            torch.cuda.synchronize(d.torch_device)


def on_worker_thread(device, fn):
    """fn() on a fresh thread set up as the engine's worker thread for `device` (its core, or its compute stream),
    so the group's rank 0 runs exactly as under the Engine."""
    out: dict = {}

    def run():
        try:
            device.init_worker_thread()
            with torch.inference_mode():
                out["value"] = fn()
        except BaseException as e:  # raised again on the caller's thread
            out["error"] = e
    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def greedy(runner: ModelRunner, prompts: list[list[int]], force: list[list[int]]):
    """All prompts prefilled together, then smoke.NUM_NEW - 1 batched decode steps fed force[i] (transformers'
    tokens) rather than the argmax: the argmaxes equal force exactly when free-running greedy would, and two
    runners see the same inputs, so their logits compare even past a first disagreement.
    Returns (argmax tokens, logits [prompts, NUM_NEW, vocab] on the CPU, pool whole after)."""
    manager = runner.pool.manager
    tables = [manager.allocate(pages_for(len(p) + smoke.NUM_NEW, PAGE_SIZE)) for p in prompts]
    steps = [runner.run([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)])]
    for i in range(smoke.NUM_NEW - 1):
        steps.append(runner.run([SeqChunk([f[i]], len(p) + i, t) for p, f, t in zip(prompts, force, tables)]))
    for t in tables:
        manager.free(t)
    logits = torch.stack([s.float().cpu() for s in steps], dim=1)
    return logits.argmax(-1).tolist(), logits, manager.num_free == runner.pool.num_pages


def decode_host_ms(runner: ModelRunner, devices, prompt: list[int]) -> float:
    """Median wall time of runner.run for one decode row: the host's share of a decode step (each step's GPU work
    is waited for outside the timed call, so queued kernels never stall the next one)."""
    table = runner.pool.manager.allocate(pages_for(len(prompt) + HOST_STEPS, PAGE_SIZE))
    runner.run([SeqChunk(prompt, 0, table)])
    times = []
    for i in range(HOST_STEPS):
        sync(devices)
        t0 = time.perf_counter()
        runner.run([SeqChunk([prompt[-1]], len(prompt) + i, table)])
        times.append(time.perf_counter() - t0)
    sync(devices)
    runner.pool.manager.free(table)
    return statistics.median(times) * 1e3


def single_runner(loaded, device) -> ModelRunner:
    cfg, where = loaded.config, device.torch_device
    model = copy.deepcopy(loaded.model).to(where) if where.type == "cuda" else loaded.model
    return ModelRunner(model, TorchAttention(KVPool(cfg, NUM_PAGES, PAGE_SIZE, torch.float32, where), cfg,
                                             torch.float32))


def unfused_shards_of_one(path: str) -> list[LlamaModel]:
    """load_model cuts shards only for degrees above 1 (and fuses its whole model), so the group of one is cut here
    the way it cuts the others: from a fresh unfused model of the checkpoint, then fused."""
    cfg, state = load_hf(path, torch.float32)
    model = LlamaModel(cfg)
    model.load_state_dict(state, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    shards = shard_models(model, 1)
    for s in shards:
        s.fuse()
        s.eval()
    return shards


def group_all_reduce(group: DeviceGroup):
    """make_all_reduce as runtime/node.py calls it: RankThreadsNCCL on GPUs, the native sum on CPU cores."""
    kind = group.torch_device.type
    shares_cores = kind == "cpu" and len({r.core for r in group.ranks}) < group.num_ranks
    return make_all_reduce(kind, group.num_ranks, shares_cores, [r.torch_device for r in group.ranks])


def group_runner(loaded, path: str, group: DeviceGroup) -> ModelRunner:
    """A TP group wired as runtime/node.py's group_model and build_runner do, with the PyTorch attention."""
    n, kind = group.num_ranks, group.torch_device.type
    shards = loaded.shards[n] if n > 1 else unfused_shards_of_one(path)
    if kind == "cuda":  # each GPU its own copy (on CPU the ranks share the shards' weights)
        shards = [copy.deepcopy(s).to(r.torch_device) for s, r in zip(shards, group.ranks)]
    model = TPGroupModel(loaded.config, shards, group.ranks, group_all_reduce(group))
    pool = KVPool(loaded.config, NUM_PAGES, PAGE_SIZE, torch.float32, group.torch_device, shards=model.kv_shards())
    return ModelRunner(model, GroupAttention(pool, [TorchAttention(p, s.cfg, torch.float32)
                                                    for s, p in zip(model.shards, pool.shards)]))


def check_all_reduce(group: DeviceGroup, hidden: int) -> None:
    """Check 1 on one thread per rank, as the group's rank threads call it."""
    n, kind = group.num_ranks, group.torch_device.type
    all_reduce = group_all_reduce(group)
    gate = threading.Barrier(n, timeout=120)
    sums: list = [None] * n
    times: list[float] = []
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        d = group.ranks[r]
        try:
            d.init_worker_thread()  # the stream (or core) its shard's kernels use under the engine
            x = torch.zeros(1, hidden, device=d.torch_device)
            big = torch.randn(4096, 4096, device=d.torch_device) if kind == "cuda" else None
            sync([d])
            gate.wait()
            if big is not None:  # still running on this thread's stream when rank 0 issues the NCCL call
                x.copy_((big @ big)[:1, :hidden] * 0 + (r + 1))
            else:
                x.fill_(r + 1)
            all_reduce(r, x)
            sync([d])  # every stream of this GPU: NCCL's too, whichever it was
            sums[r] = x.to("cpu", copy=True)  # (the timing below keeps summing into x)
            for _ in range(REDUCE_ITERS):
                gate.wait()
                t0 = time.perf_counter()
                all_reduce(r, x)
                sync([d])
                gate.wait()
                if r == 0:
                    times.append(time.perf_counter() - t0)
        except BaseException as e:  # frees the others, then fails the check
            errors.append(e)
            gate.abort()
            all_reduce.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    want = n * (n + 1) / 2
    worst = max(((s - want).abs().max().item() for s in sums if s is not None), default=float("inf"))
    check(f"all-reduce {group.name} ({all_reduce.name}) sums each rank's stream-ordered input", not errors and
          worst == 0.0, f"max |sum - {want:g}| = {worst:g}" + (f"; {errors[0]!r}" if errors else ""))
    if times:
        print(f"      all-reduce {group.name} [1, {hidden}] float32: median {statistics.median(times) * 1e6:.1f} us "
              f"over {len(times)}", flush=True)


def check_group(loaded, path: str, group: DeviceGroup, prompts, want, ref_logits) -> None:
    """Check 2 for one group, on a thread set up as its worker's."""
    def body():
        runner = group_runner(loaded, path, group)
        tokens, logits, whole = greedy(runner, prompts, want)
        return tokens, logits, whole, decode_host_ms(runner, group.ranks, prompts[0])

    try:
        tokens, logits, whole, host_ms = on_worker_thread(group, body)
    except Exception as e:
        check(f"group {group.name} runs", False, repr(e))
        return
    same = sum(a == b for g, w in zip(tokens, want) for a, b in zip(g, w))
    check(f"group {group.name} float32 = transformers", tokens == want, f"{same}/{smoke.NUM_NEW * len(want)} tokens")
    diff = (logits - ref_logits).abs().max().item()
    check(f"group {group.name} logits within {LOGIT_TOL:g} of one device", diff < LOGIT_TOL,
          f"max |diff| = {diff:.2e}")
    check(f"group {group.name} pool whole", whole, str(whole))
    print(f"      group {group.name}: host time per decode step {host_ms:.2f} ms (median of {HOST_STEPS})",
          flush=True)


def check_engine(loaded, names: list[str], want) -> None:
    """Check 3: the same groups through the Engine (smoke.serve: TorchAttention, greedy, pools whole after)."""
    kind = "GPUs" if names[0].startswith("cuda") else "devices"
    runs = {}
    if len(names) >= 2:
        runs[f"colocated {names[0]}+{names[1]}"] = {"mode": "colocated", "devices": [f"{names[0]}+{names[1]}"]}
    else:
        skip("engine, colocated group of 2", f"{len(names)} {kind} here: nothing with 2+ {kind} has run")
    if len(names) >= 3:
        decode = "+".join(names[1:])
        runs[f"disaggregated {names[0]} -> {decode}"] = {"mode": "disaggregated", "prefill": [names[0]],
                                                         "decode": [decode]}
    else:
        skip("engine, disaggregated prefill -> decode group", f"needs 3 {kind}, {len(names)} here")
    for name, devices in runs.items():
        try:
            got, stats = smoke.serve(loaded, {**devices, "attention": "torch"}, "float32")
        except Exception as e:
            check(f"engine {name} runs", False, repr(e))
            continue
        same = sum(a == b for g, w in zip(got[0], want) for a, b in zip(g, w))
        check(f"engine {name} float32 = transformers", got[0] == want, f"{same}/{smoke.NUM_NEW * len(want)} tokens")
        check(f"engine {name} pools whole", stats["whole"], str(stats["whole"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="CPU devices (cpu:0, cpu:1) instead of GPUs")
    args = parser.parse_args(argv)
    names = device_names(args.cpu)
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", names, "GPUs", gpus or "none",
          flush=True)
    if not names:
        check("devices", False, "torch sees no GPU (run with --cpu to exercise the script on CPU devices)")
        return 1
    devices = [make_device(n) for n in names]
    with tempfile.TemporaryDirectory() as tmp:
        hf = smoke.build_checkpoint(Path(tmp))
        loaded = load_model(tmp, torch.float32, tp_degrees=range(2, len(names) + 1))
        prompts = smoke.PROMPT_IDS = [loaded.tokenizer.encode(p) for p in smoke.PROMPTS]  # smoke.serve reads it
        where = names[0] if names[0].startswith("cuda") else "cpu"
        want = [smoke.hf_greedy(hf, ids, where) for ids in prompts]

        single = make_device(names[0])
        ref_tokens, ref_logits, _ = on_worker_thread(single, lambda: greedy(single_runner(loaded, single), prompts,
                                                                            want))
        same = sum(a == b for g, w in zip(ref_tokens, want) for a, b in zip(g, w))
        check(f"one device {names[0]} = transformers (the logits' reference)", ref_tokens == want,
              f"{same}/{smoke.NUM_NEW * len(want)} tokens")
        host_ms = on_worker_thread(single, lambda: decode_host_ms(single_runner(loaded, single), [single],
                                                                  prompts[0]))
        print(f"      one device {names[0]}: host time per decode step {host_ms:.2f} ms (median of {HOST_STEPS})",
              flush=True)
        for n in range(1, len(devices) + 1):
            group = DeviceGroup(devices[:n])
            check_all_reduce(group, loaded.config.hidden_size)
            check_group(loaded, tmp, group, prompts, want, ref_logits)
        check_engine(loaded, names, want)
    failed = [name for name, ok, _ in smoke.RESULTS if not ok]
    print("ALL PASS" if not failed else f"FAILED: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
