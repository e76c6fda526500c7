"""Compares two tracemalloc dumps of bench/memtrace/sitecustomize.py: Python heap growth by allocation site,
next to the RSS growth over the same interval (what tracemalloc does not see is native: torch, malloc).

    python bench/memtrace/diff.py DIR [--first N] [--top 25] [--frames 6]
"""

import argparse
import os
import re
import tracemalloc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--first", type=int, default=1, help="index of the baseline dump (0 = the first)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--frames", type=int, default=6)
    args = ap.parse_args()
    names = sorted(n for n in os.listdir(args.dir) if n.endswith(".snap"))
    a, b = names[args.first], names[-1]
    rss = [int(re.search(r"rss(\d+)k", n).group(1)) / 1024 for n in (a, b)]
    sa, sb = (tracemalloc.Snapshot.load(os.path.join(args.dir, n)) for n in (a, b))
    heap = [sum(s.size for s in snap.statistics("filename")) / 2**20 for snap in (sa, sb)]
    print(f"{a} -> {b}: RSS {rss[0]:.1f} -> {rss[1]:.1f} MiB ({rss[1] - rss[0]:+.1f}); "
          f"traced Python heap {heap[0]:.1f} -> {heap[1]:.1f} MiB ({heap[1] - heap[0]:+.1f})")
    for stat in sb.compare_to(sa, "traceback")[:args.top]:
        print(f"\n{stat.size_diff / 2**20:+8.2f} MiB  {stat.count_diff:+8d} blocks  (now {stat.size / 2**20:.2f} MiB)")
        for line in stat.traceback.format(limit=args.frames, most_recent_first=True):
            print("   ", line)


if __name__ == "__main__":
    main()
