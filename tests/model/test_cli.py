"""The command line, on the real default model."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
