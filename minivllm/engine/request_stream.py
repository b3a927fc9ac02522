"""RequestStream: one request's outputs, carried from the engine thread to the asyncio loop that reads them
(vLLM v1's RequestOutputCollector).

Owns: the unread outputs of one request, at most one merged output at a time, and aborting the request when its
reader leaves early. Only the engine thread puts; only the reader's event loop reads.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from minivllm.outputs import CompletionOutput, RequestOutput


class RequestStream:
    """One request's outputs, carried from the engine thread to the asyncio loop that added it.

        stream = await async_engine.add_request(prompt, params)   # ValueError here: nothing started
        async with stream:                                        # leaving the block early aborts it
            async for out in stream:                              # RequestOutput (see params.output_kind)
                ...

    Iteration ends after the output with `finished=True`; a RequestError is raised if the engine could not
    finish the request. The stream holds at most one unread output (vLLM's RequestOutputCollector): when the reader
    lags, new DELTA outputs are merged into the unread one and a CUMULATIVE output replaces it, so a slow reader
    costs memory only for what it has not read yet, never a queue of stale copies.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, abort: Callable[[str], None],
                 delta: bool):
        self.request_id = request_id
        self.finished = False                 # set once the final output (or an error) has been read
        self._loop = loop
        self._abort = abort
        self._delta = delta
        self._unread: list[RequestOutput] = []        # DELTA outputs not read yet, merged when read
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Engine thread only. Raises RuntimeError if the consumer's event loop is closed."""
        self._loop.call_soon_threadsafe(self._put, item)

    def _put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = item
        elif self._delta:
            self._unread.append(item)
        else:
            self._unread = [item]
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        await self._ready.wait()
        self._ready.clear()
        if self._unread:
            unread, self._unread = self._unread, []
            out = _merge_deltas(unread) if len(unread) > 1 else unread[0]
            self.finished = out.finished
            if self._error is not None:
                self._ready.set()             # the error comes next
            return out
        self.finished = True
        raise self._error

    def close(self) -> None:
        """Abort the request unless its final output was read. Safe to call twice, from the loop's thread."""
        if not self.finished:
            self.finished = True
            self._abort(self.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.close()


def _merge_deltas(outputs: list[RequestOutput]) -> RequestOutput:
    """Several DELTA outputs of one request as one: each sample's (by index) texts, token ids and logprobs joined,
    its finish reason from its newest piece; the prompt logprobs from the output that carried them (the first);
    the rest from the newest output. Linear in what is merged."""
    texts: dict[int, list[str]] = {}
    token_ids: dict[int, list[int]] = {}
    logprobs: dict[int, list] = {}
    newest: dict[int, CompletionOutput] = {}
    for out in outputs:
        for c in out.outputs:
            texts.setdefault(c.index, []).append(c.text)
            token_ids.setdefault(c.index, []).extend(c.token_ids)
            if c.logprobs is not None:
                logprobs.setdefault(c.index, []).extend(c.logprobs)
            newest[c.index] = c
    merged = [dataclasses.replace(newest[i], text="".join(texts[i]), token_ids=token_ids[i],
                                  logprobs=logprobs.get(i, newest[i].logprobs)) for i in sorted(newest)]
    prompt_logprobs = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None)
    return dataclasses.replace(outputs[-1], outputs=merged, prompt_logprobs=prompt_logprobs)
