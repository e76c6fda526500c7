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


class KVEventLog:
    """The node's pending events, appended from any thread, taken in order by the publisher's thread."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._events: list[KVCacheEvent] = []
        self._lock = threading.Lock()

    def sink(self, medium: str) -> KVEventSink:
        return KVEventSink(self, medium)

    def append(self, event: KVCacheEvent) -> None:
        with self._lock:
            self._events.append(event)

    def cleared(self) -> None:
        self.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events


class KVEventSink:
    """One index's events. Its owner calls it under the lock that guards the change, so a page stored and then
    evicted on two threads is never reported in the other order."""

    def __init__(self, log: KVEventLog, medium: str):
        self.log, self.medium = log, medium

    def stored(self, hashes: Sequence[bytes], parent: bytes | None = None, token_ids: Sequence[int] = ()) -> None:
        """Consecutive pages of one prefix: `parent` is the page before the first; token_ids are every page's
        tokens, or empty where this index does not know them (the host and disk tiers, as vLLM's CPU tier)."""
        self.log.append(BlockStored([event_hash(h) for h in hashes], None if parent is None else event_hash(parent),
                                    list(token_ids), self.log.block_size, None, self.medium, None))

    def removed(self, hashes: Sequence[bytes]) -> None:
        if hashes:
            self.log.append(BlockRemoved([event_hash(h) for h in hashes], self.medium))
