"""Compares two dumps of bench/memtrace/sitecustomize.py: the C heap (glibc mallinfo2: in use vs free) and the
mappings' RSS that grew, then the Python heap's growth by allocation site (tracemalloc; what it does not see is
native: torch, malloc).

    python bench/memtrace/diff.py DIR [--first N] [--top 25] [--frames 6]
"""

import argparse
import json
import os
import re
import tracemalloc


def native_report(dir_: str, names: list[str], first: int) -> None:
    """One line per dump: RSS, glibc's heap (in use, free, mmapped) or jemalloc's counters when it serves malloc
    (allocated = live; resident - allocated = kept free pages), pymalloc's block count; then the mappings and the
    live object types (gc-tracked, after any gc.freeze) that grew the most."""
    dumps = [json.load(open(os.path.join(dir_, n))) for n in names]
    mib = 2**20
    je = any(d.get("jemalloc") for d in dumps)
    cols = ("allocated", "resident", "retained") if je else ("uordblks", "fordblks", "hblkhd")
    heads = ("je alloc", "je resid", "je retain") if je else ("C in use", "C free", "C mmapped")
    print(f"{'dump':>16} {'RSS':>8} " + " ".join(f"{h:>9}" for h in heads) + f" {'py blocks':>10}  (MiB)")
    for name, d in zip(names, dumps):
        stats = d.get("jemalloc") if je else d["mallinfo2"]
        blocks = d.get("python", {}).get("allocated_blocks", 0)
        print(f"{name.split('-')[0]:>16} {d['rss_kib'] / 1024:8.1f} "
              + " ".join(f"{stats.get(c, 0) / mib:9.1f}" for c in cols) + f" {blocks:10d}")
    a, b = dumps[first]["smaps_rss_kib"], dumps[-1]["smaps_rss_kib"]
    grown = sorted(((b.get(k, 0) - a.get(k, 0)) / 1024, k) for k in set(a) | set(b))
    print("mappings' RSS growth, dump", first, "-> last (MiB):",
          ", ".join(f"{k} {v:+.1f}" for v, k in reversed(grown[-6:])), "| shrank:",
          ", ".join(f"{k} {v:+.1f}" for v, k in grown[:3] if v < 0) or "-")
    ta, tb = (d.get("python", {}).get("by_type", {}) for d in (dumps[first], dumps[-1]))
    if ta or tb:
        types = sorted(((tb.get(k, 0) - ta.get(k, 0)), k) for k in set(ta) | set(tb))
        print("live objects by type, dump", first, "-> last:",
              ", ".join(f"{k} {v:+d}" for v, k in reversed(types[-8:]) if v > 0) or "-")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--first", type=int, default=1, help="index of the baseline dump (0 = the first)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--frames", type=int, default=6)
    args = ap.parse_args()
    natives = sorted(n for n in os.listdir(args.dir) if n.endswith(".native.json"))
    if natives:
        native_report(args.dir, natives, args.first)
    names = sorted(n for n in os.listdir(args.dir) if n.endswith(".snap"))
    if len(names) < 2:
        return
    a, b = names[args.first], names[-1]
    rss = [int(re.search(r"rss(\d+)k", n).group(1)) / 1024 for n in (a, b)]
    sa, sb = (tracemalloc.Snapshot.load(os.path.join(args.dir, n)) for n in (a, b))
    heap = [sum(s.size for s in snap.statistics("filename")) / 2**20 for snap in (sa, sb)]
    print(f"\n{a} -> {b}: RSS {rss[0]:.1f} -> {rss[1]:.1f} MiB ({rss[1] - rss[0]:+.1f}); "
          f"traced Python heap {heap[0]:.1f} -> {heap[1]:.1f} MiB ({heap[1] - heap[0]:+.1f})")
    for stat in sb.compare_to(sa, "traceback")[:args.top]:
        print(f"\n{stat.size_diff / 2**20:+8.2f} MiB  {stat.count_diff:+8d} blocks  (now {stat.size / 2**20:.2f} MiB)")
        for line in stat.traceback.format(limit=args.frames, most_recent_first=True):
            print("   ", line)


if __name__ == "__main__":
    main()
