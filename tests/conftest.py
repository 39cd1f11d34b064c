"""Shared fixtures: tiny random models saved as Hugging Face folders, and the real default model."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _save_tiny(path, model_type: str, **overrides):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[model_type]
    fields = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.15,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    fields.update(overrides)
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(cls(**fields), dtype=torch.float32)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A 2-layer random Llama (GQA, untied head) with no tokenizer: prompts are token ids."""
    return str(_save_tiny(tmp_path_factory.mktemp("tiny-llama"), "llama"))


@pytest.fixture(scope="session")
def tiny_llama_chat(tmp_path_factory):
    """A 2-layer random Llama with a byte-level tokenizer (258 tokens, no merges) and a ChatML template:
    text and chat prompts work, as with a real model."""
    path = tmp_path_factory.mktemp("tiny-llama-chat")
    tokenizer = _byte_tokenizer()
    tokenizer.save_pretrained(path)
    return str(_save_tiny(path, "llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id))


def _byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # one token per byte
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"], chat_template=template)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    """A 2-layer random Qwen2 (q/k/v biases, tied embeddings)."""
    return str(_save_tiny(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", tie_word_embeddings=True))


@pytest.fixture(scope="session")
def default_model_path():
    """The embedded SmolLM2-135M-Instruct as a safetensors folder (converted once into the cache)."""
    from lookahead_serve.engine.loader import resolve_model

    return resolve_model(None)


def hf_greedy(model_path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Hugging Face ``generate`` greedy outputs (one prompt at a time, float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False)
            outs.append(y[0, len(ids) :].tolist())
    return outs


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: without it they are reported as skipped, never passed."""
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in gpu_items:
        item.add_marker(skip)


class RandomRungs:
    """A lookahead policy that gives every request a random rung of its ladder (or plain decoding) each
    step: installed as ``scheduler.planner.policy``, it checks that no choice of (w, n, g) changes a token."""

    name = "random"

    def __init__(self, seed: int) -> None:
        import random

        self.rng = random.Random(seed)

    def choose(self, options, base_tokens, base_segments, base_yield, budget, base_decodes=None, cost_scale=1.0):
        from lookahead_serve.scheduler.policy import Decision

        choices, tokens = [], base_tokens
        for opts in options:
            c = self.rng.randrange(-1, len(opts))
            if c >= 0 and tokens + opts[c].num_tokens - 1 - base_tokens <= budget:
                choices.append(c)
                tokens += opts[c].num_tokens - 1
            else:
                choices.append(None)
        return Decision(choices, tokens, 0, 0.0, 0.0)
