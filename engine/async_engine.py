"""An asyncio front to the engine: one background thread steps it while any request is live.

Many coroutines stream from it at once. Only the engine thread touches the engine: ``generate`` and
``abort`` queue their work for it (run between steps) and never wait for a step, so the event loop stays
free to accept calls however long a step takes. A consumer that stops iterating (a cancelled task, a
client that disconnected, a deadline that passed) aborts its request before the next step, which frees
its KV blocks. A bounded number of live requests is accepted; past it ``QueueFullError`` is raised. A
request that a fault inside the engine ended raises ``RequestFailedError`` in its consumer alone (the
engine isolates faults per request); the loop goes on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from lookahead_serve.engine.llm_engine import LLMEngine, PromptType
from lookahead_serve.engine.outputs import RequestOutput
from lookahead_serve.scheduler import SamplingParams

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


@dataclass
class _Add:
    """A request waiting for the engine thread to add it; ``added`` resolves to its engine id."""

    prompt: PromptType
    params: SamplingParams | None
    request_id: str | None
    stream: _Stream
    added: asyncio.Future
    cancelled: bool = False  # its caller went away before it was added
    engine_id: str | None = None  # the id it was added under


def _resolve(future: asyncio.Future, result=None, error: BaseException | None = None) -> None:
    if not future.done():
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, max_live_requests: int = 256) -> None:
        if max_live_requests < 1:
            raise ValueError(f"max_live_requests must be positive, got {max_live_requests}")
        self.engine = engine
        self.max_live_requests = max_live_requests
        # The engine thread holds _lock while it runs queued work and a step. Code that drives the engine
        # directly (tests, benchmarks) takes it through _locked(), in turn before the loop's next step;
        # the event loop never takes it.
        self._lock = threading.Lock()
        self._next = threading.Lock()  # whoever holds it takes _lock next
        # _state guards the streams and the queued work; it is held for a few dict operations, never a step.
        self._state = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._queued: list[_Add | str] = []  # requests to add, and ids to abort, in order
        self._num_adding = 0  # requests queued to add, counted against max_live_requests
        self._wake = threading.Event()
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
        with self._state:
            return len(self._streams) + self._num_adding

    async def generate(
        self, prompt: PromptType, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; raises ValueError for bad input, QueueFullError when full."""
        loop = asyncio.get_running_loop()
        add = _Add(prompt, params, request_id, _Stream(loop, asyncio.Queue()), loop.create_future())
        with self._state:
            if self._stopping:
                raise EngineDeadError("the engine is shutting down")
            if len(self._streams) + self._num_adding >= self.max_live_requests:
                raise QueueFullError(f"the server holds its maximum of {self.max_live_requests} live requests")
            self._num_adding += 1
            self._queued.append(add)
        self._wake.set()
        try:
            request_id = await add.added  # ValueError for bad input, raised by the engine thread's add
        except BaseException:
            with self._state:
                add.cancelled = True  # not added yet: it never will be
                added_as = add.engine_id
            if added_as is not None:  # added meanwhile: take it out again
                self.abort(added_as)
            raise
        try:
            while True:
                item = await add.stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a live request before the next step (no-op once it has finished)."""
        with self._state:
            if self._streams.pop(request_id, None) is None:
                return
            self._queued.append(request_id)
        self._wake.set()

    def _deliver(self, request_id: str, item) -> None:
        with self._state:
            stream = self._streams.get(request_id)
            if stream is not None and (isinstance(item, BaseException) or item.finished):
                del self._streams[request_id]
        if stream is not None:
            if isinstance(item, RequestOutput) and item.error is not None:
                item = RequestFailedError(item.error)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _run_queued(self) -> None:
        """Add and abort what the event loop queued (engine thread, under _lock)."""
        with self._state:
            queued, self._queued = self._queued, []
        for item in queued:
            if isinstance(item, str):
                self.engine.abort_request(item)
            else:
                self._add(item)

    def _add(self, add: _Add) -> None:
        with self._state:
            cancelled = add.cancelled
        request_id, error = add.request_id, None
        if not cancelled:
            if request_id is None or request_id in self._streams:
                self._counter += 1
                request_id = f"{request_id or 'req'}-{self._counter}"
            try:
                request_id = self.engine.add_request(add.prompt, add.params, request_id)
            except Exception as e:  # bad input: ValueError, for its caller alone
                error = e
        added = not cancelled and error is None
        with self._state:
            self._num_adding -= 1
            keep = added and not add.cancelled
            if keep:
                add.engine_id = request_id
                self._streams[request_id] = add.stream
        if added and not keep:  # its caller left while it was being added
            self.engine.abort_request(request_id)
        add.stream.loop.call_soon_threadsafe(_resolve, add.added, request_id, error)

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            with self._locked():
                self._run_queued()
                if not self.engine.has_unfinished_requests():
                    with self._state:
                        if self._stopping and not self._streams and not self._queued:
                            return
                        if not self._queued:
                            self._wake.clear()  # under _state: work queued from now on sets it again
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as e:  # the engine isolates request faults; this is the last resort
                    self.num_failed_steps += 1
                    logger.exception("engine step failed; failing every live request")
                    with self._state:
                        live = list(self._streams)
                    self.engine.abort_request(live)
                    for request_id in live:
                        self._deliver(request_id, RuntimeError(f"engine step failed: {e}"))
                    continue
                for out in outputs:
                    self._deliver(out.request_id, out)

    def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Stop taking requests; let live ones finish for up to ``drain_timeout`` s, then abort the rest."""
        with self._state:
            self._stopping = True
        self._wake.set()
        self._thread.join(timeout=drain_timeout)
        with self._locked():
            self._run_queued()
            with self._state:
                live = list(self._streams)
            self.engine.abort_request(live)
            for request_id in live:
                self._deliver(request_id, EngineDeadError("the server shut down"))
        self._wake.set()
        self._thread.join(timeout=5)
