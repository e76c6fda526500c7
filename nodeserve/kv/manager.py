"""KVManager: the one owner of a device's KV pages, and its prefix cache. Everything else holds page ids.

Interface in page ids: allocate / free / reserve / can_allocate / num_free, reference-counted so that a page
can have several holders. The prefix cache sits behind the same calls, as in vLLM v1: a full page whose KV is
written can be published under the hash of its tokens (chained over every earlier page, so a hash names the
whole prefix); allocate_prompt() shares the longest run of a prompt's page hashes held here and allocates the
rest. A published page whose last holder frees it stays cached, evictable: allocate() takes free pages first,
then evicts the least recently used cached ones, and num_free counts both, so admission keeps its guarantees.
An eviction is reported (on_evict) before the page is handed out, so a lower tier can keep its KV.
Pages allocated for a prompt's pages that are still to be computed are "in flight" under their hashes until
published or freed: a request with the same prefix can wait for them instead of computing them again.
Code outside kv/ takes pages through kv/reservation.py, never these methods directly.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

if TYPE_CHECKING:
    from nodeserve.kv.events import KVEventSink


class OutOfPages(Exception):
    """Not enough free pages for an allocation; nothing was allocated."""


def hash_pages(token_ids: Sequence[int], page_size: int, parent: bytes | None = None) -> list[bytes]:
    """The content hash of each full page of `token_ids`, each chained over the one before (`parent` before the
    first). A cryptographic hash: Python's hash() collides on purpose-built inputs, and a collision here would
    hand one request another's KV."""
    hashes = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        h = hashlib.blake2b(parent or b"", digest_size=16)
        h.update(array("q", token_ids[start:start + page_size]).tobytes())
        parent = h.digest()
        hashes.append(parent)
    return hashes



@dataclass(frozen=True)
class KVObservers:
    """Who hears of a page cache's pages, given to its KVManager when it is built."""

    # with the (page, hash, tokens or None) of the pages an allocation evicts, under the manager's lock, before
    # they are handed out: the host tier copies them out (kv/host.py). None: evicted KV is gone.
    on_evict: Callable[[list[tuple[int, bytes, array | None]]], None] | None = None
    # with the pages publish() entered and their hashes, outside the lock: the host tier's write-through.
    on_publish: Callable[[list[int], list[bytes]], None] | None = None
    events: KVEventSink | None = None  # every hash entering or leaving the cache ([kv_events])

