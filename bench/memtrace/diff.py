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
    """One line per dump: RSS, the C heap's bytes in use and free, then the mappings that grew the most."""
    dumps = [json.load(open(os.path.join(dir_, n))) for n in names]
    mib = 2**20
    print(f"{'dump':>16} {'RSS':>8} {'C in use':>9} {'C free':>8} {'C mmapped':>9}  (MiB)")
    for name, d in zip(names, dumps):
        m = d["mallinfo2"]
        print(f"{name.split('-')[0]:>16} {d['rss_kib'] / 1024:8.1f} {m.get('uordblks', 0) / mib:9.1f} "
              f"{m.get('fordblks', 0) / mib:8.1f} {m.get('hblkhd', 0) / mib:9.1f}")
    a, b = dumps[first]["smaps_rss_kib"], dumps[-1]["smaps_rss_kib"]
    grown = sorted(((b.get(k, 0) - a.get(k, 0)) / 1024, k) for k in set(a) | set(b))
    print("mappings' RSS growth, dump", first, "-> last (MiB):",
          ", ".join(f"{k} {v:+.1f}" for v, k in reversed(grown[-6:])), "| shrank:",
          ", ".join(f"{k} {v:+.1f}" for v, k in grown[:3] if v < 0) or "-")


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
