"""DiskTier: round trip, restart, fingerprint isolation, bad files (corrupt, truncated, another model's, killed
mid-write), a full disk, LRU eviction, a full queue, and model_fingerprint."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
import subprocess
import sys
import threading
import time

import pytest
import torch

from nodeserve.kv import disk
from nodeserve.kv.disk import HEADER, DiskTier, model_fingerprint

PAGE = 256
PS = 4  # tokens a page
FILE = HEADER.size + PS * 8 + PAGE + disk.MAC_BYTES
FP_A, FP_B = "a" * 32, "b" * 32


def page_hash(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def page(i: int) -> torch.Tensor:
    return torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))


def tokens(i: int) -> list[int]:
    return [i * 1000 + k for k in range(PS)]


@pytest.fixture
def make_tier(tmp_path):
    tiers = []

    def make(fingerprint: str = FP_A, max_bytes: int = 1 << 20, root=None, **kw) -> DiskTier:
        tier = DiskTier(str(root or tmp_path / "kv"), max_bytes, fingerprint, PAGE, page_size=PS, **kw)
        tier.start()
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.stop(timeout=5)


def write(tier: DiskTier, ids) -> None:
    for i in ids:
        tier.put(page_hash(i), page(i), tokens(i))
    assert tier.flush(timeout=5)


def read(tier: DiskTier, i: int, toks: list[int] | None = None) -> torch.Tensor | None:
    out = torch.empty(PAGE, dtype=torch.uint8)
    return out if tier.get(page_hash(i), out, tokens(i) if toks is None else toks) else None


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
        tier.put(page_hash(0), torch.zeros(PAGE, dtype=torch.float16), tokens(0))
    with pytest.raises(ValueError):
        tier.get(page_hash(0), torch.zeros(PAGE + 1, dtype=torch.uint8), tokens(0))
    with pytest.raises(ValueError):
        tier.put(b"short", page(0), tokens(0))
    with pytest.raises(ValueError):
        tier.put(page_hash(0), page(0), tokens(0)[:-1])  # a page's tokens, all of them
    with pytest.raises(ValueError):
        DiskTier("/nonexistent", 1 << 20, "not hex", PAGE, page_size=PS)


def test_survives_restart(make_tier):
    first = make_tier()
    for i in range(3):
        first.put(page_hash(i), page(i), tokens(i))
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
    a.stop()  # one process at a time in a directory
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
    assert read(b, 0) is None  # its MAC holds (same cache) but its header names model A
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


class FullDisk:
    """DiskTier's write, injected: raises ENOSPC while `full`, else writes."""

    def __init__(self):
        self.full, self.num_calls = False, 0

    def __call__(self, fd, parts):
        self.num_calls += 1
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        disk._write_all(fd, parts)


def test_a_full_disk_pauses_writes_and_they_resume_once_space_returns(make_tier, monkeypatch, caplog):
    monkeypatch.setattr(disk, "RETRY_FIRST_S", 0.2)
    fake = FullDisk()
    tier = make_tier(write=fake)
    write(tier, [0])
    fake.full = True
    with caplog.at_level(logging.WARNING, logger="nodeserve.kv.disk"):
        write(tier, [1, 2, 3])
        # Page 1 failed; 2 and 3 were refused by put or dropped by the writer: one try per pause, not per page.
        assert tier.num_write_errors == 1 and fake.num_calls == 2 and tier.num_dropped == 3
        assert tier.paused and "No space left" in tier.paused and not tier.disabled
        assert files(tier) == [page_hash(0).hex() + ".kvp"]  # no temp file left behind
        assert torch.equal(read(tier, 0), page(0))  # reads go on
        time.sleep(0.25)
        write(tier, [4])  # still full after the pause: the next pause is twice as long
        assert tier.num_write_errors == 2 and tier.retry_at - time.monotonic() > 0.3
        fake.full = False
        time.sleep(tier.retry_at - time.monotonic() + 0.05)
        write(tier, [5, 6])
    assert [i for i in range(7) if page_hash(i) in tier] == [0, 5, 6] and tier.paused is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "writes pause" in warnings[0] and "writes resumed" in warnings[1]
    assert torch.equal(read(tier, 5), page(5))


