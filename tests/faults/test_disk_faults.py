"""Faults at the disk tier, driven through real servers (subprocesses, the real openai client): files forged,
truncated, from another cache, a symlink and a FIFO in the cache directory (one met by the scan, one by a load,
where it used to hang the read forever), a second server on the same
directory, SIGKILL during the stop's flush then a restart. Each asserts: the server keeps answering, nothing is
served wrong (greedy text equals the cold run's), no page is held once idle, and a metric and a log line say what
happened. A full disk and a hung read are injected into a real engine (a server subprocess cannot take an
injected writer or reader)."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import re
import shutil
import signal
import stat
import time
import urllib.request

import openai
import pytest

from nodeserve.kv import disk as disk_module
from nodeserve.kv.disk import DiskTier
from nodeserve.kv.manager import hash_pages
from tests.server.conftest import Server

PAGE = 16
DEVICES = 'mode = "colocated"\ndevices = ["cpu:0"]'


def _prompt(topic: str, n: int) -> str:
    return f"Notes on {topic}. " + " ".join(f"Entry {i}: the {topic} log says item {i * 7 % 13} moved to bay {i % 5}."
                                            for i in range(n)) + "\nQuestion: which bay had item 3?\nAnswer:"


P, Q, R = _prompt("harbor", 30), _prompt("granary", 30), _prompt("orchard", 30)


def _start(tmp, disk: str) -> Server:
    os.makedirs(tmp, exist_ok=True)
    old = dict(os.environ)
    os.environ.update({"NODESERVE_KV_DISK_PATH": disk, "NODESERVE_KV_DISK_GIB": "1"})
    try:
        return Server(str(tmp), DEVICES)
    finally:
        os.environ.clear()
        os.environ.update(old)


def _complete(server: Server, prompt: str):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    return client.completions.create(model="smollm2", prompt=prompt, max_tokens=10, temperature=0)


def _get(server: Server, path: str) -> str:
    with urllib.request.urlopen(server.url + path, timeout=10) as r:
        return r.read().decode()


def _metric(server: Server, name: str, tier: str = "disk") -> float:
    m = re.search(rf'^nodeserve:{name}(?:_total)?{{[^}}]*tier="{tier}"[^}}]*}} (\S+)$', _get(server, "/metrics"), re.M)
    assert m, name
    return float(m.group(1))


def _log(server: Server) -> str:
    server.log.flush()
    with open(server.log.name) as f:
        return f.read()


def _idle_and_whole(server: Server) -> None:
    """No request in flight, every device page free, no host slot held (after the drain of what ran)."""
    for _ in range(100):
        kv = json.loads(_get(server, "/debug/kv"))
        host = [t for t in kv["tiers"] if t["tier"] == "host"]
        if kv["num_pending"] == 0 and all(p["num_free"] == p["num_pages"] and p["num_running"] == 0
                                          and p["num_waiting"] == 0 for p in kv["pools"]) \
                and all(t["num_held"] == 0 for t in host):
            return
        time.sleep(0.1)
    pytest.fail(f"pages or requests still held: {kv}")


def _page_files(disk: str) -> dict[str, str]:
    return {f: os.path.join(dp, f) for dp, _, fs in os.walk(disk) for f in fs if f.endswith(".kvp")}


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """A disk tier holding P's and Q's pages (written at a SIGTERM), the cold greedy texts, and the prompts'
    token ids as the server counts them."""
    root = tmp_path_factory.mktemp("filled")
    disk = str(root / "kv")
    s = _start(root / "a", disk)
    try:
        cold = {p: _complete(s, p) for p in (P, Q, R)}
        ids = {p: json.loads(urllib.request.urlopen(urllib.request.Request(
            s.url + "/tokenize", data=json.dumps({"model": "smollm2", "prompt": p}).encode(),
            headers={"Content-Type": "application/json"}), timeout=10).read())["tokens"] for p in (P, Q, R)}
    finally:
        s.stop()
    assert s.proc.returncode == 0, s.output()
    assert all(c.usage.prompt_tokens_details.cached_tokens == 0 for c in cold.values())
    return disk, {p: c.choices[0].text for p, c in cold.items()}, ids


def test_forged_truncated_foreign_files_a_symlink_a_fifo_and_a_second_server(filled, tmp_path):
    src, cold, ids = filled
    disk = str(tmp_path / "kv")
    shutil.copytree(src, disk, symlinks=True)
    files = _page_files(disk)
    p_pages = [files[h.hex() + ".kvp"] for h in hash_pages(ids[P], PAGE)[:(len(ids[P]) - 1) // PAGE]]
    q_pages = [files[h.hex() + ".kvp"] for h in hash_pages(ids[Q], PAGE)[:(len(ids[Q]) - 1) // PAGE]]
    size = os.path.getsize(p_pages[0])
    # P: page 2 forged (right size and header, no key), pages 5-7 truncated, a symlink, a FIFO.
    with open(p_pages[2], "r+b") as f:
        f.seek(-40, os.SEEK_END)
        f.write(os.urandom(40))
    with open(p_pages[5], "r+b") as f:
        f.truncate(size // 2)
    os.remove(p_pages[6])
    os.symlink(p_pages[0], p_pages[6])
    os.remove(p_pages[7])
    os.mkfifo(p_pages[7])
    # Q: page 1 from another cache (authentic under its own key, not this one's), for the same hash and tokens.
    fingerprint = os.path.basename(os.path.dirname(q_pages[1]))
    page_nbytes = size - (disk_module.HEADER.size + PAGE * 8 + disk_module.MAC_BYTES)
    other = DiskTier(str(tmp_path / "other"), 1 << 30, fingerprint, page_nbytes, page_size=PAGE)
    other.start()
    import torch
    h1 = hash_pages(ids[Q], PAGE)[1]
    other.put(h1, torch.zeros(page_nbytes, dtype=torch.uint8), ids[Q][PAGE:2 * PAGE])
    assert other.flush(10)
    other.stop()
    shutil.copyfile(other._path(h1), q_pages[1])

    s = _start(tmp_path / "b", disk)
    try:
        assert re.search(r"3 bad files and 0 half-written ones removed", _log(s))  # truncated, link, FIFO
        warm_p, warm_q = _complete(s, P), _complete(s, Q)
        assert warm_p.choices[0].text == cold[P] and warm_q.choices[0].text == cold[Q]
        assert warm_p.usage.prompt_tokens_details.cached_tokens == 2 * PAGE  # pages 0-1; the forged 2 ends it
        assert warm_q.usage.prompt_tokens_details.cached_tokens == 1 * PAGE
        # R: its page 2 turned into a FIFO after the start's scan, so a load meets it (the hung read: no
        # writer ever opens it, and a blocking open waited forever).
        r_page = files[hash_pages(ids[R], PAGE)[2].hex() + ".kvp"]
        os.remove(r_page)
        os.mkfifo(r_page)
        t0 = time.monotonic()
        warm_r = _complete(s, R)
        assert time.monotonic() - t0 < 30 and warm_r.choices[0].text == cold[R]
        assert warm_r.usage.prompt_tokens_details.cached_tokens == 2 * PAGE
        assert _metric(s, "kv_tier_bad_files") == 6
        log = _log(s)
        assert log.count("its MAC does not match") == 2, log[-3000:]
        assert log.count("cannot be opened as a regular file") == 1
        for path in p_pages[6:8]:  # removed at the scan; maybe written again since, as a regular file
            assert not os.path.lexists(path) or stat.S_ISREG(os.lstat(path).st_mode)
        _idle_and_whole(s)

        # A second server on the same directory refuses to start, with one line, before it loads any weights
        # (it used to load the model first: a minute for a large one); the first keeps answering.
        with pytest.raises(RuntimeError, match="exited with 2") as e:
            _start(tmp_path / "c", disk)
        lines = [ln for ln in str(e.value).splitlines() if "in use by another nodeserve process" in ln]
        assert len(lines) == 1 and f"(pid {s.proc.pid})" in lines[0], str(e.value)[-2000:]
        assert "loading weights" not in str(e.value), str(e.value)[-2000:]
        assert _complete(s, P).choices[0].text == cold[P]
        _idle_and_whole(s)
    finally:
        s.stop()
    assert s.proc.returncode == 0


def test_sigkill_during_the_stops_flush_then_a_restart(filled, tmp_path):
    src, cold, ids = filled
    disk = str(tmp_path / "kv")
    shutil.copytree(src, disk, symlinks=True)
    for path in _page_files(disk).values():
        os.remove(path)  # an empty cache: the stop has every page to write
    s = _start(tmp_path / "d", disk)
    try:
        for p in (P, Q):
            assert _complete(s, p).choices[0].text == cold[p]
        s.proc.send_signal(signal.SIGTERM)
        for _ in range(200):  # SIGKILL as soon as the stop reaches the engine (the drain is instant: idle)
            if "signal received" in _log(s):
                break
            time.sleep(0.01)
        s.proc.kill()
        s.proc.wait(10)
    finally:
        s.stop()
    # What a kill mid-write leaves: a temp file (planted, as the kill's timing cannot be chosen).
    fp_dir = next(os.path.join(disk, d) for d in os.listdir(disk) if len(d) == 32)
    with open(os.path.join(fp_dir, hash_pages(ids[P], PAGE)[0].hex() + ".kvp.999.abcd.tmp"), "wb") as f:
        f.write(b"half a page")

    again = _start(tmp_path / "e", disk)  # the kernel dropped the killed owner's flock
    try:
        assert re.search(r"\d+ bad files and 1 half-written ones removed", _log(again))
        assert not [n for n in os.listdir(fp_dir) if n.endswith(".tmp")]
        warm = _complete(again, P)
        assert warm.choices[0].text == cold[P]
        _idle_and_whole(again)
    finally:
        again.stop()
    assert again.proc.returncode == 0


# ---- injected into a real engine: a full disk, recovered -----------------------------------------------------

def test_a_full_disk_mid_run_pauses_writes_and_they_resume(loaded_fp32, tmp_path, monkeypatch, caplog):
    from tests.runtime.test_kv_tiers import _config, _long_prompt, _run
    from tests.runtime.test_engine import _greedy, _tokens

    monkeypatch.setattr(disk_module, "RETRY_FIRST_S", 0.3)
    tok = loaded_fp32.tokenizer
    prompts = [_long_prompt(tok, seed, 120) for seed in (11, 12, 13)]

    class Full:
        def __init__(self):
            self.full = False

        def __call__(self, fd, parts):
            if self.full:
                raise OSError(errno.ENOSPC, "No space left on device")
            disk_module._write_all(fd, parts)

    async def body(engine):
        d = engine.tiers.disk
        full = Full()
        d.write = full
        out = [(await _tokens(engine.add_request(prompts[0], _greedy(max_tokens=4))))[0]]
        full.full = True
        out.append((await _tokens(engine.add_request(prompts[1], _greedy(max_tokens=4))))[0])
        engine.flush_cache()  # pushes nothing to disk by itself; the host tier took every page already
        await asyncio.sleep(0.1)
        paused_files, errors = d.num_files, d.num_write_errors
        full.full = False
        await asyncio.sleep(0.4)
        out.append((await _tokens(engine.add_request(prompts[2], _greedy(max_tokens=4))))[0])
        assert d.flush(10)
        stats = {t.tier: t for t in engine.tier_stats()}
        return out, paused_files, errors, d.num_files, d.paused, stats["disk"]

    def cold(engine_prompts):
        async def b(engine):
            return [(await _tokens(engine.add_request(p, _greedy(max_tokens=4))))[0] for p in engine_prompts]
        return _run(_config("colocated", 0.25, 0.05), loaded_fp32, b)

    with caplog.at_level(logging.WARNING, logger="nodeserve.kv.disk"):
        out, paused_files, errors, files, paused, stats = _run(
            _config("colocated", 0.25, 0.05, str(tmp_path / "kv"), host_write="through"), loaded_fp32, body,
            warmup=True)
    assert out == cold(prompts)
    assert errors >= 1 and stats.num_write_errors == errors and paused is None
    assert files > paused_files  # written again once space returned: no `disabled` for the process's life
    warnings = [r.getMessage() for r in caplog.records if r.name == "nodeserve.kv.disk"]
    assert sum("writes pause" in w for w in warnings) == 1 and sum("writes resumed" in w for w in warnings) == 1
