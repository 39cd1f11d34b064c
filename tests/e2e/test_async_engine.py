"""The async engine's lock is handed over in turn. The engine loop holds it for a whole step and asks
for it again at once; with a bare lock it kept winning, and the event loop, waiting in generate() or
abort() (and so blocking every stream), waited many steps: tokens reached clients in bursts under
concurrent streams. A caller that waits now goes before the loop's next step. (The check below fails
with the old bare lock: ["loop", "caller"].)"""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import AbstractContextManager
from typing import Callable

from lookahead_serve.engine.async_engine import AsyncLLMEngine
from lookahead_serve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput


class IdleEngine:
    def has_unfinished_requests(self) -> bool:
        return False

    def abort_request(self, request_ids) -> list:
        return []


def _who_goes_first(locked: Callable[[], AbstractContextManager]) -> list[str]:
    """A loop-like thread holds the lock while a caller starts waiting, lets go and asks again at once."""
    order: list[str] = []
    holding = threading.Event()

    def loop_like() -> None:
        with locked():
            holding.set()
            time.sleep(0.2)  # the caller is waiting by now
        with locked():
            order.append("loop")

    def caller() -> None:
        holding.wait()
        with locked():
            order.append("caller")

    threads = [threading.Thread(target=loop_like), threading.Thread(target=caller)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return order


def test_a_waiting_caller_goes_before_the_loops_next_step():
    engine = AsyncLLMEngine(IdleEngine())
    try:
        for _ in range(5):
            assert _who_goes_first(engine._locked) == ["caller", "loop"]
    finally:
        engine.shutdown()



class SlowEngine:
    """Each step takes 0.3 s and gives every live request one token; a request ends after 3."""

    def __init__(self) -> None:
        self.live: dict[str, int] = {}

    def add_request(self, prompt, params, request_id):
        if prompt == "bad":
            raise ValueError("prompt: bad")
        self.live[request_id] = 0
        return request_id

    def abort_request(self, request_ids) -> list:
        for r in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.live.pop(r, None)
        return []

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def step(self):
        time.sleep(0.3)
        outs = []
        for r in list(self.live):
            self.live[r] += 1
            done = self.live[r] == 3
            outs.append(RequestOutput(r, None, [1], [CompletionOutput(0, "", [7] * self.live[r])], done,
                                      RequestMetrics(0.0, None, None, None, self.live[r])))
            if done:
                del self.live[r]
        return outs


def test_the_event_loop_never_waits_for_a_step():
    """Adding, refusing and aborting requests while steps run leave the event loop free: a ticker every
    10 ms never stalls for a step's 0.3 s (with the engine lock taken on the loop it stalled each time)."""
    engine = AsyncLLMEngine(SlowEngine())

    async def consume(prompt, stop_after=None):
        got = 0
        try:
            async for out in engine.generate(prompt):
                got = len(out.outputs[0].token_ids)
                if got == stop_after:
                    break
        except ValueError:
            return "refused"
        return got

    async def main():
        ticks = []
        done = asyncio.Event()

        async def ticker():
            while not done.is_set():
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        tick = asyncio.create_task(ticker())
        first = asyncio.create_task(consume("a"))
        await asyncio.sleep(0.1)  # a step is running now
        results = await asyncio.gather(consume("b"), consume("bad"), consume("c", stop_after=1))
        results = [await first, *results]
        done.set()
        await tick
        return results, max(b - a for a, b in zip(ticks, ticks[1:]))

    try:
        results, longest_gap = asyncio.run(main())
    finally:
        engine.shutdown()
    assert results == [3, 3, "refused", 1]
    assert longest_gap < 0.15, longest_gap
    assert engine.num_live_requests == 0
