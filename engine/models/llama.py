"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2) over one packed varlen batch.

Our own modules with Hugging Face weight names, so a Hugging Face state dict loads as it is. The
arithmetic follows transformers' Llama modules operation for operation (RMSNorm in float32, rotary
embedding from transformers' own rope-initialisation functions), which is what makes greedy outputs equal
to ``generate`` token for token in float32. Attention goes through the engine's backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from lookahead_serve.engine.attention import AttentionBackend, AttentionMetadata, CommonAttentionMetadata
from lookahead_serve.engine.models import cpu_ops

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


def head_dim(config) -> int:
    """Per-head width: the config's own, else hidden size over heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(self, h: torch.Tensor, delta: torch.Tensor | None, native: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(h + delta), h + delta); ``native``: one C call that adds into ``h`` in place."""
        if native:
            return cpu_ops.add_rms_norm(h, delta, self.weight, self.eps), h
        if delta is not None:
            h = h + delta
        return self.forward(h), h


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, built with transformers' rope functions."""

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.max_positions = max_positions
        self.register_buffer("cos", torch.empty(max_positions, head_dim(config)), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim(config)), persistent=False)

    def build(self) -> None:
        """Fill the tables (after the module is materialised on its device)."""
        config, dim = self.config, head_dim(self.config)
        rope = getattr(config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type == "default":
            base = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            scaling = 1.0
        else:  # scaled ropes (llama3, yarn, ...) as transformers computes them
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        pos = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq.float()[None, :]  # [max_pos, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scaling).to(self.cos.device)
        self.sin = (emb.sin() * scaling).to(self.sin.device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # [num_tokens, 1, head_dim] each, broadcast over heads
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


@dataclass
class Rope:
    """One step's rotary embedding: per-token cos / sin in the model's dtype [T, 1, D] (torch), or, with
    ``native`` (the C operations), the float32 tables [max_pos, D] and the positions."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    native: bool


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim(config)
        self.scale = self.head_dim**-0.5
        qkv_bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=getattr(config, "attention_bias", False))
        self.qkv_proj: nn.Module | None = None  # q, k and v in one call (block-quantized models)
        self.backend = backend

    def forward(self, x, rope: Rope, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        if self.qkv_proj is not None:
            kv = self.num_kv_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split([self.num_heads * self.head_dim, kv, kv], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if rope.native:  # in place, on the projection's output
            cpu_ops.rotary_(q, rope.positions, rope.cos, rope.sin)
            cpu_ops.rotary_(k, rope.positions, rope.cos, rope.sin)
        else:
            q = q * rope.cos + _rotate_half(q) * rope.sin
            k = k * rope.cos + _rotate_half(k) * rope.sin
        if meta.transient_kv is not None:
            meta.transient_kv[self.layer_idx] = (k, v)  # the runner commits accepted lookahead tokens from it
        out = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.gate_up_proj: nn.Module | None = None  # gate and up in one call (block-quantized models)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)
            if cpu_ops.runs_on(gate_up):
                return self.down_proj(cpu_ops.silu_mul(gate_up))
            gate, up = gate_up.chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx, backend)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, delta, rope: Rope, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, delta) -> the next layer's (h, delta): the residual stream and the MLP output not yet added."""
        x, h = self.input_layernorm.add_forward(h, delta, rope.native)
        x, h = self.post_attention_layernorm.add_forward(h, self.self_attn(x, rope, kv_cache, meta), rope.native)
        return h, self.mlp(x)


class LlamaModel(nn.Module):
    def __init__(self, config, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        # A given weight skips the random init (the checkpoint overwrites it; under the meta device the init
        # would import torch._dynamo, ~1.3 s of start-up)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i, backend) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, max_positions)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        if config.model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"model_type {config.model_type!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        self.config = config
        self.backend = backend
        self.model = LlamaModel(config, backend, max_positions)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.block_head: nn.Module | None = None  # a block-quantized output layer (float32 logits)
        self.native_step: cpu_ops.DecoderStep | None = None  # the whole step as one C call (use_native_step)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],  # per layer [2, num_slots, num_kv_heads, head_dim]
        step: CommonAttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        meta = self.backend.build(step)  # once per step, read by every layer
        h = self.model.embed_tokens(input_ids)
        if self.native_step is not None and getattr(meta, "plan", None) is not None:
            return self.native_step(h, positions, kv_caches, meta)
        rotary = self.model.rotary
        if native := cpu_ops.runs_on(h):
            rope = Rope(positions.contiguous(), rotary.cos, rotary.sin, True)
        else:
            rope = Rope(positions, *rotary(positions, h.dtype), False)
        delta = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            h, delta = layer(h, delta, rope, kv_cache, meta)
        return self.model.norm.add_forward(h, delta, native)[0]

    def use_native_step(self) -> str | None:
        """Run each step as one C call (the same operations as the modules) where it can; why not, or None."""
        if (reason := cpu_ops.DecoderStep.unavailable_reason(self)) is None:
            self.native_step = cpu_ops.DecoderStep(self)
        return reason

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.block_head is not None:
            return self.block_head(hidden)
        weight = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, weight)

    def use_block_weights(self, packed: dict) -> None:
        """Swap the linear layers named in ``packed`` (engine.quant.load_packed: per layer qkv_proj, o_proj,
        gate_up_proj, down_proj, and lm_head) for block-quantized ones, keeping their biases (call after
        ``load_weights``, which skips ``block_weight_names(packed)``)."""
        from lookahead_serve.engine.quant import BlockQuantLinear

        def block(name, biases=(), out_dtype=None):
            p = packed[name]
            has = [b is not None for b in biases]
            if any(has) and not all(has):
                raise ValueError(f"{name}: only some of the fused projections have a bias")
            bias = torch.cat([b.detach() for b in biases]) if any(has) else None
            return BlockQuantLinear(p.packed, p.out_features, p.in_features, p.q4, bias, out_dtype)

        for i, layer in enumerate(self.model.layers):
            prefix = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj = block(prefix + "self_attn.qkv_proj", [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
            attn.o_proj = block(prefix + "self_attn.o_proj", [attn.o_proj.bias])
            mlp.gate_up_proj = block(prefix + "mlp.gate_up_proj", [mlp.gate_proj.bias, mlp.up_proj.bias])
            mlp.down_proj = block(prefix + "mlp.down_proj", [mlp.down_proj.bias])
            del attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj
        if "lm_head" in packed:
            self.block_head = block("lm_head", out_dtype=torch.float32)
            if not self.tie_word_embeddings:
                del self.lm_head

    @staticmethod
    def block_weight_names(packed: dict) -> set[str]:
        """The Hugging Face weights that ``use_block_weights(packed)`` replaces."""
        from lookahead_serve.engine.quant import FUSED

        names = {"lm_head.weight"} if "lm_head" in packed else set()
        for name in packed:
            for fused, originals in FUSED.items():
                if name.endswith(fused):
                    names.update(f"{name[: -len(fused)]}{fused.split('.')[0]}.{o}.weight" for o in originals)
        return names

    def load_weights(self, state_dict: dict[str, torch.Tensor], skip: set[str] = frozenset()) -> None:
        """Copy a Hugging Face state dict in (the module may come from ``to_empty``) and build rope tables.
        Weights named in ``skip`` are neither needed nor read."""
        params = dict(self.named_parameters())
        missing = set(params) - set(skip)
        for name, tensor in state_dict.items():
            if (name == "lm_head.weight" and self.tie_word_embeddings) or name in skip:
                continue
            if name not in params:
                if "rotary_emb" in name:
                    continue
                raise ValueError(f"unexpected weight {name!r} for {self.config.model_type}")
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor)
            missing.discard(name)
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {sorted(missing)[:5]}")
        self.model.rotary.build()
