"""Lookahead in the engine: lossless against plain decoding and Hugging Face, KV commit, sampling."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

import lookahead_serve.engine.model_runner as model_runner
from lookahead_serve.engine import LLM, LookaheadParams, SamplingParams
from lookahead_serve.engine.verify import Verdict
from lookahead_serve.scheduler import ScheduledRequest, SchedulerOutput
from lookahead_serve.scheduler.lookahead import LookaheadLayout
from tests.conftest import RandomRungs, hf_greedy

PLAIN = LookaheadParams(enabled=False)


def _repetitive_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    """Prompts with repeated phrases, so the n-gram pool has something to offer."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        phrase = [rng.randrange(vocab) for _ in range(rng.randrange(3, 8))]
        filler = [rng.randrange(vocab) for _ in range(rng.randrange(0, 20))]
        prompts.append(filler + phrase * rng.randrange(2, 6))
    return prompts


def test_mixed_lookahead_batch_with_preemption_matches_hf(tiny_llama):
    prompts = _repetitive_prompts(18, 96, seed=3)
    max_tokens = 40
    expected = hf_greedy(tiny_llama, prompts, max_tokens)
    configs = [LookaheadParams(4, 3, 4), LookaheadParams(7, 5, 7), LookaheadParams(5, 3, 5), PLAIN, None,
               LookaheadParams(15, 5, 15), LookaheadParams(3, 4, 2), LookaheadParams(0, 3, 4), LookaheadParams(0, 5, 10)]
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, lookahead=configs[i % len(configs)]) for i in range(18)]
    # 40 blocks of 8 slots for 18 requests of up to ~140 tokens: preemption is forced.
    llm = LLM(tiny_llama, dtype="float32", block_size=8, num_kv_blocks=40, max_num_batched_tokens=256,
              max_num_seqs=18, lookahead_policy="fixed")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv_manager.num_free_blocks == 40
    assert max(o.metrics.tokens_per_step for o in outs) > 1.5  # lookahead really accepted tokens
    plain = [o for o, p in zip(outs, params) if p.lookahead is PLAIN]
    assert all(o.metrics.tokens_per_step == 1.0 for o in plain)
    verify_only = [o for o, p in zip(outs, params) if p.lookahead is not None and p.lookahead.verify_only]
    assert len(verify_only) == 4 and max(o.metrics.tokens_per_step for o in verify_only) > 1.2


def test_abort_mid_lookahead_frees_every_block(tiny_llama):
    llm = LLM(tiny_llama, block_size=8, num_kv_blocks=64, lookahead_policy="fixed")
    eng = llm.engine
    for p in _repetitive_prompts(6, 96, seed=4):
        eng.add_request({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=200, lookahead=LookaheadParams(5, 4, 5)))
    for _ in range(6):
        eng.step()
    assert eng.kv_manager.num_free_blocks < 64
    eng.abort_request([str(i) for i in range(6)])
    assert not eng.has_unfinished_requests()
    assert eng.kv_manager.num_free_blocks == 64


