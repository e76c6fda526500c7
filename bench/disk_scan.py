"""Start-up scan of the KV disk tier: how long DiskTier.start() takes to rebuild its index from N page files.

Writes N pages through DiskTier.put + flush into a temporary directory, then times start() on a fresh DiskTier
three times (the scan stats every file and reads none). The default page is SmolLM2-135M's bf16 page of 16 tokens
(30 layers x K and V x 3 KV heads x 64 dims x 2 bytes x 16 tokens = 368,640 bytes); N x page bytes of disk is
needed, so use a small --page-bytes for many files. The directory's metadata is in the OS cache after the writes:
this is a warm scan, which is what a restart right after a stop sees.

    python bench/disk_scan.py [--files 10000] [--page-bytes 368640] [--dir /path/on/the/disk/to/test]
Prints one JSON line: {"files": N, "page_bytes": ..., "write_s": ..., "scan_s": [...]}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import time

import torch

from nodeserve.kv.disk import DiskTier

FINGERPRINT = "0" * 32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--page-bytes", type=int, default=368_640)
    ap.add_argument("--dir", default=None, help="parent of the temporary directory (default: the system's)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="disk_scan_") as root:
        max_bytes = 2 * args.files * (args.page_bytes + 4096)
        # One page for every hash: put takes ownership and never modifies it, so sharing it costs no memory.
        page = torch.randint(0, 256, (args.page_bytes,), dtype=torch.uint8)
        writer = DiskTier(root, max_bytes, FINGERPRINT, args.page_bytes, page_size=16,
                          max_queued_bytes=args.files * args.page_bytes)
        writer.start()
        t0 = time.perf_counter()
        for i in range(args.files):
            writer.put(hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest(), page, [0] * 16)
        if not writer.flush(timeout=3600):
            raise SystemExit("writes did not finish within an hour")
        write_s = time.perf_counter() - t0
        writer.stop()
        if writer.num_writes != args.files or writer.disabled:
            raise SystemExit(f"wrote {writer.num_writes} of {args.files} pages ({writer.disabled or 'dropped'})")

        scan_s = []
        for _ in range(3):
            tier = DiskTier(root, max_bytes, FINGERPRINT, args.page_bytes, page_size=16)
            t0 = time.perf_counter()
            tier.start()
            scan_s.append(round(time.perf_counter() - t0, 4))
            tier.stop()
            if tier.num_files != args.files or tier.num_bad_files:
                raise SystemExit(f"scan found {tier.num_files} files, {tier.num_bad_files} bad, of {args.files}")

    print(json.dumps({"files": args.files, "page_bytes": args.page_bytes, "write_s": round(write_s, 3),
                      "scan_s": scan_s}))


if __name__ == "__main__":
    main()
