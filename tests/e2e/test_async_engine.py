"""The async engine's lock is handed over in turn. The engine loop holds it for a whole step and asks
for it again at once; with a bare lock it kept winning, and the event loop, waiting in generate() or
abort() (and so blocking every stream), waited many steps: tokens reached clients in bursts under
concurrent streams. A caller that waits now goes before the loop's next step. (The check below fails
with the old bare lock: ["loop", "caller"].)"""

from __future__ import annotations

import threading
import time
from contextlib import AbstractContextManager
from typing import Callable

from engine.async_engine import AsyncLLMEngine


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

