"""RequestStream: a request's token events as the event loop reads them (`async for`)."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from nodeserve.core.request import Request, TokenEvent


class RequestStream:
    """The tokens of one request as they are produced; iterate with `async for`. Ends after the event
    that carries a finish_reason: the stream closes when that event is queued, so whatever ends a request
    (its last token, an error, an abort) reaches the reader, and later events are dropped."""

    def __init__(self, request: Request):
        self.request = request
        self._queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.done = False  # the final event is queued

    def put(self, event: TokenEvent) -> None:
        if not self.done:
            self.done = event.finish_reason is not None
            self._queue.put_nowait(event)

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[TokenEvent]:
        while True:
            event = await self._queue.get()
            yield event
            if event.finish_reason is not None:
                return
