"""Decoder operations in C (ops_cpu.c) for bfloat16 / float16 on x86 CPUs with AVX2: the fused residual
add + RMSNorm, the rotary embedding and silu(gate) * up, each one call in place of several torch calls, and
the whole decoder step as one call (``DecoderStep``)."""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from lookahead_serve.engine import native
from lookahead_serve.engine.quant.linear import scratch_bytes

logger = logging.getLogger(__name__)

_DTYPES = {d: code for d, code in native.DTYPE_CODES.items() if d != torch.float32}  # float32 stays in torch


@functools.cache
def _library() -> ctypes.CDLL | None:
    if (reason := native.load_error()) is not None:
        logger.info("decoder operations in torch: %s", reason)
        return None
    lib = native.library()
    i, p = ctypes.c_int, ctypes.c_void_p
    lib.rms_norm.restype = lib.rotary.restype = None
    lib.rms_norm.argtypes = [i, i, p, p, p, ctypes.c_float, p, i]
    lib.rotary.argtypes = [i, i, i, p, ctypes.c_long, p, p, p, i]
    lib.silu_mul.restype = None
    lib.silu_mul.argtypes = [i, i, p, p, i]
    lib.decoder_step.restype = i
    lib.decoder_step.argtypes = [p, p, i]
    return lib


