"""CPU linear kernels on the default model's shapes: one step's linears (30 layers and the output layer,
each weight distinct, so they stream from memory as in a real step) at M = 1..32 rows.

Candidates: float32 and bfloat16 ``F.linear`` (bf16 without oneDNN, as the engine runs it), torch's weight-only
int8 and int4 CPU kernels (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``, bf16 activations),
FBGEMM's dynamic int8 linear (``quantize_dynamic``: per-tensor activation scale, so not row-invariant), and
the engine's block-quantized kernel (engine/quant: 4-bit blocks, int8 activations per block). Rounds
interleave the candidates; the table gives the median over rounds of each step time and the range.
``--against REV`` adds the block kernel as it was at git revision REV (built from that revision's blockq.c
into a temporary library, with this machine's flags or, ``--against-flags avx2``, the AVX2 baseline's), fed the
same weights and inputs, and checks that both give the same bits.

    .venv/bin/python benchmarks/kernels.py --results benchmarks/results/DATE-kernels.md
    .venv/bin/python benchmarks/kernels.py --kinds "block 4-bit (engine)" --against HEAD~1 --rounds 9
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

from lookahead_serve.engine import native
from lookahead_serve.engine.model_runner import _without_onednn
from lookahead_serve.engine.quant import BlockQuantLinear, BlockWeight
from lookahead import _emit, _header, log

LAYERS = 30
# per layer (out, in): q, k, v, o, gate, up, down; then the output layer
SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
HEAD = (49152, 576)


def _make(kind: str, n: int, k: int, gen: torch.Generator):
    w = torch.randn(n, k, generator=gen) * 0.02
    if kind == "float32":
        return lambda x: F.linear(x, w)
    if kind == "bfloat16":
        wb = w.bfloat16()
        return lambda x: F.linear(x, wb)
    if kind == "int8 weight-only":
        s = w.abs().amax(1) / 127
        wq, sb = torch.round(w / s[:, None]).to(torch.int8), s.bfloat16()
        return lambda x: torch.ops.aten._weight_int8pack_mm(x, wq, sb)
    if kind == "int4 weight-only":
        g = 32
        wg = w.view(n, k // g, g)
        lo, hi = wg.amin(-1), wg.amax(-1)
        sc = (hi - lo) / 15
        q = torch.clamp(torch.round((wg - lo[..., None]) / sc[..., None]), 0, 15).to(torch.int32).view(n, k)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
        sz = torch.stack([sc, lo + 8 * sc], -1).transpose(0, 1).contiguous().bfloat16()
        return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, g, sz)
    if kind == "FBGEMM dynamic int8":
        lin = torch.nn.Linear(k, n, bias=False)
        lin.weight.data = w
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(lin), {torch.nn.Linear}, dtype=torch.qint8)
    if kind == "block 4-bit (engine)":
        rng = np.random.default_rng(int(torch.randint(0, 1 << 30, (1,), generator=gen)))
        d = rng.uniform(0.001, 0.01, (n, k // 32)).astype(np.float32)
        four_bit = (n, k) != HEAD  # the output layer is Q8_0 in the shipped file
        q = rng.integers(0, 16, (n, k), dtype=np.int8) if four_bit else rng.integers(-127, 128, (n, k), dtype=np.int8)
        return BlockQuantLinear.from_weight(BlockWeight(q, d, -8 * d if four_bit else None))
    raise ValueError(kind)


class _RevisionKernel:
    """The block kernel of git revision ``rev``, applied to a copy of an engine BlockQuantLinear's packed weights
    (a copy, so that neither kind finds the other's weights in cache; the packed layout is checked to be the
    same)."""

    def __init__(self, rev: str, cflags: list[str] | None) -> None:
        root = Path(__file__).resolve().parents[1]
        self.dir = tempfile.TemporaryDirectory()
        d = Path(self.dir.name)
        for rel in ("engine/quant/blockq.c", "engine/cpu_kernels.h"):
            (d / rel).parent.mkdir(parents=True, exist_ok=True)
            (d / rel).write_bytes(subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=root, check=True,
                                                 capture_output=True).stdout)
        so = d / "blockq.so"
        native.compile_shared([d / "engine/quant/blockq.c"], so, cflags)
        self.lib = ctypes.CDLL(str(so))
        p, i = ctypes.c_void_p, ctypes.c_int
        self.lib.blockq_linear.argtypes = [i, i, i, p, i, p, i, p, i, p, i]
        self.lib.blockq_packed_bytes.restype = ctypes.c_long
        self.lib.blockq_packed_bytes.argtypes = [i, i, i]

    def wrap(self, lin: BlockQuantLinear) -> BlockQuantLinear:
        """The same layer over a copy of its weights, calling this revision's kernel (the Python around the
        call is the engine's, so both kinds pay the same per-call cost)."""
        n, k, q4 = lin.out_features, lin.in_features, int(lin.q4)
        if self.lib.blockq_packed_bytes(n, k, q4) != lin.packed.numel():
            raise SystemExit("--against: that revision packs weights in another layout")
        # the engine's scratch size covers what earlier kernels needed
        return BlockQuantLinear(lin.packed.clone(), n, k, lin.q4, out_dtype=lin.out_dtype, lib=self.lib)


