"""A model folder's tokenizer on the ``tokenizers`` library alone: encode, decode and the chat template
(jinja2, in the environment transformers renders templates in). Importing transformers costs about a
second at start-up; for a plain ``tokenizer.json`` (what the engine's converted GGUF models have, and
what transformers itself runs) nothing of it is needed. Anything else (a slow tokenizer, flags that make
transformers rewrite the post-processor, a template using transformers' own tags) loads through
``AutoTokenizer`` (engine.loader.load_tokenizer); tests hold both to the same outputs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from tokenizers import Tokenizer

# Settings under which transformers does more than tokenizer.json says: those folders go to AutoTokenizer.
_TRANSFORMERS_ONLY = ("add_bos_token", "add_eos_token", "add_prefix_space", "do_lower_case", "legacy")
_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(frozen=True, slots=True)
class Encoding:
    input_ids: list[int]


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


class FastTokenizer:
    """The subset of transformers' tokenizer interface the engine uses."""

    def __init__(self, backend: Tokenizer, config: dict, chat_template: str | None) -> None:
        self.backend_tokenizer = backend
        self.clean_up_tokenization_spaces = False
        self.special_tokens = {name: text for name in _SPECIAL if (text := _token_text(config.get(name)))}
        ids = {name: backend.token_to_id(text) for name, text in self.special_tokens.items()}
        self.bos_token_id, self.eos_token_id, self.pad_token_id = (ids.get(f"{n}_token") for n in ("bos", "eos", "pad"))
        self.chat_template = chat_template
        self._template = _compile(chat_template) if chat_template else None

    @classmethod
    def load(cls, folder: Path) -> FastTokenizer | None:
        """The folder's tokenizer, or None when only transformers reproduces it."""
        folder = Path(folder)
        try:
            config = json.loads((folder / "tokenizer_config.json").read_text())
        except (OSError, ValueError):
            return None
        if (config.get("tokenizer_class") not in ("TokenizersBackend", "PreTrainedTokenizerFast")
                or not (folder / "tokenizer.json").is_file() or config.get("clean_up_tokenization_spaces")
                or any(key in config for key in _TRANSFORMERS_ONLY)):
            return None
        template_file = folder / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        if template is not None and not isinstance(template, str):  # named templates: transformers picks
            return None
        try:
            return cls(Tokenizer.from_file(str(folder / "tokenizer.json")), config, template)
        except _TemplateError:  # a tag only transformers' environment has ({% generation %})
            return None

    def __call__(self, text: str, add_special_tokens: bool = True) -> Encoding:
        return Encoding(self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = False):
        """The conversation as text, rendered as transformers renders it (``tokenize`` must be False)."""
        if self._template is None:
            raise ValueError("this tokenizer has no chat template")
        if tokenize:
            raise ValueError("apply_chat_template renders text here; tokenize it with add_special_tokens=False")
        messages = [dict(m) for m in messages]  # the template may not change the caller's messages
        return self._template.render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self.special_tokens)


class _TemplateError(Exception):
    pass


def _compile(template: str):
    """transformers' template environment (utils/chat_template_utils.py): a sandbox with trim_blocks and
    lstrip_blocks, loop controls, and its ``tojson``, ``raise_exception`` and ``strftime_now``."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise _TemplateError(str(e)) from None