def test_commit_writes_exactly_the_accepted_slots(tiny_llama):
    """A lookahead step writes x and the matched candidate tokens, at their slots, with the right K/V."""
    llm = LLM(tiny_llama, block_size=4, num_kv_blocks=16, enable_prefix_caching=False, lookahead_policy="fixed")
    runner = llm.engine.runner
    prompt = [5, 17, 33, 2, 9, 40]
    greedy = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=5, lookahead=PLAIN))
    cont = greedy[0].outputs[0].token_ids  # the true greedy continuation
    blocks = [3, 7, 11]  # room for 12 tokens
    prefill = ScheduledRequest("r", prompt, 0, blocks, sample=True)
    runner.execute(SchedulerOutput([prefill], len(prompt)))
    before = [c.clone() for c in runner.kv_caches]
    x, p = cont[0], len(prompt)
    lay = LookaheadLayout(num_levels=2, num_cols=3, num_candidates=2, candidate_len=2)
    window = [1, 2] + [3, 4, 5]
    candidates = [cont[1], 50] + [cont[1], cont[2]]  # the second candidate is right on both tokens
    seg = ScheduledRequest("r", [x] + window + candidates, p, blocks, sample=True, lookahead=lay)
    out = runner.execute(SchedulerOutput([seg], lay.num_tokens))
    assert out.sampled_token_ids[0] == cont[1:4]
    written = {blocks[pos // 4] * 4 + pos % 4 for pos in range(p, p + 3)}  # x, cont[1], cont[2]
    # The same K/V that a plain prefill of the whole sequence writes.
    ref = LLM(tiny_llama, block_size=4, num_kv_blocks=16, enable_prefix_caching=False,
              lookahead_policy="fixed").engine.runner
    ref.execute(SchedulerOutput([ScheduledRequest("r", prompt + cont[:3], 0, blocks, sample=True)], p + 3))
    for layer, (old, new, want) in enumerate(zip(before, runner.kv_caches, ref.kv_caches, strict=True)):
        changed = {int(s) for s in torch.nonzero((old != new).any(dim=-1).any(dim=-1).any(dim=0)).flatten()}
        assert changed == written, f"layer {layer}"
        slots = sorted(written)
        torch.testing.assert_close(new[:, slots], want[:, slots], rtol=1e-5, atol=1e-6)


def _first_tokens(llm: LLM, prompt: list[int], lookahead: LookaheadParams, n: int, positions: range) -> np.ndarray:
    """Tokens at ``positions`` of n seeded samples; asserts lookahead (when on) accepted drafts."""
    params = [
        SamplingParams(temperature=0.6, top_k=6, seed=1000 + i, max_tokens=positions.stop, ignore_eos=True, lookahead=lookahead)
        for i in range(n)
    ]
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, params)
    if not lookahead.is_plain:
        assert sum(o.metrics.num_output_tokens for o in outs) > 1.1 * sum(o.metrics.num_steps for o in outs)
    return np.array([[o.outputs[0].token_ids[k] for k in positions] for o in outs])


def _same_distribution(a: np.ndarray, b: np.ndarray) -> float:
    """Smallest chi-square p-value over the token positions (two-sample contingency tests)."""
    pvalues = []
    for col in range(a.shape[1]):
        cats = sorted(set(a[:, col]) | set(b[:, col]))
        table = np.array([[np.sum(x[:, col] == c) for c in cats] for x in (a, b)])
        table = table[:, table.sum(axis=0) >= 10]  # drop sparse categories
        pvalues.append(chi2_contingency(table).pvalue)
    return min(pvalues)


@pytest.fixture(scope="module")
def sampling_setup(tiny_llama):
    rng = random.Random(7)
    llm = LLM(tiny_llama, block_size=16, max_num_seqs=400, max_num_batched_tokens=8192, max_model_len=400,
              lookahead_policy="fixed")
    # The prompt ends with the model's own greedy text, so the pool holds n-grams the model likes and
    # sampled continuations often match a candidate: verification really decides many tokens.
    seed = [rng.randrange(96) for _ in range(8)]
    own = llm.generate([{"prompt_token_ids": seed}], SamplingParams(temperature=0, max_tokens=120, lookahead=PLAIN))
    prompt = seed + own[0].outputs[0].token_ids
    off = _first_tokens(llm, prompt, PLAIN, N_SAMPLES, POSITIONS)
    return llm, prompt, off


N_SAMPLES = 400
POSITIONS = range(2, 8)  # tokens produced after the one warm-up step of N = 3
# Six positions, each tested at alpha = 1e-3: a false alarm rate of about 0.6% per run of the test
# (the seeds are fixed, so a given version of the code either passes or fails every time).
ALPHA = 1e-3


def test_sampling_distribution_unchanged_by_lookahead(sampling_setup):
    llm, prompt, off = sampling_setup
    on = _first_tokens(llm, prompt, LookaheadParams(4, 3, 8), N_SAMPLES, POSITIONS)
    assert _same_distribution(off, on) > ALPHA


def test_broken_verifier_is_caught(sampling_setup, monkeypatch):
    """Accepting any candidate token the model does not rule out shifts the distribution: the test sees it."""

    def accept_if_possible(x_probs, candidates, cand_probs, draw):
        tokens, probs, j_best = [], x_probs, -1
        for d in range(len(candidates[0]) if candidates else 0):
            live = [j for j, c in enumerate(candidates) if probs[c[d]] > 0 and all(c[:d][i] == tokens[i] for i in range(d))]
            if not live:
                break
            j_best = live[0]
            tokens.append(candidates[j_best][d])
            probs = cand_probs[j_best, d]
        tokens.append(draw(probs, len(tokens)))
        return Verdict(tokens, j_best, len(tokens) - 1)

    llm, prompt, off = sampling_setup
    monkeypatch.setattr(model_runner, "verify_sampling", accept_if_possible)
    broken = _first_tokens(llm, prompt, LookaheadParams(4, 3, 8), N_SAMPLES, POSITIONS)
    assert _same_distribution(off, broken) < ALPHA


CODE_PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "def is_palindrome(s: str) -> bool:\n    \"\"\"Return True if s reads the same backwards.\"\"\"\n",
]
CHAT = ["Write a short story about a robot who learns to paint.", "Explain how a rainbow forms."]


@pytest.mark.slow
def test_default_model_lookahead_equals_plain_equals_hf(default_model_path):
    llm = LLM(quantization="none", dtype="float32", max_num_batched_tokens=2048, lookahead_policy="fixed")
    prompts = [llm.engine.apply_chat_template([{"role": "user", "content": m}]) for m in CHAT] + CODE_PROMPTS
    expected = hf_greedy(default_model_path, [llm.tokenizer(p).input_ids for p in prompts], 64)
    for la in (PLAIN, LookaheadParams(15, 5, 15), LookaheadParams(5, 3, 5), LookaheadParams(4, 3, 4),
               LookaheadParams(0, 4, 10)):
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, lookahead=la))
        assert [o.outputs[0].token_ids for o in outs] == expected, la
    assert max(o.metrics.tokens_per_step for o in outs) > 1.2


