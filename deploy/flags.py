"""Command-line flags generated from the engine's config dataclasses, so flags and configs cannot drift.

Every field of ModelConfig, CacheConfig, SchedulerConfig and LookaheadConfig becomes a flag named as vLLM
names it where vLLM has one (``--max-num-seqs``, ``--enable-prefix-caching/--no-enable-prefix-caching``),
with the field's ``help`` metadata as its help text and the field's default as its default.
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import MISSING, fields

from lookahead_serve.engine.config import CacheConfig, EngineConfig, ModelConfig
from lookahead_serve.scheduler import LookaheadConfig, LookaheadParams, SchedulerConfig

# field name -> flag, where the plain --field-name would not read well
_LOOKAHEAD_FLAGS = {"default": "--lookahead", "policy": "--lookahead-policy", "objective": "--lookahead-objective",
                    "explore_every": "--lookahead-explore-every", "min_gain": "--lookahead-min-gain",
                    "max_window_size": "--max-lookahead-window-size", "max_ngram_size": "--max-lookahead-ngram-size",
                    "max_verification_set_size": "--max-lookahead-verification-set-size"}
_GROUPS = [("model", ModelConfig, {"model": "--model"}), ("cache", CacheConfig, {"num_blocks": "--num-kv-blocks"}),
           # the scheduler's max_model_len is the model's, filled in by the engine
           ("scheduler", SchedulerConfig, {"max_model_len": None}), ("lookahead", LookaheadConfig, _LOOKAHEAD_FLAGS)]


def lookahead_arg(text: str) -> LookaheadParams:
    """argparse type for "W,N,G" or "off"."""
    try:
        return LookaheadParams.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _type(cls, name: str):
    hint = typing.get_type_hints(cls)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return lookahead_arg if args[0] is LookaheadParams else args[0]


def add_config_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """Add a flag for every config field (but those named in ``skip``) to ``parser``."""
    for group, cls, names in _GROUPS:
        g = parser.add_argument_group(f"{group} ({cls.__name__})")
        for f in fields(cls):
            flag = names.get(f.name, "--" + f.name.replace("_", "-"))
            if f.name in skip or "help" not in f.metadata or flag is None:
                continue
            default = f.default if f.default is not MISSING else f.default_factory()
            shown = default.label() if isinstance(default, LookaheadParams) else default
            text = f.metadata["help"] + ("" if "default" in f.metadata["help"] else f" (default: {shown})")
            kw = dict(dest=f"{group}.{f.name}", default=default, help=text.replace("%", "%%"))
            kind = _type(cls, f.name)
            if kind is bool:
                g.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
            else:
                g.add_argument(flag, type=kind, metavar=f.name.upper(), choices=f.metadata.get("choices"), **kw)


def engine_config(args: argparse.Namespace, **model_overrides) -> EngineConfig:
    """The EngineConfig the parsed flags describe (``model_overrides`` replace ModelConfig fields)."""
    values = vars(args)

    def build(group, cls, **extra):
        given = {f.name: values[f"{group}.{f.name}"] for f in fields(cls) if f"{group}.{f.name}" in values}
        given.pop("model", None) if group == "model" and "model" in extra else None
        return cls(**{**given, **extra})

    return EngineConfig(
        model=build("model", ModelConfig, **model_overrides),
        cache=build("cache", CacheConfig),
        scheduler=build("scheduler", SchedulerConfig, lookahead=build("lookahead", LookaheadConfig)),
    )
