"""Read a GGUF file's linear weights as they are stored: Q4_0, Q4_1 and Q8_0 blocks, unexpanded."""

from __future__ import annotations

import re

import numpy as np

from lookahead_serve.engine.quant.linear import QK, BlockWeight

# GGUF tensor name -> Hugging Face parameter name, for the Llama-family architectures we load.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
SUPPORTED_TYPES = ("Q4_0", "Q4_1", "Q8_0")
ARCHITECTURES = ("llama", "qwen2")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF linear weight (None for anything else)."""
    if gguf_name == "output.weight":
        return "lm_head.weight"
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if (m := _LAYER_RE.fullmatch(gguf_name)) and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"
    return None


def _decode(kind: str, raw: np.ndarray, n: int, k: int) -> BlockWeight:
    """Raw GGUF blocks ([n, bytes per row] uint8) -> q, d, m per block of 32."""
    nb = k // QK
    if kind == "Q8_0":  # d (f16), 32 x int8
        blocks = raw.reshape(n, nb, 34)
        d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        return BlockWeight(blocks[..., 2:].copy().view(np.int8).reshape(n, k), d, None)
    if kind == "Q4_1":  # d (f16), m (f16), 16 bytes: element i in the low nibble, i + 16 in the high
        blocks = raw.reshape(n, nb, 20)
        d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., 4:]
    else:  # Q4_0: d (f16), 16 bytes; w = d * (q - 8)
        blocks = raw.reshape(n, nb, 18)
        d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        m = -8.0 * d
        qs = blocks[..., 2:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int8).reshape(n, k)
    return BlockWeight(q, d, m)


def _unpermute_rows(w: BlockWeight, n_head: int) -> BlockWeight:
    """Undo llama.cpp's rotary row order for q/k (as transformers' GGUF loader does for the dense weight)."""
    n = w.q.shape[0]
    order = np.arange(n).reshape(n_head, n // n_head // 2, 2).swapaxes(2, 1).reshape(n)
    return BlockWeight(w.q[order], w.d[order], None if w.m is None else w.m[order])


def read_block_weights(path, hf_config) -> tuple[dict[str, BlockWeight], str | None]:
    """The linear weights of a GGUF file by Hugging Face name, and None; or ({}, why not) when some layer's
    linear weight is of a type the kernel does not hold, or the architecture is not one we know."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else "?"
    if arch not in ARCHITECTURES:
        return {}, f"GGUF architecture {arch!r} is not block-quantized here (only {', '.join(ARCHITECTURES)})"
    out: dict[str, BlockWeight] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        kind = t.tensor_type.name
        k, n = (int(x) for x in t.shape[:2])  # GGUF lists the fastest axis first
        if kind not in SUPPORTED_TYPES:
            if name.startswith("model.layers."):
                return {}, f"{t.name} is {kind}; block-quantized layers take {', '.join(SUPPORTED_TYPES)}"
            continue  # an embedding or output layer of another type stays dense
        w = _decode(kind, np.asarray(t.data), n, k)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = hf_config.num_attention_heads if "q_proj" in name else hf_config.num_key_value_heads
            w = _unpermute_rows(w, heads)
        out[name] = w
    return out, None
