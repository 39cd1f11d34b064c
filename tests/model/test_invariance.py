"""Shape invariance in bfloat16 on the real model: a token's bits do not depend on what shares its step.
Every test runs twice: on the dequantized weights and on the GGUF file's block-quantized ones (the
default on x86 CPUs, engine/quant).

Layer level: every linear, the norms and rotary (torch's and the C operations') give a row the same bits for
M = 1..64 rows. Attention (the C kernel where it runs, and the torch formulation): a token's logits are the same whether it is a plain decode (alone or in a batch), the last token of a prefill
chunk, the root of a lookahead segment (alone, beside another segment, beside a decode, verification only)
or an accepted candidate. End to end: greedy lookahead (fixed configurations, the adaptive policy, a random
policy, with preemption) equals lookahead off token for token, and a request alone equals it in a batch.
"""

from __future__ import annotations

import random

import pytest
import torch

from lookahead_serve.engine import LLM, LookaheadParams, SamplingParams
from lookahead_serve.engine.attention.invariant import kernel_supports
from lookahead_serve.engine.model_runner import _without_onednn, build_step_inputs
from lookahead_serve.engine.models import cpu_ops
from lookahead_serve.engine.quant import BlockQuantLinear
from lookahead_serve.engine.quant.kernel import unavailable_reason
from lookahead_serve.scheduler import ScheduledRequest
from lookahead_serve.scheduler.cost import StepCostModel
from lookahead_serve.scheduler.lookahead import LookaheadLayout
from tests.conftest import RandomRungs

OFF = LookaheadParams(enabled=False)
BLOCKS_PER_REQ = 24  # 384 slots of 16: enough for every prompt below and its output


@pytest.fixture(scope="module", params=["dequantized", "gguf"])
def weights(request, default_model_path):
    """How the model's weights are held: LLM keyword arguments."""
    if request.param == "gguf":
        if (reason := unavailable_reason()) is not None:
            pytest.skip(reason)
        return {"model": None, "quantization": "gguf"}
    return {"model": default_model_path, "quantization": "none"}


@pytest.fixture(scope="module")
def bf16_llm(weights):
    return LLM(**weights, dtype="bfloat16", lookahead_policy="fixed", num_kv_blocks=16 * BLOCKS_PER_REQ,
               enable_prefix_caching=False)


def test_auto_backend_is_invariant_in_reduced_precision(bf16_llm):
    backend = bf16_llm.engine.model.model.layers[0].self_attn.backend
    assert backend.name == "invariant"
    assert backend.use_kernel == kernel_supports(64)  # the C kernel wherever it runs


