"""engine/tokenizer.py's FastTokenizer against transformers' AutoTokenizer on the same folders: the same ids,
text and chat template renderings; and an engine that starts without importing transformers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from lookahead_serve.engine.tokenizer import FastTokenizer

TEXTS = ["Hello", " leading space", "Multiple   spaces\tand\ttabs\n\nnewlines", "ünïcödé and emoji 🚀🔥",
         "<|im_start|>user\nspecial tokens in text<|im_end|>", "def f(x):\n    return x ** 2  # code", ""]
CHATS = [
    [{"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a river."}],
]


@pytest.fixture(params=["tiny_llama_chat", "default_model_path"])
def folder(request):
    return request.getfixturevalue(request.param)


def test_same_ids_text_and_chat_as_transformers(folder):
    fast, hf = FastTokenizer.load(folder), AutoTokenizer.from_pretrained(folder)
    assert fast is not None
    special = ("bos_token_id", "eos_token_id", "pad_token_id")
    assert [getattr(fast, a) for a in special] == [getattr(hf, a) for a in special]
    for text in TEXTS:
        for special in (True, False):
            ids = hf(text, add_special_tokens=special).input_ids
            assert fast(text, add_special_tokens=special).input_ids == ids, text
        ids = hf(text).input_ids + [hf.eos_token_id]
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
    for chat in CHATS:
        for gen in (True, False):
            expected = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert fast.apply_chat_template(chat, add_generation_prompt=gen) == expected


def test_folders_only_transformers_reproduces_go_to_it(tiny_llama_chat, tmp_path):
    edits = ({"add_bos_token": True}, {"clean_up_tokenization_spaces": True}, {"tokenizer_class": "LlamaTokenizer"})
    for edit in edits:
        folder = tmp_path / next(iter(edit))
        shutil.copytree(tiny_llama_chat, folder)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, **edit}))
        assert FastTokenizer.load(folder) is None, edit
    folder = tmp_path / "generation-tag"
    shutil.copytree(tiny_llama_chat, folder)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{% generation %}{{ m.content }}"
                                                "{% endgeneration %}{% endfor %}")
    assert FastTokenizer.load(folder) is None


@pytest.mark.slow
def test_the_default_model_starts_without_transformers():
    script = ("import sys\nfrom lookahead_serve import LLM, SamplingParams\n"
              "llm = LLM()\nllm.generate('Hello', SamplingParams(max_tokens=2, temperature=0))\n"
              "llm.engine.chat_prompt([{'role': 'user', 'content': 'Hi'}])\n"
              "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
