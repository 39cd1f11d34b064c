"""The command line, on the real default model."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lookahead_serve import engine
from lookahead_serve.deploy import cli
from lookahead_serve.deploy.cli import main


@pytest.mark.slow
def test_generate_streams_and_reports_speed(default_model_path, capsys):
    assert main(["generate", "What is 2 + 2?", "--max-tokens", "8", "--lookahead", "4,3,4"]) == 0
    out, err = capsys.readouterr()
    assert out.strip()
    assert "tokens/s" in err and "tokens/step" in err


def test_bad_flags_exit_with_usage_errors():
    bad = subprocess.run([sys.executable, "-m", "lookahead_serve.deploy.cli", "generate", "x", "--lookahead", "4,2,4"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "ngram_size" in bad.stderr
    missing = subprocess.run([sys.executable, "-m", "lookahead_serve.deploy.cli", "generate", "x", "--model", "/nonexistent"],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "never downloaded" in missing.stderr


@pytest.fixture
def built(monkeypatch):
    seen: list = []

    class FakeLLM:
        @classmethod
        def from_config(cls, config, **kwargs):
            seen.append(config)

    monkeypatch.setattr(engine, "LLM", FakeLLM)
    return seen


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["serve"], "throughput"),
        (["generate", "hi"], "throughput"),
        (["serve", "--lookahead-objective", "makespan"], "makespan"),
        (["generate", "hi", "--lookahead-objective", "makespan"], "makespan"),
    ],
)
def test_one_objective_default_and_the_flag_overrides_it(built, argv, expected):
    cli._engine_from_args(cli.build_parser().parse_args(argv))
    assert built[-1].scheduler.lookahead.objective == expected


def test_every_config_field_is_a_flag_with_its_default(built):
    from dataclasses import fields

    from lookahead_serve.engine.config import CacheConfig, ModelConfig
    from lookahead_serve.scheduler import LookaheadConfig, SchedulerConfig

    cli._engine_from_args(cli.build_parser().parse_args(["serve"]))
    config = built[-1]
    assert config.model == ModelConfig() and config.cache == CacheConfig()
    assert config.scheduler == SchedulerConfig() and config.scheduler.lookahead == LookaheadConfig()
    serve = cli.build_parser().parse_args(["serve"])
    for group, cls in (("model", ModelConfig), ("cache", CacheConfig), ("scheduler", SchedulerConfig),
                       ("lookahead", LookaheadConfig)):
        for f in fields(cls):
            if f.name not in ("lookahead", "max_model_len") or group != "scheduler":
                assert f"{group}.{f.name}" in vars(serve), f"no flag for {cls.__name__}.{f.name}"
    argv = ["serve", "--no-enable-prefix-caching", "--max-num-seqs", "8", "--lookahead", "off", "--dtype", "float32",
            "--lookahead-policy", "fixed", "--num-kv-blocks", "64", "--max-model-len", "256"]
    cli._engine_from_args(cli.build_parser().parse_args(argv))
    c = built[-1]
    assert (c.cache.enable_prefix_caching, c.scheduler.max_num_seqs, c.model.dtype, c.cache.num_blocks) == (
        False, 8, "float32", 64)
    assert c.scheduler.lookahead.default.is_plain and c.scheduler.lookahead.policy == "fixed"
    assert c.model.max_model_len == 256


def test_an_unknown_objective_is_refused(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--lookahead-objective", "latency"])
    assert "invalid choice" in capsys.readouterr().err
