"""The command line, on the real default model."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lookahead_serve import engine
from lookahead_serve.deploy import cli
from lookahead_serve.deploy.cli import main


@pytest.mark.slow
def test_generate_streams_and_reports_speed(default_model_path, loggers, capsys):
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


def _serve_args(*argv: str):
    return cli.build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize(
    ("argv", "model"),
    [([], None), (["m.gguf"], "m.gguf"), (["--model", "m.gguf"], "m.gguf"), (["m.gguf", "--model", "m.gguf"], "m.gguf"),
     (["org/name", "--dtype", "float32"], "org/name")],
)
def test_serve_takes_the_model_positionally_or_as_a_flag(built, argv, model):
    cli._engine_from_args(_serve_args(*argv))
    assert built[-1].model.model == model


def test_two_different_models_are_refused_before_anything_loads(built, loggers, capsys):
    assert main(["serve", "a.gguf", "--model", "b.gguf", "--log-level", "error"]) == 2
    assert "two models given: 'a.gguf' (positional) and --model 'b.gguf'" in capsys.readouterr().err
    assert built == []


def test_vllm_named_flags_and_their_defaults():
    defaults = vars(_serve_args())
    assert {k: defaults[k] for k in ("model.dtype", "model.device", "model.max_model_len", "scheduler.max_num_seqs",
                                     "scheduler.max_num_batched_tokens", "cache.enable_prefix_caching",
                                     "served_model_name", "api_key", "host", "port", "http_port", "log_level",
                                     "disable_log_requests")} == {
        "model.dtype": "auto", "model.device": "cpu", "model.max_model_len": None, "scheduler.max_num_seqs": 64,
        "scheduler.max_num_batched_tokens": 512, "cache.enable_prefix_caching": True, "served_model_name": None,
        "api_key": None, "host": "127.0.0.1", "port": 50051, "http_port": 8000, "log_level": "info",
        "disable_log_requests": False}
    given = vars(_serve_args("--dtype", "float16", "--device", "cuda:1", "--max-model-len", "1024", "--max-num-seqs",
                             "8", "--max-num-batched-tokens", "2048", "--no-enable-prefix-caching",
                             "--served-model-name", "m", "--api-key", "k", "--host", "0.0.0.0", "--port", "1",
                             "--http-port", "2", "--log-level", "debug", "--disable-log-requests"))
    assert [given[k] for k in ("model.dtype", "model.device", "model.max_model_len", "scheduler.max_num_seqs",
                               "scheduler.max_num_batched_tokens", "cache.enable_prefix_caching", "served_model_name",
                               "api_key", "host", "port", "http_port", "log_level", "disable_log_requests")] == [
        "float16", "cuda:1", 1024, 8, 2048, False, "m", "k", "0.0.0.0", 1, 2, "debug", True]
    assert vars(cli.build_parser().parse_args(["generate", "hi"]))["log_level"] == "info"


@pytest.mark.parametrize("command", ["serve", "generate", "client"])
def test_help_works(command, capsys):
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args([command, "--help"])
    assert e.value.code == 0 and "usage: lookahead-serve " + command in capsys.readouterr().out


@pytest.fixture
def loggers():
    """Restore the root logger and the CLI's named loggers after a test configures them."""
    import logging

    named = [logging.getLogger(), logging.getLogger("lookahead_serve.schedule"),
             logging.getLogger("lookahead_serve.requests")]
    saved = [(log, log.level, list(log.handlers)) for log in named]
    yield named
    for log, level, handlers in saved:
        log.setLevel(level)
        log.handlers[:] = handlers


@pytest.mark.parametrize(
    ("argv", "levels"),
    [(["serve"], ("INFO", "NOTSET", "NOTSET")),
     (["serve", "--log-level", "debug", "--disable-log-requests"], ("DEBUG", "NOTSET", "WARNING")),
     (["generate", "hi", "--log-level", "error", "--log-schedule"], ("ERROR", "INFO", "NOTSET"))],
)
def test_log_flags_set_the_levels(loggers, argv, levels):
    import logging

    for log in loggers:
        log.setLevel(logging.NOTSET)
    cli.configure_logging(cli.build_parser().parse_args(argv))
    assert tuple(logging.getLevelName(log.level) for log in loggers) == levels


def test_serve_passes_its_ports_and_name_to_the_server(monkeypatch, loggers):
    import types

    from lookahead_serve.engine import async_engine
    from lookahead_serve.proto import server

    calls = []

    async def fake_serve_forever(engine, name, host, port, metrics_port, **kwargs):
        calls.append((name, host, port, metrics_port, kwargs))

    fake_llm = types.SimpleNamespace(engine=None)
    monkeypatch.setattr(engine, "LLM", types.SimpleNamespace(from_config=lambda config, **kw: fake_llm))
    monkeypatch.setattr(async_engine, "AsyncLLMEngine", lambda llm_engine, max_live_requests: None)
    monkeypatch.setattr(server, "serve_forever", fake_serve_forever)
    argv = ["serve", "org/name", "--port", "5", "--http-port", "6", "--metrics-port", "7", "--log-level", "error"]
    assert main(argv) == 0
    assert main(["serve", "--model", "/models/m.gguf", "--log-level", "error"]) == 0
    (name, host, port, metrics, kw), (path_name, *_, path_kw) = calls
    assert (name, host, port, metrics) == ("org/name", "127.0.0.1", 5, 7)
    assert (kw["http_port"], kw["shutdown_grace"]) == (6, 30.0)
    assert (path_name, path_kw["http_port"]) == ("m.gguf", 8000)


def test_a_hub_id_in_the_local_cache_loads(tiny_llama, tmp_path, monkeypatch):
    from pathlib import Path

    from huggingface_hub import constants

    from lookahead_serve.engine import LLM
    from tests.unit.test_hub_resolution import cache_model

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    snapshot = cache_model(tmp_path, "org/tiny", Path(tiny_llama))
    prompt = [{"prompt_token_ids": [3, 14, 15, 92]}]
    params = engine.SamplingParams(temperature=0, max_tokens=6)
    small = dict(dtype="float32", block_size=4, num_kv_blocks=32, lookahead_policy="fixed")  # no step-cost profile
    from_hub = LLM("org/tiny", **small)
    assert from_hub.engine.model_path == snapshot
    local = LLM(tiny_llama, **small)
    tokens = [llm.generate(prompt, params)[0].outputs[0].token_ids for llm in (from_hub, local)]
    assert tokens[0] == tokens[1]
    with pytest.raises(ValueError, match="'org/absent' is not a local path and not in the local Hugging Face cache"):
        LLM("org/absent")


def test_generate_runs_a_hub_id_from_the_cache_in_hf_hub_cache(tiny_llama_chat, tmp_path):
    import os
    from pathlib import Path

    from tests.unit.test_hub_resolution import cache_model

    cache_model(tmp_path / "hub", "org/tiny-chat", Path(tiny_llama_chat))
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    argv = ["generate", "hi", "--model", "org/tiny-chat", "--max-tokens", "4", "--dtype", "float32",
            "--lookahead-policy", "fixed", "--log-level", "warning"]  # fixed: no step-cost profile
    run = subprocess.run([sys.executable, "-m", "lookahead_serve.deploy.cli", *argv],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "tokens/step" in run.stderr and "INFO" not in run.stderr
