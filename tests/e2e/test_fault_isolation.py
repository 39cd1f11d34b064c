"""A fault inside a step ends only the request it belongs to.

Five requests stream at once through the async engine; one of them (the culprit) meets a fault: a NaN
temperature that slipped past validation (the bug that once failed every live stream), a verifier that
raises, a forward pass that raises whenever the culprit is in the step, or bookkeeping that raises
mid-stream. The culprit gets RequestFailedError; the other four get exactly the tokens of a run without
it; every KV block comes back; the engine goes on serving. The faults are injected with monkeypatch.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from lookahead_serve.engine import LLM, LookaheadParams, SamplingParams
from lookahead_serve.engine.async_engine import AsyncLLMEngine, RequestFailedError
from lookahead_serve.engine import model_runner
from lookahead_serve.engine.model_runner import ModelRunner
from lookahead_serve.scheduler.scheduler import Scheduler

PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 8, 41][: 12 + i] for i in range(4)]
CULPRIT_PROMPT = [7, 1, 8, 2, 8, 1, 8, 2, 8, 95, 4, 5]


def _params(i: int) -> SamplingParams:
    """Greedy, half of them with lookahead, and one seeded sampled request."""
    la = LookaheadParams(4, 3, 4) if i % 2 else LookaheadParams(enabled=False)
    if i == 3:
        return SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True, lookahead=la)
    return SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, lookahead=la)


async def _collect(engine: AsyncLLMEngine, prompt, params, request_id):
    ids = []
    try:
        async for out in engine.generate({"prompt_token_ids": prompt}, params, request_id):
            ids = out.outputs[0].token_ids
    except RequestFailedError as e:
        return e
    return ids


def _run(engine: AsyncLLMEngine, requests):
    async def main():
        return await asyncio.gather(*(_collect(engine, p, s, f"r{i}") for i, (p, s) in enumerate(requests)))

    return asyncio.run(main())


@pytest.fixture(scope="module")
def served(tiny_llama):
    llm = LLM(tiny_llama, block_size=8, num_kv_blocks=96, max_num_batched_tokens=256, max_model_len=256,
              lookahead_policy="fixed")
    engine = AsyncLLMEngine(llm.engine)
    expected = _run(engine, [(p, _params(i)) for i, p in enumerate(PROMPTS)])
    assert all(isinstance(ids, list) and len(ids) == 24 for ids in expected)
    yield engine, expected
    engine.shutdown()


def _nan_temperature(monkeypatch, engine, culprit: SamplingParams) -> SamplingParams:
    culprit.temperature = float("nan")  # past validation: what a bug in an edge layer could let through
    return culprit


def _verifier(monkeypatch, engine, culprit: SamplingParams) -> SamplingParams:
    original = ModelRunner._lookahead

    def flaky(self, seg, logits):
        if seg.req_id == "r4" and seg.start_pos > len(CULPRIT_PROMPT) + 3:
            raise RuntimeError("injected verifier fault")
        return original(self, seg, logits)

    monkeypatch.setattr(ModelRunner, "_lookahead", flaky)
    return SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, lookahead=LookaheadParams(4, 3, 4))


def _forward(monkeypatch, engine, culprit: SamplingParams) -> SamplingParams:
    """The forward pass raises whenever the culprit's segment is in the step (a bad block table, say)."""
    step_ids: list[str] = []
    build = model_runner.build_step_inputs

    def build_noting_ids(segs, *args):
        step_ids[:] = [s.req_id for s in segs]
        return build(segs, *args)

    model_cls = type(engine.engine.model)
    forward = model_cls.forward

    def flaky(self, *args, **kwargs):
        if "r4" in step_ids:
            raise IndexError("injected forward fault")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(model_runner, "build_step_inputs", build_noting_ids)
    monkeypatch.setattr(model_cls, "forward", flaky)
    return culprit


def _bookkeeping(monkeypatch, engine, culprit: SamplingParams) -> SamplingParams:
    original = Scheduler._advance
    calls = {"n": 0}

    def flaky(self, req, seg, *args):
        if req.request_id == "r4":
            calls["n"] += 1
            if calls["n"] == 4:
                raise KeyError("injected bookkeeping fault")
        return original(self, req, seg, *args)

    monkeypatch.setattr(Scheduler, "_advance", flaky)
    return culprit


@pytest.mark.parametrize("inject", [_nan_temperature, _verifier, _forward, _bookkeeping])
def test_a_fault_fails_only_its_request(served, monkeypatch, inject):
    engine, expected = served
    kv = engine.engine.kv_manager
    free_before = kv.num_free_blocks
    culprit = inject(monkeypatch, engine, SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True))
    results = _run(engine, [(p, _params(i)) for i, p in enumerate(PROMPTS)] + [(CULPRIT_PROMPT, culprit)])
    assert isinstance(results[4], RequestFailedError), results[4]
    assert "internal error" in str(results[4])
    assert results[:4] == expected
    assert kv.num_free_blocks == free_before
    assert engine.num_live_requests == 0 and not engine.engine.has_unfinished_requests()
    monkeypatch.undo()
    assert _run(engine, [(PROMPTS[0], _params(0))]) == expected[:1]  # and it goes on serving


def test_a_fault_no_request_explains_fails_the_step_and_serving_goes_on(served, monkeypatch):
    engine, expected = served
    free_before = engine.engine.kv_manager.num_free_blocks
    model_cls = type(engine.engine.model)
    original = model_cls.forward
    broken = {"on": True}

    def flaky(self, *args, **kwargs):
        if broken["on"]:
            raise torch.cuda.OutOfMemoryError("injected: every step fails")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(model_cls, "forward", flaky)
    results = _run(engine, [(p, _params(i)) for i, p in enumerate(PROMPTS[:2])])
    assert all(isinstance(r, RequestFailedError) for r in results)
    broken["on"] = False
    assert _run(engine, [(p, _params(i)) for i, p in enumerate(PROMPTS)]) == expected
    assert engine.engine.kv_manager.num_free_blocks == free_before