def test_unusable_directory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    tier = DiskTier(str(blocker), 1 << 20, FP_A, PAGE, page_size=PS)
    tier.start()  # makedirs under a regular file fails: off, not raised
    assert tier.disabled
    tier.put(page_hash(0), page(0), tokens(0))
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
    tier.put(page_hash(2), page(2), tokens(2))  # a put of a page on disk is a use too: 0 goes next
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
    tier = make_tier(max_queued_bytes=2 * PAGE)
    entered, release = threading.Event(), threading.Event()
    real_write = tier._write

    def slow_write(h, p, t):
        entered.set()
        release.wait(5)
        return real_write(h, p, t)

    monkeypatch.setattr(tier, "_write", slow_write)
    tier.put(page_hash(0), page(0), tokens(0))
    assert entered.wait(5)  # the writer holds page 0; the queue is empty
    for i in range(1, 6):
        tier.put(page_hash(i), page(i), tokens(i))
    tier.put(page_hash(1), page(1), tokens(1))  # already queued: a no-op, not a drop
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
    mtime = os.stat(model).st_mtime_ns
    fp_middle = poke(20 << 20)  # between the sampled 16 MiB ends: not hashed, but the mtime changed
    os.utime(model, ns=(mtime, mtime))
    fp_middle_same_mtime = model_fingerprint(str(model))  # a forger who resets the mtime: not caught, by design
    assert len({fp, fp_head, fp_tail, fp_middle}) == 4 and fp_middle_same_mtime == fp_tail


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


# ---- trust: modes, the lock, the MAC, tokens, links and FIFOs ------------------------------------------------

@pytest.mark.parametrize("umask", [0o000, 0o022])
def test_files_and_directories_are_private_whatever_the_umask(make_tier, umask):
    old = os.umask(umask)
    try:
        tier = make_tier()
        write(tier, [0])
    finally:
        os.umask(old)
    mode = lambda path: stat.S_IMODE(os.lstat(path).st_mode)  # noqa: E731
    assert mode(tier.root) == mode(tier.dir) == 0o700
    assert mode(os.path.join(tier.root, "key")) == mode(os.path.join(tier.root, "lock")) == 0o600
    assert mode(tier._path(page_hash(0))) == 0o600


