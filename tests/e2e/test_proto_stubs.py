"""The committed Python stubs are exactly what `make proto` generates from the .proto file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STUBS = ("lookahead_pb2.py", "lookahead_pb2_grpc.py", "lookahead_pb2.pyi")


def test_stubs_are_fresh(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-Ilookahead_serve/proto={ROOT / 'proto'}",
         f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}",
         "lookahead_serve/proto/lookahead/v1/lookahead.proto"],
        check=True, cwd=ROOT,
    )
    for name in STUBS:
        fresh = (tmp_path / "lookahead_serve/proto/lookahead/v1" / name).read_text()
        committed = (ROOT / "proto/lookahead/v1" / name).read_text()
        assert committed == fresh, f"{name} is stale: run `make proto`"