@torch.inference_mode()
def test_linears_norms_rotary_are_row_invariant(bf16_llm):
    model = bf16_llm.engine.model
    layer = model.model.layers[0]
    gen = torch.Generator().manual_seed(0)
    linears = {name: mod for name, mod in layer.named_modules() if isinstance(mod, (torch.nn.Linear, BlockQuantLinear))}
    assert len(linears) >= 4  # q, k, v, o (or qkv and o) and the MLP's (or gate_up and down)
    with _without_onednn():
        for name, lin in [*linears.items(), ("output layer", model.compute_logits)]:
            x = torch.randn(64, model.config.hidden_size if name == "output layer" else lin.in_features,
                            generator=gen).to(torch.bfloat16)
            alone = torch.cat([lin(x[i : i + 1]) for i in range(64)])
            sizes = range(1, 65) if name != "output layer" else [*range(1, 17), 24, 31, 32, 48, 64]
            bad = [m for m in sizes if not torch.equal(lin(x[:m]), alone[:m])]
            assert not bad, f"{name}: rows differ at M = {bad}"
        h = torch.randn(64, model.config.hidden_size, generator=gen).to(torch.bfloat16)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm, model.model.norm):
            alone = torch.cat([norm(h[i : i + 1]) for i in range(64)])
            assert all(torch.equal(norm(h[:m]), alone[:m]) for m in range(1, 65))
        positions = torch.randint(0, 300, (64,), generator=gen)
        cos, sin = model.model.rotary(positions, torch.bfloat16)
        cos1 = torch.cat([model.model.rotary(positions[i : i + 1], torch.bfloat16)[0] for i in range(64)])
        assert torch.equal(cos, cos1)
        if cpu_ops.runs_on(h):  # the C operations the model runs here: residual add + norm, rotary
            norm, delta = layer.input_layernorm, torch.randn(64, h.shape[1], generator=gen).to(torch.bfloat16)
            alone = [cpu_ops.add_rms_norm(h[i : i + 1].clone(), delta[i : i + 1], norm.weight, norm.eps) for i in range(64)]
            for m in range(1, 65):
                hm = h[:m].clone()
                assert torch.equal(cpu_ops.add_rms_norm(hm, delta[:m], norm.weight, norm.eps), torch.cat(alone[:m]))
                assert torch.equal(hm, (h[:m] + delta[:m]))  # the residual add, in place, rounds as torch does
            rot = model.model.rotary
            x = torch.randn(64, 9, 64, generator=gen).to(torch.bfloat16)
            one = torch.cat([x[i : i + 1].clone() for i in range(64)])
            for i in range(64):
                cpu_ops.rotary_(one[i : i + 1], positions[i : i + 1], rot.cos, rot.sin)
            for m in (1, 2, 5, 16, 33, 64):
                xm = x[:m].clone()
                cpu_ops.rotary_(xm, positions[:m], rot.cos, rot.sin)
                assert torch.equal(xm, one[:m])
            ref = x * cos + torch.cat((-x[..., 32:], x[..., :32]), dim=-1) * sin  # torch's formulation
            assert torch.equal(one, ref)


class _Steps:
    """Hand-made steps on the engine's runner: request r owns blocks [r * BLOCKS_PER_REQ, ...)."""

    def __init__(self, llm: LLM) -> None:
        self.runner = llm.engine.runner
        self.model = llm.engine.model
        self.saved = [c.clone() for c in self.runner.kv_caches]

    def reset(self) -> None:
        for c, s in zip(self.runner.kv_caches, self.saved, strict=True):
            c.copy_(s)

    @staticmethod
    def seg(r: int, tokens: list[int], start: int, layout: LookaheadLayout | None = None) -> ScheduledRequest:
        blocks = list(range(r * BLOCKS_PER_REQ, (r + 1) * BLOCKS_PER_REQ))
        return ScheduledRequest(str(r), list(tokens), start, blocks, True, lookahead=layout)

    @torch.inference_mode()
    def logits(self, segs: list[ScheduledRequest]) -> tuple[torch.Tensor, list[int]]:
        """Every token's logits, and each segment's first token index."""
        inp = build_step_inputs(segs, self.runner.block_size, self.runner.device)
        with _without_onednn():
            hidden = self.model(torch.from_numpy(inp.input_ids), torch.from_numpy(inp.positions),
                                self.runner.kv_caches, inp.meta)
            return self.model.compute_logits(hidden), inp.meta.query_start_loc


@pytest.fixture(params=["kernel", "torch"])
def attention_impl(request, bf16_llm):
    """The invariant backend's C kernel (where it runs; the default there) or its torch formulation."""
    backend = bf16_llm.engine.model.model.layers[0].self_attn.backend  # one instance, shared by the layers
    if request.param == "kernel" and not kernel_supports(bf16_llm.engine.model.model.layers[0].self_attn.head_dim):
        pytest.skip("the invariant CPU kernel does not run here")
    saved, backend.use_kernel = backend.use_kernel, request.param == "kernel"
    yield request.param
    backend.use_kernel = saved