def test_a_second_process_on_the_directory_is_refused_and_its_temp_files_kept(make_tier, tmp_path):
    first = make_tier()
    tmp = first._path(page_hash(1)) + ".123.abcd.tmp"  # the first process's write in progress
    with open(tmp, "wb") as f:
        f.write(b"partial")
    # another process: flock conflicts across open file descriptions, so a second DiskTier in this process is one
    code = ("import sys; from nodeserve.kv.disk import DiskTier, DiskTierLocked\n"
            f"t = DiskTier({str(tmp_path / 'kv')!r}, 1 << 20, {FP_A!r}, {PAGE}, page_size={PS})\n"
            "try:\n    t.start()\nexcept DiskTierLocked as e:\n    print(e); sys.exit(3)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 3, out.stderr
    assert f"in use by another nodeserve process (pid {os.getpid()})" in out.stdout
    with pytest.raises(disk.DiskTierLocked):
        DiskTier(str(tmp_path / "kv"), 1 << 20, FP_B, PAGE, page_size=PS).start()  # any fingerprint
    assert os.path.exists(tmp)
    first.stop()
    again = make_tier()  # the lock is free once the owner stops (or dies: the kernel drops an flock)
    assert not os.path.exists(tmp)  # now a leftover, removed
    again.stop()


def forge(path: str, content: bytes) -> None:
    os.remove(path)
    with open(path, "wb") as f:
        f.write(content)


def test_forged_files_are_rejected_counted_and_removed(make_tier, tmp_path, caplog):
    tier = make_tier()
    write(tier, [0, 1, 2])
    p0, p1, p2 = (tier._path(page_hash(i)) for i in range(3))
    with open(p0, "rb") as f:
        good = f.read()
    # A forger without the key: the right header and tokens, their own K/V, any MAC.
    forge(p0, good[:HEADER.size + PS * 8] + bytes(PAGE) + os.urandom(disk.MAC_BYTES))
    # The same page from another cache (another key): authentic there, not here.
    other = DiskTier(str(tmp_path / "other"), 1 << 20, FP_A, PAGE, page_size=PS)
    other.start()
    write(other, [1])
    other.stop()
    with open(other._path(page_hash(1)), "rb") as f:
        forge(p1, f.read())
    # One MAC-valid file of ours renamed onto another page's hash: its header names page 2, not page 0... and the
    # tokens check catches a page asked for with other tokens.
    with caplog.at_level(logging.WARNING, logger="nodeserve.kv.disk"):
        assert read(tier, 0) is None and read(tier, 1) is None
        assert read(tier, 2, tokens(7)) is None
    assert tier.num_bad_files == 3 and tier.num_reads == 0
    assert not any(os.path.exists(p) for p in (p0, p1, p2)) and tier.num_files == 0
    why = [r.getMessage() for r in caplog.records]
    assert len(why) == 3 and "MAC" in why[0] and "MAC" in why[1] and "other tokens" in why[2]


def test_a_renamed_file_fails_its_header(make_tier):
    tier = make_tier()
    write(tier, [0, 1])
    os.replace(tier._path(page_hash(0)), tier._path(page_hash(1)))  # page 0's file under page 1's name
    assert read(tier, 1, tokens(0)) is None and tier.num_bad_files == 1


def test_links_and_fifos_are_never_followed_nor_waited_on(make_tier, tmp_path):
    tier = make_tier()
    write(tier, [0, 1, 2])
    target = tmp_path / "elsewhere.kvp"
    os.replace(tier._path(page_hash(0)), target)
    os.symlink(target, tier._path(page_hash(0)))  # a link to an authentic file: still not ours to follow
    os.remove(tier._path(page_hash(1)))
    os.mkfifo(tier._path(page_hash(1)))  # no writer ever opens it: a blocking open would hang here
    result: list = []
    t = threading.Thread(target=lambda: result.extend([read(tier, 0), read(tier, 1)]), daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive() and result == [None, None]
    assert tier.num_bad_files == 2 and target.exists()  # the link removed, never its target
    assert not os.path.lexists(tier._path(page_hash(0))) and not os.path.lexists(tier._path(page_hash(1)))
    assert torch.equal(read(tier, 2), page(2))
    tier.stop()
    # Found by the scan at a start: removed and counted, not indexed.
    os.symlink(target, tier._path(page_hash(5)))
    os.mkfifo(tier._path(page_hash(6)))
    again = make_tier()
    assert again.num_bad_files == 2 and files(again) == [page_hash(2).hex() + ".kvp"]


def test_a_key_others_could_read_is_replaced(make_tier, caplog):
    first = make_tier()
    write(first, [0])
    first.stop()
    key = os.path.join(first.root, "key")
    os.chmod(key, 0o644)
    with caplog.at_level(logging.WARNING, logger="nodeserve.kv.disk"):
        again = make_tier()
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600 and "replaced" in caplog.text
    assert read(again, 0) is None and again.num_bad_files == 1  # written under the old key


def test_the_kv_layout_version_is_in_the_fingerprint(tmp_path, monkeypatch):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights")
    fp = model_fingerprint(str(model), "llama")
    monkeypatch.setattr(disk, "KV_LAYOUT_VERSION", disk.KV_LAYOUT_VERSION + 1)
    assert model_fingerprint(str(model), "llama") != fp


def test_other_fingerprints_pages_count_against_the_budget(make_tier):
    a = make_tier(FP_A)
    write(a, range(3))
    a.stop()
    b = make_tier(FP_B, max_bytes=4 * FILE)
    assert b.num_foreign_bytes == 3 * FILE
    write(b, range(10, 13))  # room for one page beside A's three
    assert b.num_files == 1 and b.num_bytes + b.num_foreign_bytes <= b.max_bytes
    assert len(files(a)) == 3  # A's pages are not B's to delete


def test_disk_path_may_be_a_link_the_operator_made_but_not_what_is_inside(make_tier, tmp_path, caplog):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    tier = make_tier(root=tmp_path / "link")
    write(tier, [0])
    assert tier.num_files == 1 and not tier.disabled
    tier.stop()
    # a fingerprint directory replaced by a link (to a directory someone else can write): the tier stays off
    (tmp_path / "elsewhere").mkdir()
    os.rename(tier.dir, tmp_path / "moved")
    os.symlink(tmp_path / "elsewhere", tier.dir)
    with caplog.at_level(logging.WARNING, logger="nodeserve.kv.disk"):
        off = make_tier(root=tmp_path / "link")
    assert off.disabled and "not a directory owned by this user" in off.disabled and "tier off" in caplog.text
    assert off.match([page_hash(0)]) == 0 and os.listdir(tmp_path / "elsewhere") == []
