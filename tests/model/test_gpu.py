"""The engine on a CUDA GPU (marked ``gpu``: skipped without one). Run on the device machine by
``benchmarks/gpu_lookahead.sh``; the attention backend is the same torch code as on the CPU. Passed on an
H200 (benchmarks/RESULTS.md, 2026-12-04)."""

from __future__ import annotations

import pytest

from lookahead_serve.engine import LLM, LookaheadParams, SamplingParams
from tests.conftest import hf_greedy
from tests.model.test_lookahead_engine import _repetitive_prompts

pytestmark = pytest.mark.gpu

PLAIN = LookaheadParams(enabled=False)


def test_cuda_greedy_equals_hf_with_and_without_lookahead(tiny_llama):
    prompts = _repetitive_prompts(12, 96, seed=11)
    expected = hf_greedy(tiny_llama, prompts, 32)  # on the CPU, float32
    llm = LLM(tiny_llama, device="cuda", dtype="float32", block_size=8, max_num_batched_tokens=1024)
    for la in (PLAIN, LookaheadParams(4, 3, 4), LookaheadParams(15, 5, 15), LookaheadParams(0, 5, 10)):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=32, lookahead=la))
        assert [o.outputs[0].token_ids for o in outs] == expected, la
        if not la.is_plain:
            assert max(o.metrics.tokens_per_step for o in outs) > 1.5  # lookahead really accepted tokens
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.pool.num_blocks

