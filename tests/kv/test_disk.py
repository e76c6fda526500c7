"""DiskTier: round trip, restart, fingerprint isolation, bad files (corrupt, truncated, another model's, killed
mid-write), a full disk, LRU eviction, a full queue, and model_fingerprint."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import threading

import pytest
import torch

from nodeserve.kv import disk
from nodeserve.kv.disk import HEADER, DiskTier, model_fingerprint

PAGE = 256
FILE = HEADER.size + PAGE
FP_A, FP_B = "a" * 32, "b" * 32


def page_hash(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def page(i: int) -> torch.Tensor:
    return torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))


@pytest.fixture
def make_tier(tmp_path):
    tiers = []

    def make(fingerprint: str = FP_A, max_bytes: int = 1 << 20, **kw) -> DiskTier:
        tier = DiskTier(str(tmp_path / "kv"), max_bytes, fingerprint, PAGE, **kw)
        tier.start()
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.stop(timeout=5)


def write(tier: DiskTier, ids) -> None:
    for i in ids:
        tier.put(page_hash(i), page(i))
    assert tier.flush(timeout=5)


def read(tier: DiskTier, i: int) -> torch.Tensor | None:
    out = torch.empty(PAGE, dtype=torch.uint8)
    return out if tier.get(page_hash(i), out) else None


def files(tier: DiskTier) -> list[str]:
    return sorted(os.listdir(tier.dir))


def test_round_trip(make_tier):
    tier = make_tier()
    writers = [t for t in threading.enumerate() if t.name == "kv disk writer"]
    assert len(writers) == 1 and writers[0].daemon
    write(tier, range(3))
    assert files(tier) == sorted(page_hash(i).hex() + ".kvp" for i in range(3))
    assert page_hash(1) in tier and page_hash(9) not in tier
    assert torch.equal(read(tier, 1), page(1))
    assert read(tier, 9) is None
    assert (tier.num_files, tier.num_bytes, tier.num_writes, tier.num_write_bytes) == (3, 3 * FILE, 3, 3 * FILE)
    assert (tier.num_reads, tier.num_read_bytes, tier.num_bad_files) == (1, FILE, 0)
    assert tier.read_seconds > 0
    # Already on disk: a second put writes nothing.
    write(tier, [1])
    assert tier.num_writes == 3


def test_bad_arguments(make_tier):
    tier = make_tier()
    with pytest.raises(ValueError):
        tier.put(page_hash(0), torch.zeros(PAGE, dtype=torch.float16))
    with pytest.raises(ValueError):
        tier.get(page_hash(0), torch.zeros(PAGE + 1, dtype=torch.uint8))
    with pytest.raises(ValueError):
        tier.put(b"short", page(0))
    with pytest.raises(ValueError):
        DiskTier("/nonexistent", 1 << 20, "not hex", PAGE)


def test_survives_restart(make_tier):
    first = make_tier()
    for i in range(3):
        first.put(page_hash(i), page(i))
    first.stop()  # writes what is queued
    second = make_tier()
    assert second.num_files == 3 and second.num_bytes == 3 * FILE
    assert second.match([page_hash(0), page_hash(1), page_hash(2), page_hash(7), page_hash(0)]) == 3
    assert second.match([page_hash(7), page_hash(0)]) == 0
    for i in range(3):
        assert torch.equal(read(second, i), page(i))
    assert second.num_bad_files == 0


def test_other_fingerprint_sees_nothing_and_deletes_nothing(make_tier):
    a = make_tier(FP_A)
    write(a, range(2))
    a_files = files(a)
    b = make_tier(FP_B)
    assert b.num_files == 0 and b.match([page_hash(0)]) == 0 and read(b, 0) is None
    assert b.num_bad_files == 0 and b.num_evictions == 0
    assert files(a) == a_files and files(b) == []


def test_corrupt_payload(make_tier):
    tier = make_tier()
    write(tier, [0, 1])
    path = tier._path(page_hash(0))
    with open(path, "r+b") as f:
        f.seek(HEADER.size + 10)
        byte = f.read(1)
        f.seek(HEADER.size + 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert read(tier, 0) is None
    assert tier.num_bad_files == 1 and tier.num_reads == 0
    assert not os.path.exists(path) and page_hash(0) not in tier
    assert (tier.num_files, tier.num_bytes) == (1, FILE)
    assert torch.equal(read(tier, 1), page(1))


def test_truncated_and_misnamed_files_removed_at_scan(make_tier):
    first = make_tier()
    write(first, [0, 1])
    first.stop()
    with open(first._path(page_hash(0)), "r+b") as f:
        f.truncate(FILE // 2)
    for name in ["not-a-hash.kvp", "AB" * 16 + ".kvp", "ab" * 16 + ".bin"]:
        with open(os.path.join(first.dir, name), "wb") as f:
            f.write(b"x" * FILE)
    second = make_tier()
    assert second.num_bad_files == 4 and second.num_files == 1
    assert page_hash(0) not in second and torch.equal(read(second, 1), page(1))
    assert files(second) == [page_hash(1).hex() + ".kvp"]


def test_file_from_another_model(make_tier):
    a = make_tier(FP_A)
    write(a, [0])
    a.stop()
    b_dir = os.path.join(os.path.dirname(a.dir), FP_B)
    os.makedirs(b_dir)
    name = page_hash(0).hex() + ".kvp"
    os.replace(os.path.join(a.dir, name), os.path.join(b_dir, name))
    b = make_tier(FP_B)
    assert b.match([page_hash(0)]) == 1  # the scan does not read files: the right size passes
    assert read(b, 0) is None
    assert b.num_bad_files == 1 and files(b) == [] and page_hash(0) not in b


def test_killed_mid_write(make_tier, monkeypatch):
    first = make_tier()
    write(first, [0])
    # The process dies between writing the temp file and renaming it.
    monkeypatch.setattr(disk.os, "replace", lambda src, dst: None)
    write(first, [1])
    monkeypatch.undo()
    first.stop()
    with open(os.path.join(first.dir, page_hash(2).hex() + ".kvp.999.tmp"), "wb") as f:
        f.write(b"partial")
    assert sum(n.endswith(".tmp") for n in files(first)) == 2
    second = make_tier()
    assert files(second) == [page_hash(0).hex() + ".kvp"]
    assert second.num_files == 1 and second.match([page_hash(1)]) == 0 and second.match([page_hash(2)]) == 0
    assert torch.equal(read(second, 0), page(0))


def test_full_disk(make_tier, monkeypatch, caplog):
    tier = make_tier()
    write(tier, [0])

    def no_space(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk.os, "replace", no_space)
    with caplog.at_level(logging.WARNING, logger="nodeserve.kv.disk"):
        write(tier, [1, 2, 3])
    monkeypatch.undo()
    assert tier.disabled and "No space left on device" in tier.disabled
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert files(tier) == [page_hash(0).hex() + ".kvp"]  # no temp file left behind
    # Page 1 failed; 2 and 3 were discarded by the writer or refused by put, depending on timing.
    assert tier.num_writes == 1 and 1 <= tier.num_dropped <= 3
    # Later puts are no-ops even though the disk would take them now; reads go on.
    write(tier, [4])
    assert page_hash(4) not in tier and tier.num_writes == 1 and tier.num_files == 1
    assert torch.equal(read(tier, 0), page(0))


def test_unusable_directory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    tier = DiskTier(str(blocker), 1 << 20, FP_A, PAGE)
    tier.start()  # makedirs under a regular file fails: off, not raised
    assert tier.disabled
    tier.put(page_hash(0), page(0))
    assert tier.flush(timeout=1) and tier.match([page_hash(0)]) == 0 and read(tier, 0) is None
    tier.stop()


def test_lru_eviction(make_tier):
    tier = make_tier(max_bytes=3 * FILE + 10)
    write(tier, [0, 1, 2])
    assert read(tier, 0) is not None  # 0 is now the most recently used; 1 the least
    write(tier, [3])
    assert tier.num_evictions == 1 and tier.num_bytes <= tier.max_bytes
    assert [i for i in range(4) if page_hash(i) in tier] == [0, 2, 3]
    assert not os.path.exists(tier._path(page_hash(1)))
    tier.put(page_hash(2), page(2))  # a put of a page on disk is a use too: 0 goes next
    write(tier, [4])
    assert [i for i in range(5) if page_hash(i) in tier] == [2, 3, 4]
    assert tier.num_evictions == 2 and tier.num_files == 3 and len(files(tier)) == 3


def test_restart_orders_by_mtime_and_evicts_to_max_bytes(make_tier):
    first = make_tier()
    write(first, [0, 1, 2])
    first.stop()
    for age, i in enumerate([1, 2, 0]):
        t = 1_000_000 - age * 100
        os.utime(first._path(page_hash(i)), (t, t))  # 1 newest, 0 oldest
    second = make_tier(max_bytes=2 * FILE)
    assert second.num_evictions == 1 and second.num_bytes == 2 * FILE
    assert [i for i in range(3) if page_hash(i) in second] == [1, 2] and len(files(second)) == 2


def test_queue_full_drops(make_tier, monkeypatch):
    tier = make_tier(max_queued=2)
    entered, release = threading.Event(), threading.Event()
    real_write = tier._write

    def slow_write(h, p):
        entered.set()
        release.wait(5)
        return real_write(h, p)

    monkeypatch.setattr(tier, "_write", slow_write)
    tier.put(page_hash(0), page(0))
    assert entered.wait(5)  # the writer holds page 0; the queue is empty
    for i in range(1, 6):
        tier.put(page_hash(i), page(i))
    tier.put(page_hash(1), page(1))  # already queued: a no-op, not a drop
    assert tier.num_dropped == 3
    assert not tier.flush(timeout=0.05)
    release.set()
    assert tier.flush(timeout=5)
    assert [i for i in range(6) if page_hash(i) in tier] == [0, 1, 2]


def test_model_fingerprint_file(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights" * 1000)
    fp = model_fingerprint(str(model), "llama", "bf16", "16")
    assert len(fp) == 32 and int(fp, 16) >= 0
    assert model_fingerprint(str(model), "llama", "bf16", "16") == fp
    for parts in [("llama", "bf16", "32"), ("llama", "fp8_e4m3", "16"), ("llama", "bf16"), ("llamab", "f16", "16")]:
        assert model_fingerprint(str(model), *parts) != fp
    model.write_bytes(b"weightz" * 1000)
    assert model_fingerprint(str(model), "llama", "bf16", "16") != fp


def test_model_fingerprint_samples_big_files(tmp_path):
    model = tmp_path / "big.gguf"
    size = 40 << 20
    with open(model, "wb") as f:
        f.truncate(size)  # sparse: no 40 MiB written

    def poke(offset: int) -> str:
        with open(model, "r+b") as f:
            f.seek(offset)
            f.write(bytes([(f.read(1) or b"\0")[0] ^ 1]))
        return model_fingerprint(str(model))

    fp = model_fingerprint(str(model))
    fp_head = poke(5)
    fp_tail = poke(size - 5)
    fp_middle = poke(20 << 20)  # between the sampled 16 MiB ends: not hashed, by design
    assert len({fp, fp_head, fp_tail}) == 3 and fp_middle == fp_tail


def test_model_fingerprint_directory(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 576}')
    (tmp_path / "model.safetensors").write_bytes(b"w" * 100)
    fp = model_fingerprint(str(tmp_path), "bf16")
    (tmp_path / "README.md").write_text("not part of the model")
    assert model_fingerprint(str(tmp_path), "bf16") == fp
    (tmp_path / "config.json").write_text('{"hidden_size": 577}')
    fp_config = model_fingerprint(str(tmp_path), "bf16")
    (tmp_path / "model-00002.safetensors").write_bytes(b"more")
    fp_shard = model_fingerprint(str(tmp_path), "bf16")
    assert len({fp, fp_config, fp_shard}) == 3
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError):
        model_fingerprint(str(tmp_path / "empty"))
