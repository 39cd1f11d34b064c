"""A chat is tokenized once, from the template's text without the tokenizer's own special tokens: a
template that writes the BOS itself, with a tokenizer that also adds one, gives a single BOS."""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers, processors
from tokenizers import decoders as tk_decoders
from transformers import PreTrainedTokenizerFast

from lookahead_serve.engine import LLM, SamplingParams
from tests.conftest import _save_tiny

MESSAGES = [{"role": "user", "content": "hello there"}]


def _bos_model(path):
    specials = ["<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk_decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])  # adds a BOS
    template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}")
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", chat_template=template)
    hf.save_pretrained(path)
    return str(_save_tiny(path, "llama", vocab_size=len(hf), bos_token_id=0, eos_token_id=1))


def test_chat_template_is_tokenized_once_with_one_bos(tmp_path):
    llm = LLM(_bos_model(tmp_path), block_size=8, num_kv_blocks=64)
    text = llm.engine.apply_chat_template(MESSAGES)
    assert text.startswith("<s>[user] hello there")
    assert llm.engine.tokenize(text)[1][:2] == [0, 0]  # as plain text: the tokenizer adds a second BOS
    prompt = llm.engine.chat_prompt(MESSAGES)
    assert prompt["prompt"] == text
    assert prompt["prompt_token_ids"][0] == 0 and prompt["prompt_token_ids"].count(0) == 1
    out = llm.chat(MESSAGES, SamplingParams(max_tokens=3, temperature=0))[0]
    assert out.prompt_token_ids == prompt["prompt_token_ids"] and out.prompt == text
