"""Greedy outputs equal Hugging Face ``generate`` token for token (float32)."""

from __future__ import annotations

import random

import pytest

from lookahead_serve.engine import LLM, SamplingParams
from tests.conftest import hf_greedy


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(3, 70))] for _ in range(n)]


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_tiny_batch_matches_hf(fixture, request):
    path = request.getfixturevalue(fixture)
    prompts = _prompts(6, 96, seed=1)
    expected = hf_greedy(path, prompts, 24)
    llm = LLM(path, dtype="float32", block_size=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=24))
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_staggered_arrivals_with_preemption_and_chunked_prefill(tiny_llama):
    """16+ prompts of mixed lengths arrive over several steps into a pool too small for all of them."""
    prompts = _prompts(18, 96, seed=2)
    max_tokens = 40
    expected = hf_greedy(tiny_llama, prompts, max_tokens)
    # 28 blocks x 8 = 224 slots for 18 requests of up to ~110 tokens: preemption is forced; a budget of 32
    # tokens per step splits every long prompt into chunks.
    llm = LLM(tiny_llama, dtype="float32", block_size=8, num_kv_blocks=28, max_num_batched_tokens=32, max_num_seqs=16)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    pending = list(enumerate(prompts))
    results: dict[str, list[int]] = {}
    ids: dict[int, str] = {}
    chunked = False
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:  # a few new requests every third step
            for _ in range(3):
                if pending:
                    i, p = pending.pop(0)
                    ids[i] = engine.add_request({"prompt_token_ids": p}, params)
        sched = engine.scheduler
        chunked |= any(len(r.prompt_token_ids) > 32 for r in sched.running)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert chunked
    assert engine.scheduler.num_preemptions > 0
    assert [results[ids[i]] for i in range(len(prompts))] == expected
    assert engine.kv_manager.num_free_blocks == 28  # nothing leaked


CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a ten-year-old.",
    "Give me three tips for learning to play the guitar.",
]


@pytest.mark.slow
def test_default_model_chat_matches_hf(default_model_path):
    llm = LLM(quantization="none", dtype="float32")  # the dequantized weights: the path equal to Hugging Face
    prompts = [llm.engine.apply_chat_template([{"role": "user", "content": m}]) for m in CHAT_PROMPTS]
    token_ids = [llm.tokenizer(p).input_ids for p in prompts]
    expected = hf_greedy(default_model_path, token_ids, 64)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64))
    for out, exp in zip(outs, expected, strict=True):
        assert out.outputs[0].token_ids == exp
        assert out.prompt_token_ids == llm.tokenizer(out.prompt).input_ids
    assert all(o.outputs[0].text for o in outs)
