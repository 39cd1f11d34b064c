"""Block-quantized weights on the CPU: a GGUF file's Q4_0 / Q4_1 / Q8_0 linear weights kept as shipped and
multiplied by an AVX2 kernel (blockq.c), instead of dequantized into float32.

``load_packed`` reads the file once, fuses q/k/v and gate/up, packs the kernel's layout and caches the
result beside the converted weights; later loads map the cache.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from lookahead_serve.engine.config import QUANTIZATIONS
from lookahead_serve.engine.native import load_error
from lookahead_serve.engine.quant.linear import BlockQuantLinear, BlockWeight, pack

__all__ = ["BlockQuantLinear", "BlockWeight", "FUSED", "PackedWeight", "QUANTIZATIONS", "load_packed",
           "resolve_quantization"]

logger = logging.getLogger(__name__)

CACHE_VERSION = 1
# Per decoder layer: each block-quantized linear -> the Hugging Face projections it replaces, in row order.
FUSED = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "self_attn.o_proj": ("o_proj",),
         "mlp.gate_up_proj": ("gate_proj", "up_proj"), "mlp.down_proj": ("down_proj",)}


@dataclass
class PackedWeight:
    packed: torch.Tensor  # uint8, the kernel's layout
    out_features: int
    in_features: int
    q4: bool


def resolve_quantization(quantization: str, gguf_file: Path | None, device: str) -> str:
    """"auto" -> "gguf" when the model is a GGUF file and the kernel runs here (an x86-64 CPU with AVX2), else
    "none" (dequantized weights). "gguf" asks for the kernel and fails with the reason when it cannot run."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if quantization == "none":
        return "none"
    if gguf_file is None:
        reason = "the model is not a GGUF file"
    elif device != "cpu":
        reason = "block-quantized weights run on the CPU only"
    else:
        reason = load_error()  # built and loaded once, so a failed build dequantizes here
    if reason is None:
        return "gguf"
    if quantization == "gguf":
        raise ValueError(f"quantization 'gguf' is not available: {reason}")
    logger.info("weights dequantized: %s", reason)
    return "none"


def _fused(weights: dict[str, BlockWeight], num_layers: int, tied: bool) -> dict[str, BlockWeight]:
    """Per layer qkv_proj, o_proj, gate_up_proj, down_proj; and lm_head where it is block-quantized."""
    out = {}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        for name, parts in FUSED.items():
            ws = [weights[f"{p}{name.split('.')[0]}.{x}.weight"] for x in parts]
            out[p + name] = ws[0] if len(ws) == 1 else BlockWeight.concat(ws)
    head = weights.get("model.embed_tokens.weight" if tied else "lm_head.weight")
    if head is not None:
        out["lm_head"] = head
    return out


def load_packed(gguf_file: Path, hf_config, cache_dir: Path) -> dict[str, PackedWeight]:
    """The model's packed block weights by module name: from ``cache_dir`` if packed before, else read from
    ``gguf_file``, packed and saved there. Raises ValueError when a layer's weights are of another type."""
    from safetensors.torch import load_file, save_file

    from lookahead_serve.engine.quant.gguf import read_block_weights

    path = Path(cache_dir) / f"blockq-v{CACHE_VERSION}.safetensors"
    meta_path = path.with_suffix(".json")
    try:
        meta = json.loads(meta_path.read_text())
        tensors = load_file(str(path))
        return {name: PackedWeight(tensors[name], *meta[name]) for name in meta}
    except Exception:  # noqa: BLE001 - not packed yet, or unreadable: pack again
        pass
    weights, why = read_block_weights(gguf_file, hf_config)
    if why:
        raise ValueError(why)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    fused = _fused(weights, hf_config.num_hidden_layers, tied)
    packed = {name: PackedWeight(pack(w), w.shape[0], w.shape[1], w.m is not None) for name, w in fused.items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        os.close(fd)
        save_file({n: p.packed for n, p in packed.items()}, tmp)
        os.replace(tmp, path)
        meta_tmp = meta_path.with_suffix(f".{os.getpid()}.tmp")
        meta_tmp.write_text(json.dumps({n: [p.out_features, p.in_features, p.q4] for n, p in packed.items()}))
        os.replace(meta_tmp, meta_path)  # written last: its presence means the tensors are complete
    except OSError as e:
        logger.warning("could not cache the packed weights in %s: %s", path.parent, e)
    return packed
