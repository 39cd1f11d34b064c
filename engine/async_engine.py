"""An asyncio front to the engine: one background thread steps it while any request is live.

Many coroutines stream from it at once. A consumer that stops iterating (a cancelled task, a client
that disconnected, a deadline that passed) aborts its request at once, which frees its KV blocks. A
bounded number of live requests is accepted; past it ``QueueFullError`` is raised. A request that a
fault inside the engine ended raises ``RequestFailedError`` in its consumer alone (the engine isolates
faults per request); the loop goes on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from engine.llm_engine import LLMEngine, PromptType
from engine.outputs import RequestOutput
from scheduler import SamplingParams

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The engine already holds its maximum number of live requests."""


class EngineDeadError(RuntimeError):
    """The engine has been shut down."""


class RequestFailedError(RuntimeError):
    """A fault inside the engine ended this request (the others go on)."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, max_live_requests: int = 256) -> None:
        if max_live_requests < 1:
            raise ValueError(f"max_live_requests must be positive, got {max_live_requests}")
        self.engine = engine
        self.max_live_requests = max_live_requests
        # Every engine call happens under _lock, taken through _locked(). The loop thread holds it for a
        # whole step and asks for it again at once; a bare Lock is not fair, so a coroutine waiting to add
        # or abort a request (blocking the event loop, hence every stream) could wait many steps.
        self._lock = threading.Lock()
        self._next = threading.Lock()  # whoever holds it takes _lock next
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stopping = False
        self._counter = 0
        self.num_failed_steps = 0
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Take the engine lock in turn: a caller waiting for it goes before the loop's next step."""
        with self._next:
            self._lock.acquire()
        try:
            yield
        finally:
            self._lock.release()

    @property
    def num_live_requests(self) -> int:
        return len(self._streams)

    async def generate(
        self, prompt: PromptType, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; raises ValueError for bad input, QueueFullError when full."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._locked():
            if self._stopping:
                raise EngineDeadError("the engine is shutting down")
            if len(self._streams) >= self.max_live_requests:
                raise QueueFullError(f"the server holds its maximum of {self.max_live_requests} live requests")
            if request_id is None or request_id in self._streams:
                self._counter += 1
                request_id = f"{request_id or 'req'}-{self._counter}"
            request_id = self.engine.add_request(prompt, params, request_id)
            self._streams[request_id] = stream
        self._wake.set()
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._locked():
            if self._streams.pop(request_id, None) is not None:
                self.engine.abort_request(request_id)

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            if isinstance(item, RequestOutput) and item.error is not None:
                item = RequestFailedError(item.error)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
            if isinstance(item, BaseException) or item.finished:
                del self._streams[request_id]

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            with self._locked():
                if self._stopping and not self._streams:
                    return
                if not self.engine.has_unfinished_requests():
                    self._wake.clear()
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as e:  # the engine isolates request faults; this is the last resort
                    self.num_failed_steps += 1
                    logger.exception("engine step failed; failing every live request")
                    live = list(self._streams)
                    self.engine.abort_request(live)
                    for request_id in live:
                        self._deliver(request_id, RuntimeError(f"engine step failed: {e}"))
                    continue
                for out in outputs:
                    self._deliver(out.request_id, out)

    def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Stop taking requests; let live ones finish for up to ``drain_timeout`` s, then abort the rest."""
        with self._locked():
            self._stopping = True
        self._wake.set()
        self._thread.join(timeout=drain_timeout)
        with self._locked():
            live = list(self._streams)
            self.engine.abort_request(live)
            for request_id in live:
                self._deliver(request_id, EngineDeadError("the server shut down"))
            self._streams.clear()
        self._wake.set()
        self._thread.join(timeout=5)
