"""The wheel installs one top-level package, lookahead_serve, so it lives beside proto-plus (whose top-level
package is ``proto``, and which ``ray[serve]`` brings) and shadows nothing."""

from __future__ import annotations

import site
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_installs_beside_proto_plus(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(ROOT)], check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("lookahead_serve-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        top = {name.split("/")[0] for name in z.namelist()}
        assert top == {"lookahead_serve", wheel.name.split("-py3")[0] + ".dist-info"}
        assert "lookahead_serve/deploy/prompts.jsonl" in z.namelist()  # make load's default prompts
        for source in ("cpu_kernels.h", "quant/blockq.c", "attention/paged_cpu.c", "models/ops_cpu.c"):  # C kernels, built on first use
            assert f"lookahead_serve/engine/{source}" in z.namelist()
        # A fresh environment: the wheel unpacked into its site-packages (a pure-Python wheel installs so),
        # its dependencies (torch, proto-plus, ...) from this environment's site-packages through a .pth
        # file, which runs none of this environment's own .pth hooks (such as the editable install's).
        env = tmp_path / "env"
        venv.create(env, with_pip=False)
        purelib = Path(sysconfig.get_path("purelib", vars={"base": str(env), "platbase": str(env)}))
        z.extractall(purelib)
    (purelib / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    code = (
        "import proto, lookahead_serve\n"
        "from lookahead_serve import LLM, LookaheadParams, SamplingParams\n"
        "from lookahead_serve.proto.lookahead.v1 import lookahead_pb2, lookahead_pb2_grpc\n"
        "import lookahead_serve.proto.server\n"
        "assert hasattr(proto, 'Message'), proto.__file__  # proto-plus's, not ours\n"
        f"assert lookahead_serve.__file__.startswith({str(purelib)!r}), lookahead_serve.__file__\n"
        "assert LookaheadParams.parse('7,4,7').window_size == 7 and SamplingParams().max_tokens > 0\n"
        "print(proto.__file__)\n"
    )
    out = subprocess.run([str(env / "bin" / "python"), "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