def test_attention_gives_a_token_the_same_bits_in_every_segment_kind(bf16_llm, attention_impl):
    steps = _Steps(bf16_llm)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 20000) for _ in range(40 + 9 * r)] for r in range(8)]
    for r, p in enumerate(prompts):  # fill the caches, then keep a copy to restore between cases
        steps.logits([steps.seg(r, p, 0)])
    steps.saved = [c.clone() for c in steps.runner.kv_caches]
    P, x, y = len(prompts[0]), 1234, 4321
    cases: dict[str, torch.Tensor] = {}

    def run(name, segs, row):
        steps.reset()
        logits, starts = steps.logits(segs)
        cases[name] = logits[row(starts)].clone()

    run("decode alone", [steps.seg(0, [x], P)], lambda s: 0)
    run("decode in a batch of 8", [steps.seg(r, [x if r == 0 else 777], len(prompts[r])) for r in range(8)],
        lambda s: 0)
    run("decode, second of 3", [steps.seg(r, [x if r == 0 else 777], len(prompts[r])) for r in (3, 0, 5)],
        lambda s: s[1])
    run("last token of a prefill chunk", [steps.seg(0, prompts[0][24:] + [x], 24)], lambda s: s[1] - 1)
    run("last token of a first prefill", [steps.seg(0, prompts[0] + [x], 0)], lambda s: s[1] - 1)
    lay = LookaheadLayout(num_levels=4, num_cols=5, num_candidates=5, candidate_len=4)
    window = [x] + [rng.randrange(100, 20000) for _ in range(lay.num_tokens - 1)]
    other = [9] + [rng.randrange(100, 20000) for _ in range(lay.num_tokens - 1)]
    run("lookahead root, alone", [steps.seg(0, window, P, lay)], lambda s: 0)
    run("lookahead root, beside another segment", [steps.seg(0, window, P, lay),
                                                    steps.seg(1, other, len(prompts[1]), lay)], lambda s: 0)
    run("lookahead root, beside a decode", [steps.seg(1, [5], len(prompts[1])), steps.seg(0, window, P, lay)],
        lambda s: s[1])
    verify = LookaheadLayout(num_levels=0, num_cols=1, num_candidates=3, candidate_len=4)
    cand = [x, y, 11, 12, 13] + [rng.randrange(100, 20000) for _ in range(verify.num_tokens - 5)]
    run("verification-only root", [steps.seg(0, cand, P, verify)], lambda s: 0)
    ref = cases["decode alone"]
    bad = [name for name, v in cases.items() if not torch.equal(v, ref)]
    assert not bad, f"differ from a plain decode alone: {bad}"

    # an accepted candidate's logits == decoding it after committing its parent
    steps.reset()
    steps.logits([steps.seg(0, [x], P)])
    decoded_y = steps.logits([steps.seg(0, [y], P + 1)])[0][0]
    steps.reset()
    assert torch.equal(steps.logits([steps.seg(0, cand, P, verify)])[0][1], decoded_y)


def test_c_decoder_step_equals_the_modules(bf16_llm):
    """Block weights on a CPU that builds the C kernels run each step as one C call (DecoderStep): the same
    bits as the modules, for a prefill, a batch of decodes, and a lookahead segment beside a decode."""
    model = bf16_llm.engine.model
    native = model.native_step
    if native is None:
        pytest.skip("no C decoder step here (dequantized weights, or no C kernels)")
    steps = _Steps(bf16_llm)
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 20000) for _ in range(30 + 11 * r)] for r in range(4)]
    for r, p in enumerate(prompts):
        steps.logits([steps.seg(r, p, 0)])
    steps.saved = [c.clone() for c in steps.runner.kv_caches]
    lay = LookaheadLayout(num_levels=4, num_cols=5, num_candidates=5, candidate_len=4)
    window = [1234] + [rng.randrange(100, 20000) for _ in range(lay.num_tokens - 1)]
    cases = {"prefill chunk": [steps.seg(0, prompts[0][10:], 10)],
             "decodes": [steps.seg(r, [777], len(prompts[r])) for r in range(4)],
             "lookahead beside a decode": [steps.seg(1, [5], len(prompts[1])), steps.seg(0, window, len(prompts[0]), lay)]}
    try:
        for name, segs in cases.items():
            out = {}
            for path, step in (("C step", native), ("modules", None)):
                model.native_step = step
                steps.reset()
                out[path] = steps.logits(segs)[0]
                if path == "C step":
                    caches = [c.clone() for c in steps.runner.kv_caches]
            assert torch.equal(out["C step"], out["modules"]), name
            assert all(torch.equal(a, b) for a, b in zip(caches, steps.runner.kv_caches, strict=True)), name
    finally:
        model.native_step = native
        steps.reset()