def runs_on(x: torch.Tensor) -> bool:
    """Whether these operations take ``x`` (float32 stays in torch: its arithmetic matches transformers')."""
    return x.dtype in _DTYPES and x.device.type == "cpu" and _library() is not None


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h += delta (in place, rounded to h's dtype), then RMSNorm(h) * weight. h [M, N] contiguous."""
    m, n = h.shape
    if not h.is_contiguous() or weight.dtype != h.dtype:
        raise ValueError("add_rms_norm needs a contiguous h and a weight in h's dtype")
    if delta is not None:
        delta = delta.contiguous()
    out = torch.empty_like(h)
    _library().rms_norm(m, n, h.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), eps,
                        out.data_ptr(), _DTYPES[h.dtype])
    return out


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x [T, heads, D] in place (rows may be strided; heads packed) by the tables [max_pos, D] (x's dtype)."""
    t, heads, d = x.shape
    if x.stride(2) != 1 or x.stride(1) != d or cos.dtype != x.dtype or sin.dtype != x.dtype:
        raise ValueError("rotary_ needs heads packed within a row and tables in x's dtype")
    _library().rotary(t, heads, d, x.data_ptr(), x.stride(0), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                      _DTYPES[x.dtype])


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [M, 2N] = gate | up (rounded as torch rounds each), in one call."""
    m, n2 = gate_up.shape
    gate_up = gate_up.contiguous()
    out = torch.empty(m, n2 // 2, dtype=gate_up.dtype)
    _library().silu_mul(m, n2 // 2, gate_up.data_ptr(), out.data_ptr(), _DTYPES[gate_up.dtype])
    return out


class _Layer(ctypes.Structure):
    _fields_ = [*((f, ctypes.c_void_p) for f in ("qkv", "o", "gate_up", "down")),
                *((f"{f}_q4", ctypes.c_int) for f in ("qkv", "o", "gate_up", "down")),
                *((f"{f}_bias", ctypes.c_void_p) for f in ("qkv", "o", "gate_up", "down")),
                ("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p), ("k_cache", ctypes.c_void_p),
                ("v_cache", ctypes.c_void_p)]


class _Decoder(ctypes.Structure):
    _fields_ = [*((f, ctypes.c_int) for f in ("num_layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate",
                                              "dt")),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("layers", ctypes.POINTER(_Layer)),
                ("final_norm", ctypes.c_void_p), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p)]


class _Step(ctypes.Structure):
    _fields_ = [("T", ctypes.c_int), *((f, ctypes.c_void_p) for f in ("positions", "slot_mapping", "block_table")),
                ("max_blocks", ctypes.c_int), ("block_size", ctypes.c_int),
                *((f, ctypes.c_void_p) for f in ("tok_seg", "num_cached", "chain_ptr", "chain_idx", "h", "qkv")),
                ("qkv_layer_stride", ctypes.c_long),
                *((f, ctypes.c_void_p) for f in ("x", "delta", "attn", "gate_up", "act", "linear_scratch"))]


class DecoderStep:
    """A whole decoder step (every layer and the final norm) as one C call, ``decoder_step`` in ops_cpu.c:
    the same operations as the modules with the C operations, block weights and the invariant attention
    kernel, with one parallel region instead of ~10 library calls a layer (their overhead is most of a
    one-token step)."""

    def __init__(self, model) -> None:
        from lookahead_serve.engine.quant import BlockQuantLinear

        cfg, layers = model.config, model.model.layers
        attn = layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.hidden, self.intermediate = cfg.hidden_size, cfg.intermediate_size
        self.dtype = model.model.norm.weight.dtype
        self._keep = []  # tensors whose pointers the structures hold

        def ptr(t):
            if t is None:
                return None
            t = t.detach().contiguous()
            self._keep.append(t)
            return t.data_ptr()

        def lin(mod):
            if not isinstance(mod, BlockQuantLinear) or mod.out_dtype not in (None, self.dtype):
                raise ValueError("the C decoder step needs block-quantized linears")
            bias = None if mod.bias is None else mod.bias.to(self.dtype)
            return ptr(mod.packed), int(mod.q4), ptr(bias)

        self._layers = (_Layer * len(layers))()
        for st, layer in zip(self._layers, layers, strict=True):
            a, mlp = layer.self_attn, layer.mlp
            for name, mod in (("qkv", a.qkv_proj), ("o", a.o_proj), ("gate_up", mlp.gate_up_proj),
                              ("down", mlp.down_proj)):
                w, q4, b = lin(mod)
                setattr(st, name, w)
                setattr(st, f"{name}_q4", q4)
                setattr(st, f"{name}_bias", b)
            st.norm1, st.norm2 = ptr(layer.input_layernorm.weight), ptr(layer.post_attention_layernorm.weight)
        rot = model.model.rotary
        self._decoder = _Decoder(len(layers), self.hidden, self.heads, self.kv_heads, self.head_dim,
                                 self.intermediate, _DTYPES[self.dtype], layers[0].input_layernorm.eps, attn.scale,
                                 self._layers, ptr(model.model.norm.weight), ptr(rot.cos), ptr(rot.sin))
        self._caches: tuple[int, ...] = ()

    @staticmethod
    def unavailable_reason(model) -> str | None:
        """Why ``model`` cannot take the C step, or None if it can."""
        from lookahead_serve.engine.quant import BlockQuantLinear

        if model.model.norm.weight.dtype != torch.bfloat16 or model.model.norm.weight.device.type != "cpu":
            return "the C decoder step runs bfloat16 on the CPU"
        if _library() is None:
            return "the C operations do not run here"
        if not getattr(model.backend, "use_kernel", False):
            return "the attention backend is not the invariant C kernel"
        if not all(isinstance(m, BlockQuantLinear) for layer in model.model.layers
                   for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                             layer.mlp.down_proj)):
            return "the C decoder step needs block-quantized linears"
        return None

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta) -> torch.Tensor:
        """h [T, hidden] (the embeddings; used as the residual stream) -> the final norm's output [T, hidden]."""
        ptrs = tuple(c.data_ptr() for c in kv_caches)
        if ptrs != self._caches:
            for st, c in zip(self._layers, kv_caches, strict=True):
                if not c.is_contiguous():
                    raise ValueError("the C decoder step needs contiguous KV caches")
                st.k_cache, st.v_cache = c[0].data_ptr(), c[1].data_ptr()
            self._caches = ptrs
        T, E, I = h.shape[0], self.hidden, self.intermediate
        H, KVH, D = self.heads, self.kv_heads, self.head_dim
        qkv_w = (H + 2 * KVH) * D
        record = meta.transient_kv is not None  # lookahead: every layer's k, v are kept for the commit
        nl = len(self._layers)
        qkv = torch.empty(nl if record else 1, T, qkv_w, dtype=self.dtype)
        x, delta, attn = (torch.empty(T, E, dtype=self.dtype) for _ in range(3))
        gate_up, act = torch.empty(T, 2 * I, dtype=self.dtype), torch.empty(T, I, dtype=self.dtype)
        kmax = max(E, I, H * D)
        scratch = torch.empty(scratch_bytes(T, kmax), dtype=torch.uint8)
        plan, positions = meta.plan, positions.contiguous()
        step = _Step(T, positions.data_ptr(), plan.slots.data_ptr(), plan.block_table.data_ptr(),
                     plan.block_table.shape[1], meta.block_size, plan.tok_seg.data_ptr(), plan.num_cached.data_ptr(),
                     plan.chain_ptr.data_ptr(), plan.chain_idx.data_ptr(), h.data_ptr(), qkv.data_ptr(),
                     T * qkv_w if record else 0, x.data_ptr(), delta.data_ptr(), attn.data_ptr(), gate_up.data_ptr(),
                     act.data_ptr(), scratch.data_ptr())
        if T:
            rc = _library().decoder_step(ctypes.byref(self._decoder), ctypes.byref(step), torch.get_num_threads())
            if rc:
                raise MemoryError("the C decoder step could not allocate its scratch memory")
        if record:
            for layer in range(nl):
                k = qkv[layer, :, H * D : (H + KVH) * D].view(T, KVH, D)
                v = qkv[layer, :, (H + KVH) * D :].view(T, KVH, D)
                meta.transient_kv[layer] = (k, v)
        return x