INPUT_DTYPE = {"float32": torch.float32, "FBGEMM dynamic int8": torch.float32}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 4, 8, 16, 32])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--kinds", nargs="*", default=["float32", "bfloat16", "int8 weight-only", "int4 weight-only",
                                                     "FBGEMM dynamic int8", "block 4-bit (engine)"])
    ap.add_argument("--against", metavar="REV", default=None,
                    help="also time the block kernel of this git revision (same weights; outputs checked equal)")
    ap.add_argument("--against-flags", choices=("machine", "avx2"), default="machine",
                    help="build REV's kernel with this machine's flags (native.flags()) or the AVX2 baseline")
    ap.add_argument("--results", type=Path, default=None)
    args = ap.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    steps = {}
    for kind in args.kinds:
        log(f"building {kind}")
        steps[kind] = ([[_make(kind, n, k, gen) for n, k in SHAPES] for _ in range(LAYERS)], _make(kind, *HEAD, gen))
    if args.against:
        engine = steps.get("block 4-bit (engine)")
        if engine is None:
            raise SystemExit("--against needs the kind 'block 4-bit (engine)'")
        rev = _RevisionKernel(args.against, native.FLAGS if args.against_flags == "avx2" else None)
        layers, head = engine
        rev_head = rev.wrap(head)
        steps[f"block 4-bit @ {args.against}"] = ([[rev.wrap(lin) for lin in layer] for layer in layers], rev_head)
        x = torch.randn(37, 576, generator=gen).bfloat16()  # 37 rows: every row-group size of both kernels
        if not torch.equal(rev_head(x), head(x)):
            raise SystemExit(f"the block kernel at {args.against} gives other bits than the current one")
    times: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode(), _without_onednn():
        for r in range(args.rounds):
            for m in args.rows:
                order = list(steps.items())
                for kind, (layers, head) in (order[::-1] if r % 2 else order):  # alternate who goes first
                    dt = INPUT_DTYPE.get(kind, torch.bfloat16)
                    xs = {k: torch.randn(m, k, generator=gen).to(dt) for k in (576, 1536)}

                    def step():
                        for layer in layers:
                            for (_, k), lin in zip(SHAPES, layer, strict=True):
                                lin(xs[k])
                        head(xs[576])

                    if r == 0:
                        step()  # warm-up
                    t0 = time.perf_counter()
                    step()
                    times.setdefault((kind, m), []).append(time.perf_counter() - t0)
            log(f"round {r} done")
    lines = ["| kernel | " + " | ".join(f"M={m} ms" for m in args.rows) + " |", "|---|" + "---|" * len(args.rows)]
    for kind in steps:
        cells = []
        for m in args.rows:
            t = [x * 1e3 for x in times[(kind, m)]]
            cells.append(f"{statistics.median(t):.1f} ({min(t):.1f}-{max(t):.1f})")
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    _emit(f"{_header()}\n\nOne step's linears (30 layers + output layer), median (range) over {args.rounds} rounds:\n\n"
          + "\n".join(lines), "CPU linear kernels", args.results)


if __name__ == "__main__":
    main()