# ---- lookahead scheduling: whatever the policy picks, the tokens are plain greedy's ----------------------


def test_changing_lookahead_shape_every_step_stays_lossless(tiny_llama):
    prompts = _repetitive_prompts(16, 96, seed=5)
    max_tokens = 40
    expected = hf_greedy(tiny_llama, prompts, max_tokens)
    llm = LLM(tiny_llama, dtype="float32", block_size=8, num_kv_blocks=48, max_num_batched_tokens=512,
              max_num_seqs=16, lookahead=LookaheadParams(15, 5, 15), lookahead_policy="fixed")
    llm.engine.scheduler.planner.policy = RandomRungs(0)
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, lookahead=None if i % 4 else PLAIN) for i in range(16)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert len(llm.engine.lookahead_chosen) >= 5  # many (w, n, g) shapes really ran
    assert {lab.split(",")[1] for lab in llm.engine.lookahead_chosen} >= {"3", "4", "5"}  # n changed too
    assert any(lab.startswith("0,") for lab in llm.engine.lookahead_chosen)  # and verification-only steps
    assert llm.engine.kv_manager.num_free_blocks == 48


@pytest.mark.parametrize("cost", ["profiled", "memory-bound", "compute-bound"])
def test_adaptive_policy_is_lossless(tiny_llama, cost):
    from lookahead_serve.scheduler.cost import StepCostModel

    model = {"profiled": None,
             "memory-bound": StepCostModel([1, 4096], [0.01, 0.01], learning_rate=0.0),
             "compute-bound": StepCostModel([1, 4096], [0.001, 4.096], learning_rate=0.0)}[cost]
    prompts = _repetitive_prompts(16, 96, seed=6)
    expected = hf_greedy(tiny_llama, prompts, 32)
    llm = LLM(tiny_llama, dtype="float32", block_size=8, max_num_batched_tokens=2048,
              lookahead=LookaheadParams(7, 5, 7), lookahead_policy="adaptive", step_cost_model=model)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=32))
    assert [o.outputs[0].token_ids for o in outs] == expected
    ran = sum(llm.engine.lookahead_chosen.values())
    if cost == "memory-bound":
        assert llm.engine.lookahead_chosen["7,5,7"] > 0 and max(o.metrics.tokens_per_step for o in outs) > 1.5
    if cost == "compute-bound":  # only the policy's exploration: one segment every 16th step at most
        assert ran <= llm.engine.num_steps // 16 + 1
    assert llm.engine.scheduler.planner.cost_model.num_observed == llm.engine.num_steps


def test_log_schedule_reports_each_step(tiny_llama, caplog):
    from lookahead_serve.scheduler.cost import StepCostModel

    llm = LLM(tiny_llama, lookahead=LookaheadParams(5, 3, 5), lookahead_policy="adaptive", log_schedule=True,
              step_cost_model=StepCostModel([1, 4096], [0.01, 0.01], learning_rate=0.0))
    with caplog.at_level("INFO", logger="lookahead_serve.schedule"):
        llm.generate({"prompt_token_ids": _repetitive_prompts(1, 96, seed=7)[0]}, SamplingParams(temperature=0, max_tokens=8))
    lines = [r.getMessage() for r in caplog.records if r.name == "lookahead_serve.schedule"]
    assert len(lines) == llm.engine.num_steps
    assert "1 prefill chunks" in lines[0] and "predicted 10.0 ms" in lines[0]
    assert any("lookahead: 5,3,5 x1" in line for line in lines[1:])


def test_schedule_metrics_are_exported(tiny_llama):
    from prometheus_client import generate_latest

    from lookahead_serve.proto.metrics import ServerMetrics

    llm = LLM(tiny_llama, lookahead=LookaheadParams(5, 3, 5), lookahead_policy="fixed")
    metrics = ServerMetrics(llm.engine, "tiny")
    llm.generate({"prompt_token_ids": _repetitive_prompts(1, 96, seed=8)[0]}, SamplingParams(temperature=0, max_tokens=12))
    text = generate_latest(metrics.registry).decode()
    n = llm.engine.lookahead_chosen["5,3,5"]
    assert n > 0
    assert f'lookahead:segments_total{{config="5,3,5",model_name="tiny"}} {float(n)}' in text
    assert f'lookahead:engine_steps_total{{model_name="tiny"}} {float(llm.engine.num_steps)}' in text
    assert f'lookahead:engine_step_tokens_total{{model_name="tiny"}} {float(llm.engine.step_tokens_total)}' in text
