"""benchmarks/soak.py for 60 s (after a 10 s warm-up) against a tiny random model, through the real server.

The server (its own process) runs the tiny Llama with a byte-level tokenizer and a chat template, so text
and chat prompts work, with a KV cache of 262 blocks of 8 tokens: 16 clients need more than that at
times, so preemption runs too. About 90 s in all.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_soak_60s_has_no_unexpected_errors_and_no_leaks(tiny_llama_chat, tmp_path):
    out, server_log = tmp_path / "soak.json", tmp_path / "server.log"
    command = [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--model", tiny_llama_chat,
               "--duration", "60", "--warmup", "10", "--clients", "16", "--seed", "1",
               "--server-args", "--block-size 8 --kv-cache-memory-gib 0.001",
               "--json", str(out), "--server-log", str(server_log)]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    checks = {c["key"]: c for c in report["checks"]}
    assert report["unexpected"] == [], json.dumps(report["unexpected"], indent=1)
    assert checks["kv"]["pass"], checks["kv"]
    assert checks["rss"]["pass"], (checks["rss"], report["series"])
    assert checks["threads"]["pass"], checks["threads"]
    assert checks["healthy"]["pass"] and checks["step_failures"]["pass"], server_log.read_text()[-3000:]
    assert checks["exit"]["pass"], checks["exit"]
    assert run.returncode == 0, run.stdout[-3000:]
    # The workload really was mixed: every kind ran, and cancels, deadlines and bad inputs did their part.
    kinds = report["kinds"]
    assert set(kinds) == {"greedy, lookahead", "greedy, plain", "sampled, lookahead", "sampled, plain",
                          "cancel", "deadline", "bad"}, kinds
    assert int(kinds["cancel"]["CANCELLED"]) > 0 and int(kinds["deadline"]["DEADLINE_EXCEEDED"]) > 0
    assert len(report["bad_inputs"]) == report["bad_kinds"], report["bad_inputs"]  # every kind was sent
    assert all(int(kinds[k]["OK"]) > 0 for k in ("greedy, lookahead", "greedy, plain", "sampled, lookahead",
                                                 "sampled, plain"))
