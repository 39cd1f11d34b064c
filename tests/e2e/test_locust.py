"""deploy/locustfile.py through locust's own command line, headless, against a real server on 127.0.0.1.

The server runs a tiny random Llama with a byte-level tokenizer and a chat template, so the locustfile
sends what it sends to the real model (chat messages from an MT-bench style file); the prompts are this
test's own file, never ../shared.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lookahead_serve.engine import LLM
from tests.e2e.conftest import serving

ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = ["Write a haiku about the sea.", "Explain recursion to a child.", "List three uses of copper.",
             "Why is the sky blue?", "Translate 'good morning' into French."]

if importlib.util.find_spec("locust") is None:  # not imported here: locust monkey-patches the process
    pytest.skip("locust is not installed (pip install -e .[serve])", allow_module_level=True)


def _stats(csv_prefix: Path) -> dict[str, dict[str, str]]:
    with open(f"{csv_prefix}_stats.csv", newline="") as f:
        return {row["Name"]: row for row in csv.DictReader(f)}


def test_headless_locust_run_has_no_failures(tiny_llama_chat, tmp_path):
    prompts = tmp_path / "questions.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "turns": [q, "And then?"]}) + "\n"
                               for i, q in enumerate(QUESTIONS)))
    csv_prefix = tmp_path / "load"
    llm = LLM(tiny_llama_chat, block_size=8, num_kv_blocks=256, max_model_len=512)
    with serving(llm, "tiny-chat") as (port, engine):
        command = [sys.executable, "-m", "locust", "-f", str(ROOT / "deploy" / "locustfile.py"), "--headless",
                   "-u", "4", "-r", "4", "-t", "8s", "--only-summary", "--csv", str(csv_prefix),
                   "--host", f"127.0.0.1:{port}", "--prompts", str(prompts), "--max-tokens", "16"]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-3000:]
        deadline = time.monotonic() + 10  # users stopped mid-stream: their requests are aborted
        while engine.num_live_requests and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.num_live_requests == 0
    stats = _stats(csv_prefix)
    for name in ("ttft", "generate", "Aggregated"):
        assert int(stats[name]["Request Count"]) > 0, stats
        assert int(stats[name]["Failure Count"]) == 0, (stats, run.stderr[-3000:])
    assert float(stats["ttft"]["Average Response Time"]) <= float(stats["generate"]["Average Response Time"])
