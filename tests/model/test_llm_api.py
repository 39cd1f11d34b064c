"""The offline API on a tiny model: streaming, stops, aborts, seeds, prefix caching, bad input."""

from __future__ import annotations

import pytest

from lookahead_serve.engine import LLM, LookaheadParams, SamplingParams

PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26, 43], [1, 2, 3]]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, block_size=4, num_kv_blocks=128)


def _ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def test_stream_deltas_add_up_to_the_final_output(llm):
    params = SamplingParams(temperature=0, max_tokens=12)
    final = {o.request_id: o for o in llm.generate(_ids(PROMPTS), params)}
    seen: dict[str, list[int]] = {}
    last = {}
    for out in llm.stream(_ids(PROMPTS), params):
        seen.setdefault(out.request_id, []).extend(out.outputs[0].delta_token_ids)
        last[out.request_id] = out
    assert sorted(map(len, seen.values())) == [12, 12, 12]
    assert sorted(seen.values()) == sorted(o.outputs[0].token_ids for o in final.values())
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in last.values())


def test_stop_token_ids_and_min_tokens(llm):
    base = llm.generate(_ids(PROMPTS[:1]), SamplingParams(temperature=0, max_tokens=12, lookahead=LookaheadParams(enabled=False)))
    tokens = base[0].outputs[0].token_ids
    stop_at = tokens[5]
    first = tokens.index(stop_at)
    out = llm.generate(_ids(PROMPTS[:1]), SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]))[0]
    assert out.outputs[0].token_ids == tokens[: first + 1]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop_at)
    later = llm.generate(
        _ids(PROMPTS[:1]), SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at], min_tokens=first + 1)
    )[0]
    assert len(later.outputs[0].token_ids) > first + 1


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=10)
    alone = llm.generate(_ids(PROMPTS[:1]), params)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=10)
    batch = llm.generate(_ids(PROMPTS), [params, others, others])[0].outputs[0].token_ids
    assert alone == batch
    other_seed = llm.generate(_ids(PROMPTS[:1]), SamplingParams(temperature=1.0, top_p=0.9, seed=43, max_tokens=10))
    assert other_seed[0].outputs[0].token_ids != alone


def test_prefix_cache_hit_gives_the_same_tokens(llm):
    shared = list(range(10, 40))
    params = SamplingParams(temperature=0, max_tokens=8)
    first = llm.generate(_ids([shared + [1]]), params)[0]
    hits_before = llm.engine.kv_manager.num_prefix_hit_tokens
    second = llm.generate(_ids([shared + [1]]), params)[0]
    assert llm.engine.kv_manager.num_prefix_hit_tokens - hits_before >= 28  # 7 full blocks of 4
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_abort_frees_blocks(llm):
    eng = llm.engine
    free = eng.kv_manager.num_free_blocks
    rid = eng.add_request({"prompt_token_ids": PROMPTS[1]}, SamplingParams(max_tokens=50))
    eng.step()
    eng.step()
    (out,) = eng.abort_request(rid)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert eng.kv_manager.num_free_blocks == free and not eng.has_unfinished_requests()


def test_early_exit_from_stream_aborts(llm):
    free = llm.engine.kv_manager.num_free_blocks
    for _ in llm.stream(_ids(PROMPTS), SamplingParams(max_tokens=40)):
        break
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_manager.num_free_blocks == free


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ({"prompt_token_ids": []}, SamplingParams(), "empty"),
        ({"prompt_token_ids": [1, 96]}, SamplingParams(), "prompt_token_ids"),
        ({"prompt_token_ids": [1] * 600}, SamplingParams(), "max_model_len"),
        ("text", SamplingParams(), "tokenizer"),
        ({"prompt_token_ids": [1]}, SamplingParams(lookahead=LookaheadParams(17, 3, 4)), "window_size"),
        ({"prompt_token_ids": [1]}, SamplingParams(lookahead=LookaheadParams(4, 9, 4)), "ngram_size"),
    ],
)
def test_bad_input_is_a_value_error(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, params)
    assert not llm.engine.has_unfinished_requests()


def test_bfloat16_runs(tiny_llama):
    bf = LLM(tiny_llama, dtype="bfloat16", num_kv_blocks=32)
    out = bf.generate(_ids(PROMPTS[:1]), SamplingParams(temperature=0, max_tokens=6))[0]
    assert len(out.outputs[0].token_ids) == 6


@pytest.mark.slow
def test_default_model_text_stop_strings_and_chat(default_model_path):
    llm = LLM(default_model_path)
    base = llm.chat([{"role": "user", "content": "Count from one to ten in words."}], SamplingParams(temperature=0, max_tokens=40))[0]
    text = base.outputs[0].text
    assert text and base.outputs[0].finish_reason in ("stop", "length")
    stop = text.split()[2]  # a word from the middle of the answer
    cut = llm.chat(
        [{"role": "user", "content": "Count from one to ten in words."}], SamplingParams(temperature=0, max_tokens=40, stop=[stop])
    )[0]
    assert cut.outputs[0].text == text[: text.index(stop)]
    assert (cut.outputs[0].finish_reason, cut.outputs[0].stop_reason) == ("stop", stop)
    streamed = "".join(o.outputs[0].delta_text for o in llm.stream(base.prompt, SamplingParams(temperature=0, max_tokens=40)))
    assert streamed == text


def test_request_that_outgrows_the_cache_ends_with_length(tiny_llama):
    small = LLM(tiny_llama, block_size=4, num_kv_blocks=6)  # 24 slots
    outs = small.generate(_ids([PROMPTS[0], PROMPTS[2]]), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    # every token but the newest (never run through the model) has a slot
    assert all(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) == 25 for o in outs)
    assert small.engine.kv_manager.num_free_blocks == 6