# -- end to end -------------------------------------------------------------------------------------------

CHAT = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash map works and when you would not use one.",
    "List five tips for learning to play the guitar, with one sentence each.",
    "What are the main differences between a virus and a bacterium?",
    "Describe the water cycle to a ten-year-old.",
    "Give me a weekly plan for a beginner who wants to run five kilometres.",
]
CODE = [
    "def fibonacci(n: int) -> list[int]:\n    \"\"\"Return the first n Fibonacci numbers.\"\"\"\n",
    "def is_palindrome(text: str) -> bool:\n    \"\"\"True if text reads the same backwards, ignoring case and spaces.\"\"\"\n",
    "class Stack:\n    \"\"\"A last-in, first-out stack backed by a list.\"\"\"\n\n    def __init__(self):\n",
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "import json\n\n\ndef load_config(path):\n    \"\"\"Read a JSON config file and fill in defaults for missing keys.\"\"\"\n",
    "def word_count(text: str) -> dict[str, int]:\n    \"\"\"Count how often each word occurs in text.\"\"\"\n",
]
MAX_TOKENS = 128


@pytest.fixture(scope="module")
def prompts(bf16_llm, weights):
    """All twelve on the dequantized weights; half of each kind on the block weights (the suite's time)."""
    chat, code = (CHAT, CODE) if weights["quantization"] == "none" else (CHAT[::2], CODE[::2])
    return [bf16_llm.engine.apply_chat_template([{"role": "user", "content": q}]) for q in chat] + code


@pytest.fixture(scope="module")
def plain(bf16_llm, prompts):
    """Lookahead off, all twelve prompts in one batch."""
    outs = bf16_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, lookahead=OFF))
    return [o.outputs[0].token_ids for o in outs]


def _greedy(configs):
    return [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, lookahead=c) for c in configs]


def test_alone_equals_in_a_batch(bf16_llm, prompts, plain):
    alone = [bf16_llm.generate(p, _greedy([OFF])[0])[0].outputs[0].token_ids for p in prompts]
    assert alone == plain


def test_fixed_lookahead_with_preemption_equals_plain(weights, prompts, plain):
    # 52 blocks of 16 for twelve requests of up to ~230 tokens (26 for six): requests are preempted.
    llm = LLM(**weights, dtype="bfloat16", lookahead_policy="fixed", num_kv_blocks=52 * len(prompts) // 12,
              enable_prefix_caching=False, max_num_batched_tokens=128)
    configs = [LookaheadParams(2, 3, 2), LookaheadParams(3, 3, 1), LookaheadParams(0, 3, 3), OFF]
    outs = llm.generate(prompts, _greedy(configs[i % len(configs)] for i in range(len(prompts))))
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert llm.engine.scheduler.num_preemptions > 0
    assert max(o.metrics.tokens_per_step for o in outs) > 1.2  # lookahead accepted tokens


def test_adaptive_lookahead_equals_plain(bf16_llm, prompts, plain):
    planner = bf16_llm.engine.scheduler.planner
    # a cost curve like bf16's on a 2-core CPU, so the policy mixes plain and lookahead steps
    planner.cost_model = StepCostModel([1, 8, 16, 32, 64, 128], [0.04, 0.15, 0.28, 0.55, 1.1, 2.2])
    planner.set_policy("adaptive")
    try:
        outs = bf16_llm.generate(prompts, _greedy([LookaheadParams(4, 3, 4)] * len(prompts)))
    finally:
        planner.set_policy("fixed")
        planner.cost_model = None
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert max(o.metrics.tokens_per_step for o in outs) > 1.0


def test_random_policy_equals_plain(bf16_llm, prompts, plain):
    planner = bf16_llm.engine.scheduler.planner
    fixed = planner.policy
    planner.policy = RandomRungs(seed=7)
    try:
        outs = bf16_llm.generate(prompts, _greedy([LookaheadParams(3, 3, 3)] * len(prompts)))
    finally:
        planner.policy = fixed
    assert [o.outputs[0].token_ids for o in outs] == plain
