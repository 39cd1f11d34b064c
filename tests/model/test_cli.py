"""The command line, on the real default model."""

from __future__ import annotations

import subprocess
import sys

import pytest

import engine
from engine import cli
from engine.cli import main


@pytest.mark.slow
def test_generate_streams_and_reports_speed(default_model_path, capsys):
    assert main(["generate", "What is 2 + 2?", "--max-tokens", "8", "--lookahead", "4,3,4"]) == 0
    out, err = capsys.readouterr()
    assert out.strip()
    assert "tokens/s" in err and "tokens/step" in err


def test_bad_flags_exit_with_usage_errors():
    bad = subprocess.run([sys.executable, "-m", "engine.cli", "generate", "x", "--lookahead", "4,2,4"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "ngram_size" in bad.stderr
    missing = subprocess.run([sys.executable, "-m", "engine.cli", "generate", "x", "--model", "/nonexistent"],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "never downloaded" in missing.stderr


# The adaptive policy's objective follows the command: a server values every token alike, a one-shot
# generate waits for its batch to finish.


@pytest.fixture
def built(monkeypatch):
    seen: list[dict] = []

    class FakeLLM:
        def __init__(self, model, **kwargs):
            seen.append(kwargs)

    monkeypatch.setattr(engine, "LLM", FakeLLM)
    return seen


@pytest.mark.parametrize(
    ("argv", "default", "expected"),
    [
        (["serve"], "throughput", "throughput"),
        (["generate", "hi"], "makespan", "makespan"),
        (["serve", "--lookahead-objective", "makespan"], "throughput", "makespan"),
        (["generate", "hi", "--lookahead-objective", "throughput"], "makespan", "throughput"),
    ],
)
def test_objective_defaults_by_command_and_follows_the_flag(built, argv, default, expected):
    cli._engine_from_args(cli.build_parser().parse_args(argv), default)
    assert built[-1]["lookahead_objective"] == expected


def test_an_unknown_objective_is_refused(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--lookahead-objective", "latency"])
    assert "invalid choice" in capsys.readouterr().err
