"""A router's view of a real server through its KV events: a subscriber that joins late and loses a batch
rebuilds, through replay, the exact page index /debug/kv reports (every device pool, the host tier and the disk
tier) after a workload that evicts from all of them."""

from __future__ import annotations

import json
import socket
import time
import urllib.request

import msgspec
import openai
import pytest
import zmq

from nodeserve.kv.events import AllBlocksCleared, BlockStored, KVEventBatch

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Subscriber:
    """What llm-d's or Dynamo's indexer does: apply batches in sequence order, and fetch any gap by replay."""

    def __init__(self, ctx: zmq.Context, endpoint: str, replay: str):
        self.ctx, self.replay_endpoint = ctx, replay
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.sub.bind(endpoint)  # the server connects to it (an address without *: vLLM's rule)
        self.next_seq = 0
        self.index: dict[str, set[int]] = {}
        self.topics: set[bytes] = set()
        self.num_replayed = 0
        self.num_stored_with_tokens = 0
        self._decode = msgspec.msgpack.Decoder(KVEventBatch)

    def pump(self, timeout_ms: int = 300, lose: int | None = None) -> None:
        """Reads until quiet for timeout_ms; `lose`: the sequence number of a batch to throw away, as a lossy
        network would."""
        while self.sub.poll(timeout_ms):
            topic, seq, payload = self.sub.recv_multipart()
            self.topics.add(topic)
            seq = int.from_bytes(seq, "big")
            if seq == lose or seq < self.next_seq:
                continue
            if seq > self.next_seq:
                for s, missed in self._replay(self.next_seq):
                    if s < seq:
                        self._apply(s, missed)
            self._apply(seq, self._decode.decode(payload))

    def _replay(self, start: int):
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        try:
            while dealer.poll(10_000):
                _, seq, payload = dealer.recv_multipart()
                if seq == END_SEQ:
                    return
                self.num_replayed += 1
                yield int.from_bytes(seq, "big"), self._decode.decode(payload)
            raise AssertionError("replay never ended")
        finally:
            dealer.close(0)

    def _apply(self, seq: int, batch: KVEventBatch) -> None:
        assert seq == self.next_seq, (seq, self.next_seq)
        self.next_seq += 1
        for e in batch.events:
            if isinstance(e, AllBlocksCleared):
                self.index.clear()
            elif isinstance(e, BlockStored):
                self.index.setdefault(e.medium, set()).update(e.block_hashes)
                self.num_stored_with_tokens += len(e.token_ids) == len(e.block_hashes) * e.block_size
            else:
                self.index.setdefault(e.medium, set()).difference_update(e.block_hashes)


def _debug_kv(server) -> dict:
    with urllib.request.urlopen(server.url + "/debug/kv?index=1", timeout=30) as r:
        return json.loads(r.read())


@pytest.mark.slow
def test_a_subscriber_rebuilds_the_servers_page_index_through_loss_and_replay(make_server, tmp_path):
    ctx = zmq.Context()
    pub, replay = f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}"
    sub = Subscriber(ctx, pub, replay)
    try:
        server = make_server(extra=f'[kv_events]\nenabled = true\nendpoint = "{pub}"\nreplay_endpoint = "{replay}"\n'
                                   'include_tokens = true\n',
                             # ~27 pages a device, ~40 host slots, a disk tier of ~60 pages: all of them evict
                             env={"NODESERVE_KV_MEMORY_GIB": "0.02", "NODESERVE_KV_HOST_MEMORY_GIB": "0.03",
                                  "NODESERVE_KV_DISK_PATH": str(tmp_path / "kv"), "NODESERVE_KV_DISK_GIB": "0.045"})
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        sub.pump()  # the server's start-up batches came before this subscriber joined: replay fills them in
        lost = None
        for i in range(14):
            prompt = f"Ledger {i}: " + " ".join(f"crate {i}-{j} holds {j * 7 % 13} tins of tea;" for j in range(20))
            client.completions.create(model="smollm2", prompt=prompt, max_tokens=4, temperature=0)
            if i == 6:
                lost = sub.next_seq + 1  # this one never arrives: the batch after it shows the gap
            sub.pump(timeout_ms=50, lose=lost if i == 6 else None)
        client.completions.create(model="smollm2", prompt="Ledger 3: " + " ".join(
            f"crate 3-{j} holds {j * 7 % 13} tins of tea;" for j in range(20)), max_tokens=4, temperature=0)
        deadline = time.monotonic() + 60
        while True:  # quiet: every disk write done and every batch delivered
            sub.pump()
            debug = _debug_kv(server)
            index = {m: set(h) for m, h in debug["index"].items()}
            got = {m: h for m, h in sub.index.items() if h or m in index}
            if got == index or time.monotonic() > deadline:
                break
        assert got == index
        assert set(index) == {"cpu:0", "cpu:1", "host", "disk"} and all(index.values())
        events = debug["kv_events"]
        assert sub.next_seq == events["num_batches"] and events["num_dropped_batches"] == 0
        assert sub.num_replayed > 0 and lost is not None and lost < sub.next_seq
        with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
            metrics = r.read().decode()
        assert f'nodeserve:kv_events_batches_total{{model_name="smollm2"}} {float(events["num_batches"])}' in metrics
        assert sub.topics == {f"kv@127.0.0.1:{server.port}@smollm2".encode()}
        assert sub.num_stored_with_tokens > 0  # the device pools name each page's tokens
        evictions = sum(p["num_evictions"] for p in debug["pools"])
        assert evictions > 0, debug["pools"]
        tiers = {t["tier"]: t for t in debug["tiers"]}
        assert tiers["host"]["num_evictions"] > 0 and tiers["disk"]["num_evictions"] > 0, tiers
    finally:
        sub.sub.close(0)
        ctx.destroy(0)
