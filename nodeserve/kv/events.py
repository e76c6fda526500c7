"""KV events: what entered and left each KV index (a device pool, the host tier, the disk tier), in vLLM's structs.

Routers outside the node (llm-d's KV-cache indexer, Dynamo's KV router) rebuild which prefixes each server holds
from these events. The structs are vLLM's (vllm/distributed/kv_events.py), array layout, so the msgpack bytes are
the ones those consumers already parse: ["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium,
lora_name], ["BlockRemoved", hashes, medium], ["AllBlocksCleared"].

Each index reports its changes under its own lock to a KVEventSink, which appends them to the node's KVEventLog,
so the log holds every index's changes in the order they happened; runtime/kv_events.py sends it on.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """The base of the three events; the tag (the class name) is the array's first element."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def event_hash(h: bytes) -> int:
    """A page hash as the 64-bit unsigned integer the events carry: its first 8 bytes. vLLM's consumers key
    blocks by 64-bit integers; at 2^64 a collision between two of a node's pages is not a practical concern."""
    return int.from_bytes(h[:8], "big")


MAX_PENDING_EVENTS = 100_000  # vLLM's max_queue_size


class KVEventLog:
    """The node's pending events, appended from any thread, taken in order by the publisher's thread.

    include_tokens: BlockStored carries each page's token ids (vLLM always sends them; Dynamo's router needs them,
    llm-d's indexer keys by hash alone). Off, token_ids is an empty list: the events then reveal which prefixes are
    cached, by hash, but not what they say. max_events bounds what waits for the publisher: past it, appends are
    dropped and counted (the publisher turns that into a sequence gap subscribers can see)."""

    def __init__(self, block_size: int, include_tokens: bool = False, max_events: int = MAX_PENDING_EVENTS):
        self.block_size, self.include_tokens, self.max_events = block_size, include_tokens, max_events
        self.num_dropped = 0  # in all
        self._num_dropped_since = 0  # since the last take
        self._events: list[KVCacheEvent] = []
        self._lock = threading.Lock()

    def sink(self, medium: str, chained: bool = True) -> KVEventSink:
        return KVEventSink(self, medium, chained)

    def append(self, event: KVCacheEvent) -> None:
        with self._lock:
            if len(self._events) >= self.max_events:
                self.num_dropped += 1
                self._num_dropped_since += 1
                return
            self._events.append(event)

    def cleared(self) -> None:
        self.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        return self.take_batch()[0]

    def take_batch(self) -> tuple[list[KVCacheEvent], int]:
        """The pending events, and how many were dropped since the last take (they came before these)."""
        with self._lock:
            events, self._events = self._events, []
            dropped, self._num_dropped_since = self._num_dropped_since, 0
        return events, dropped


class KVEventSink:
    """One index's events. Its owner calls it under the lock that guards the change, so a page stored and then
    evicted on two threads is never reported in the other order.

    chained False: this index's pages arrive in any order (the host and disk tiers take a device pool's LRU
    evictions, and their start-up scan, page by page), so a list of hashes given here is not a prefix chain: each
    page is reported as a BlockStored of its own, with no parent, instead of claiming that each follows the one
    before it."""

    def __init__(self, log: KVEventLog, medium: str, chained: bool = True):
        self.log, self.medium, self.chained = log, medium, chained

    def stored(self, hashes: Sequence[bytes], parent: bytes | None = None, token_ids: Sequence[int] = ()) -> None:
        """Consecutive pages of one prefix (chained sinks): `parent` is the page before the first; token_ids are
        every page's tokens, or empty where this index does not know them (the host and disk tiers, as vLLM's CPU
        tier). Unchained sinks: any pages, each reported alone."""
        size = self.log.block_size
        tokens = list(token_ids) if self.log.include_tokens else []
        if not self.chained:
            for i, h in enumerate(hashes):
                self.log.append(BlockStored([event_hash(h)], None, tokens[i * size:(i + 1) * size], size, None,
                                            self.medium, None))
            return
        self.log.append(BlockStored([event_hash(h) for h in hashes], None if parent is None else event_hash(parent),
                                    tokens, size, None, self.medium, None))

    def removed(self, hashes: Sequence[bytes]) -> None:
        if hashes:
            self.log.append(BlockRemoved([event_hash(h) for h in hashes], self.medium))
