#!/bin/bash
# lending.py under glibc (the server's settings) and jemalloc, interleaved
cd /work/main
G="MALLOC_ARENA_MAX=2 MALLOC_MMAP_THRESHOLD_=8388608 MALLOC_TRIM_THRESHOLD_=67108864"
J="LD_PRELOAD=libjemalloc.so.2 MALLOC_CONF=background_thread:true"
for i in 1 2; do
  for a in glibc jemalloc; do
    if [ $a = glibc ]; then E=$G; else E=$J; fi
    echo "== $a run $i $(date -u +%H:%M:%S)"
    env $E .venv/bin/python bench/lending.py --json /tmp/ab-$a-$i.json 2>&1 | tail -6
  done
done