class KVManager:
    """Thread-safe: the router reserves from the event loop while workers and transfers free from their threads.
    The page-leak invariant lives here: `num_used` is 0 once every request has ended (tests and /debug/kv read
    it), and freeing a page twice or one never handed out raises."""

    def __init__(self, num_pages: int, page_size: int, prefix_cache: bool = False, observers: KVObservers | None = None):
        """observers: who hears of this cache's pages (the host tier, the node's KV events); None: nobody."""
        observers = observers or KVObservers()
        self.num_pages, self.page_size, self.prefix_cache = num_pages, page_size, prefix_cache
        self._free = deque(range(num_pages))
        self._refcount = [0] * num_pages
        self._lock = threading.Lock()
        self.num_reserved = 0  # pages taken out of circulation for good (reserve)
        self.num_promised = 0  # free pages promised to requests that draw them later (kv/window.py)
        self._hash_of: dict[int, bytes] = {}      # published page -> its hash
        self._page_of: dict[bytes, int] = {}      # hash -> the page holding that prefix here
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached pages no one holds, least recent first
        self._computing: dict[bytes, int] = {}    # hash -> a page being filled with that prefix (in flight)
        self._computing_hash: dict[int, bytes] = {}  # the same, by page
        self._tokens_of: dict[int, array] = {}    # published page -> its tokens, when publish() was told them
        self._hits: dict[int, int] = {}           # published page -> holders it gained since (a stop's flush order)
        self.num_collisions = 0  # cached pages found under a prompt's hash holding other tokens (scrub())
        self.num_queried_tokens = 0  # prompt tokens looked up by allocate_prompt(), and how many were cached here
        self.num_hit_tokens = 0
        self.num_evictions = 0
        self.on_evict, self.on_publish, self.events = observers.on_evict, observers.on_publish, observers.events

    @property
    def num_free(self) -> int:
        """Pages an allocation can take: free ones and cached ones no request holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._hash_of)

    @property
    def num_usable(self) -> int:
        """Pages requests can ever hold: what admission and the page stats count."""
        return self.num_pages - self.num_reserved

    @property
    def num_used(self) -> int:
        """Pages some request holds (cached pages no one holds count as free)."""
        return self.num_usable - self.num_free

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def num_available(self) -> int:
        """Free pages no one was promised: what a new allocation or promise can take."""
        return self.num_free - self.num_promised

    def can_allocate(self, count: int) -> bool:
        return count <= self.num_available

    def allocate(self, count: int) -> list[int]:
        """`count` page ids, each with one holder; raises OutOfPages (allocating nothing) if too few are free."""
        with self._lock:
            return self._allocate(count)

    def _allocate(self, count: int, promised: bool = False) -> list[int]:
        if count > (self.num_free if promised else self.num_available):
            raise OutOfPages(f"need {count} pages, {self.num_available} free")
        num_fresh = min(count, len(self._free))
        pages = [self._free.popleft() for _ in range(num_fresh)]
        if count > num_fresh:
            evicted = [self._evict() for _ in range(count - num_fresh)]
            self.num_evictions += len(evicted)
            if self.events is not None:
                self.events.removed([h for _, h, _ in evicted])
            if self.on_evict is not None:
                self.on_evict(evicted)
            pages += [b for b, _, _ in evicted]
        for b in pages:
            self._refcount[b] = 1
        return pages

    def allocate_tokens(self, num_tokens: int) -> list[int]:
        """Fresh pages (none shared) for num_tokens tokens: a moved request's reservation on its target, which its
        copies then write whole. Raises OutOfPages, allocating nothing, if too few are free."""
        return self.allocate(self.pages_for(num_tokens))

    def _evict(self) -> tuple[int, bytes, array | None]:
        page, _ = self._evictable.popitem(last=False)
        h = self._hash_of.pop(page)
        del self._page_of[h]
        return page, h, self._tokens_of.pop(page, None)

    def visit_evictable(self, max_pages: int, fn: Callable[[list[tuple[int, bytes, array | None]]], None]) -> None:
        """fn((page, hash, tokens or None) of the max_pages least recently used cached pages no one holds, oldest
        first), under the lock: those pages are neither evicted nor handed out while fn runs, so it may read them (a
        write-back tier copies them out ahead of their eviction)."""
        with self._lock:
            fn([(b, self._hash_of[b], self._tokens_of.get(b)) for b, _ in zip(self._evictable, range(max_pages))])

    def share(self, pages: Iterable[int]) -> None:
        """Adds a holder to pages that are allocated or cached."""
        with self._lock:
            self._hold(pages)

    def _hold(self, pages: Iterable[int]) -> None:
        for b in pages:
            if self._refcount[b] == 0 and b not in self._evictable:
                raise ValueError(f"page {b} is not allocated")
            self._evictable.pop(b, None)
            self._refcount[b] += 1
            if b in self._hash_of:
                self._hits[b] = self._hits.get(b, 0) + 1

    def free(self, pages: Iterable[int]) -> None:
        """Drops one holder of each page; a page with none left is free again, or, if published, cached.
        Last page first: a request's tail is then evicted before the prefix others are likelier to share."""
        with self._lock:
            self._free_locked(pages)

    def _free_locked(self, pages: Iterable[int]) -> None:
        for b in reversed(list(pages)):
            if self._refcount[b] <= 0:
                raise ValueError(f"page {b} freed twice")
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                self._settle(b)
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def promise(self, count: int) -> None:
        """Sets `count` free pages aside for a request that draws them later, one step at a time (draw): what it
        will need is then there whenever it asks. Raises OutOfPages, promising nothing, if too few are free."""
        with self._lock:
            if count > self.num_available:
                raise OutOfPages(f"need {count} pages, {self.num_available} free")
            self.num_promised += count

    def draw(self, count: int) -> list[int]:
        """`count` pages out of a promise made earlier (never fails while the promise covers them)."""
        with self._lock:
            if count > self.num_promised:
                raise ValueError(f"drawing {count} pages, {self.num_promised} promised")
            pages = self._allocate(count, promised=True)
            self.num_promised -= count
            return pages

    def unpromise(self, count: int) -> None:
        """Gives back `count` promised pages no one will draw."""
        with self._lock:
            if count > self.num_promised:
                raise ValueError(f"unpromising {count} pages, {self.num_promised} promised")
            self.num_promised -= count

    def free_to_promise(self, pages: Sequence[int], count: int) -> None:
        """free(pages), `count` of them promised again to the same holder, in one step: a request that gives back
        pages it may need again later (window pages it slid past) keeps its claim on that many."""
        with self._lock:
            self._free_locked(pages)
            self.num_promised += count

    def reserve(self) -> int:
        """Takes one page out of circulation for the manager's lifetime (CUDA graph padding rows write there)."""
        page = self.allocate(1)[0]
        self.num_reserved += 1
        return page

    # ---- the prefix cache ----------------------------------------------------------------------------------
    def lookup(self, hashes: Sequence[bytes], num_prompt_tokens: int | None = None) -> list[int]:
        """The pages holding the longest prefix of `hashes` here, as allocate_prompt() would share them when given
        num_prompt_tokens (no holder is added)."""
        with self._lock:
            return self._match(hashes, num_prompt_tokens)

    def allocate_prompt(self, hashes: Sequence[bytes], num_prompt_tokens: int, count: int) -> tuple[list[int], int]:
        """`count` pages for a request whose prompt has these page hashes: the first ones hold the longest prefix
        cached here (shared: a holder added to each), the rest are fresh, and those of the rest that will hold
        full prompt pages are in flight until published. Returns (pages, cached prompt tokens).
        Needs `count` free, as if nothing were cached; raises OutOfPages otherwise. Counts the prompt as
        queried and the cached part as hits (in tokens, as vLLM counts them)."""
        with self._lock:  # one step: no eviction between finding the prefix and holding it
            if count > self.num_available:
                raise OutOfPages(f"need {count} pages, {self.num_available} free")
            cached = self._match(hashes, num_prompt_tokens)
            self._hold(cached)
            pages = cached + self._allocate(count - len(cached))
            if self.prefix_cache:
                self.num_queried_tokens += num_prompt_tokens
                self.num_hit_tokens += len(cached) * self.page_size
                for b, h in zip(pages[len(cached):], hashes[len(cached):]):
                    if h not in self._computing and h not in self._page_of:
                        self._computing[h], self._computing_hash[b] = b, h
            return pages, len(cached) * self.page_size

    def share_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """Adds a holder to the pages of the longest cached prefix of `hashes`: share() of what lookup() finds, in
        one step (no eviction between finding and holding), for a request about to copy them elsewhere. Not an
        allocation: it takes no free page and evicts nothing (the cached pages it holds stop counting as free until
        freed). Free them with free()."""
        with self._lock:
            pages = self._match(hashes)
            self._hold(pages)
            return pages

    def share_all(self, hashes: Sequence[bytes]) -> list[int] | None:
        """Adds a holder to the cached pages of every one of `hashes` (not a prefix: any run of a chain, as a
        sliding window's pages are, kv/window.py), in one step; None, holding nothing, if one is not cached."""
        with self._lock:
            pages = [self._page_of.get(h) for h in hashes] if self.prefix_cache else [None]
            if any(b is None for b in pages):
                return None
            held = [b for b in pages if b is not None]
            self._hold(held)
            return held

    def num_in_flight(self, hashes: Sequence[bytes]) -> int:
        """How many of the leading `hashes` some request here is computing now (allocated, not yet published)."""
        n = 0
        with self._lock:
            for h in hashes if self.prefix_cache else ():
                if h not in self._computing:
                    break
                n += 1
        return n

    def _settle(self, page: int) -> None:
        """A page stops being in flight (published, or freed before it was)."""
        h = self._computing_hash.pop(page, None)
        if h is not None:
            del self._computing[h]

    def _match(self, hashes: Sequence[bytes], num_prompt_tokens: int | None = None) -> list[int]:
        """The pages of the longest cached prefix of `hashes`; with num_prompt_tokens, never the page holding the
        prompt's last token, which runs again for the first token's logits."""
        if num_prompt_tokens is not None:
            hashes = hashes[:(num_prompt_tokens - 1) // self.page_size]
        pages: list[int] = []
        for h in hashes if self.prefix_cache else ():
            if (b := self._page_of.get(h)) is None:
                break
            pages.append(b)
        return pages

    def scrub(self, hashes: Sequence[bytes], token_ids: Sequence[int], stop_at_miss: bool = True) -> int:
        """Checks the cached pages matching a prompt's leading `hashes` against its tokens: a page found under a
        hash but holding other tokens (a hash collision) leaves the cache, so the prompt's match stops before
        it and the prompt computes its own KV there. Returns how many pages left (0 or 1: nothing past a
        collision can match, its hashes chain over it). Pages published without tokens are taken as they are.
        stop_at_miss False: checks every page of the prompt found here, not only the leading run (a lower tier,
        whose pages a prompt takes after those it finds on a device)."""
        size = self.page_size
        with self._lock:
            for i, h in enumerate(hashes if self.prefix_cache else ()):
                if (b := self._page_of.get(h)) is None:
                    if stop_at_miss:
                        return 0
                    continue
                stored = self._tokens_of.get(b)
                if stored is not None and stored != array("q", token_ids[i * size:(i + 1) * size]):
                    self.num_collisions += 1
                    self._unpublish(b)
                    return 1
            return 0

    def _unpublish(self, page: int) -> None:
        """Takes a page out of the cache: its holders keep it, private; freed by no one, it is free."""
        h = self._hash_of.pop(page)
        del self._page_of[h]
        self._tokens_of.pop(page, None)
        if self.events is not None:
            self.events.removed([h])
        if page in self._evictable:
            del self._evictable[page]
            self._free.append(page)

    def drop_cached(self) -> int:
        """Forgets every cached page no one holds (they become free); returns how many. Held pages stay."""
        with self._lock:
            dropped = [self._hash_of.pop(b) for b in self._evictable]
            for b, h in zip(self._evictable, dropped):
                del self._page_of[h]
                self._tokens_of.pop(b, None)
                self._free.append(b)
            if self.events is not None:
                self.events.removed(dropped)
            num = len(self._evictable)
            self._evictable.clear()
            return num

    def tokens_of(self, pages: Sequence[int]) -> list[array | None]:
        """Each page's tokens as publish() was told them (None: not told)."""
        with self._lock:
            return [self._tokens_of.get(b) for b in pages]

    def hits_of(self, pages: Sequence[int]) -> list[int]:
        """How many holders each published page gained since it was published (prefix hits, mostly)."""
        with self._lock:
            return [self._hits.get(b, 0) for b in pages]

    def cached_pages(self) -> list[tuple[int, bytes]]:
        """Every published page with its hash, least recently used first among those no one holds."""
        with self._lock:
            held = [(b, h) for b, h in self._hash_of.items() if b not in self._evictable]
            return [(b, self._hash_of[b]) for b in self._evictable] + held

    def publish(self, pages: Sequence[int], hashes: Sequence[bytes], parent: bytes | None = None,
                token_ids: Sequence[int] = (), page_tokens: Sequence[array | None] = ()) -> None:
        """Enters full pages whose KV is written into the cache, each under its hash. A hash already cached on
        another page (two requests computed the same prefix at once) keeps the first; this page stays private.
        parent (the hash of the page before the first) and token_ids (every page's tokens) are for the KV events;
        page_tokens: each page's tokens (None: unknown) for scrub(), when token_ids is not given (a lower tier
        taking pages from a pool)."""
        if not self.prefix_cache:
            return
        entered: list[int] = []
        with self._lock:
            for i, (b, h) in enumerate(zip(pages, hashes)):
                if self._refcount[b] <= 0:
                    raise ValueError(f"page {b} is not allocated")
                self._settle(b)
                if h not in self._page_of and b not in self._hash_of:
                    self._page_of[h], self._hash_of[b], self._hits[b] = b, h, 0
                    if token_ids:
                        self._tokens_of[b] = array("q", token_ids[i * self.page_size:(i + 1) * self.page_size])
                    elif page_tokens and page_tokens[i] is not None:
                        self._tokens_of[b] = page_tokens[i]
                    entered.append(i)
            if entered and self.events is not None:
                self._report_stored(entered, hashes, parent, token_ids)
        if entered and self.on_publish is not None:
            self.on_publish([pages[i] for i in entered], [hashes[i] for i in entered])

    def _report_stored(self, entered: list[int], hashes: Sequence[bytes], parent: bytes | None,
                       token_ids: Sequence[int]) -> None:
        """One BlockStored per run of consecutive pages entered (a page cached elsewhere breaks a run)."""
        size, start = self.page_size, 0
        for k in range(1, len(entered) + 1):
            if k == len(entered) or entered[k] != entered[k - 1] + 1:
                first, last = entered[start], entered[k - 1] + 1
                self.events.stored(hashes[first:last], hashes[first - 1] if first else parent,
                                   token_ids[first * size:last * size] if token_ids else ())
                start = k
