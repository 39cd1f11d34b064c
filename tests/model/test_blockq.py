"""The block-quantized kernel: right against the dequantized weights, a row's bits independent of what
shares the call (M, threads, fused rows), and the GGUF file's blocks held exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lookahead_serve.engine.quant import BlockQuantLinear, BlockWeight, resolve_quantization
from lookahead_serve.engine.quant.kernel import unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def _weight(n: int, k: int, four_bit: bool, seed: int) -> BlockWeight:
    rng = np.random.default_rng(seed)
    nb = k // 32
    d = rng.uniform(0.001, 0.02, (n, nb)).astype(np.float32)
    if four_bit:
        return BlockWeight(rng.integers(0, 16, (n, k), dtype=np.int8), d, -8 * d)
    return BlockWeight(rng.integers(-127, 128, (n, k), dtype=np.int8), d, None)


def _quantized_input_reference(x: torch.Tensor, w: BlockWeight) -> torch.Tensor:
    """x quantized per block of 32 to int8 as the kernel does (float32 scale amax / 127, q = round(x * (1 /
    scale))), times the dequantized weight, in float64."""
    xb = x.float().view(x.shape[0], -1, 32)
    scale = xb.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale > 0, torch.round(xb * (1 / scale)), 0)
    return (q.double() * scale.double()).view(x.shape) @ w.dequantize().double().t()


@pytest.mark.parametrize("four_bit", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_the_dequantized_weight(four_bit, dtype):
    w = _weight(200, 576, four_bit, seed=1)
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(0)).to(dtype)
    lin = BlockQuantLinear.from_weight(w, out_dtype=torch.float32)
    y = lin(x).double()
    ref = _quantized_input_reference(x.float(), w)
    assert ((y - ref).norm() / ref.norm()).item() < 1e-5  # the same quantized product, float32 rounding
    dense = x.double() @ w.dequantize().double().t()
    assert ((y - dense).norm() / dense.norm()).item() < 2e-2  # int8 activations cost little


@pytest.mark.parametrize("four_bit", [True, False])
def test_a_row_has_the_same_bits_for_any_batch_and_thread_count(four_bit):
    w = _weight(964, 1536, four_bit, seed=2)  # 964 rows: 241 tiles of 4, split unevenly across threads
    lin = BlockQuantLinear.from_weight(w)
    x = torch.randn(150, 1536, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(150)])
    assert [m for m in range(1, 65) if not torch.equal(lin(x[:m]), alone[:m])] == []
    assert torch.equal(lin(x), alone)  # 150 rows: several passes of rows over the weights (a prefill's shape)
    x, alone = x[:64], alone[:64]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(lin(x), alone)
    finally:
        torch.set_num_threads(threads)
    # fused rows: the first 576 outputs of a [q; k; v]-style stack equal the first weight's own
    fused = BlockQuantLinear.from_weight(BlockWeight.concat([w, _weight(384, 1536, four_bit, seed=4)]))
    assert torch.equal(fused(x)[:, :964], alone)


def test_the_vnni_build_gives_the_avx2_builds_bits(tmp_path):
    """Where the CPU has AVX-512 VNNI the kernel is built to use it; its int8 dot products are the same
    integers, so every output has the bits of the AVX2 build (a model answers the same on either CPU)."""
    import ctypes

    from lookahead_serve.engine import native
    from lookahead_serve.engine.quant.kernel import declare

    if native.flags() == native.FLAGS:
        pytest.skip("this CPU has no AVX-512 VNNI: the engine's build is the AVX2 one")
    native.compile_shared([native.SOURCES[0]], tmp_path / "avx2.so", native.FLAGS)
    avx2 = declare(ctypes.CDLL(str(tmp_path / "avx2.so")))
    gen = torch.Generator().manual_seed(5)
    for four_bit in (True, False):
        lin = BlockQuantLinear.from_weight(_weight(200, 576, four_bit, seed=6), out_dtype=torch.float32)
        other = BlockQuantLinear(lin.packed, lin.out_features, lin.in_features, lin.q4, out_dtype=torch.float32,
                                 lib=avx2)
        for dtype in (torch.bfloat16, torch.float32):
            for m in (1, 3, 5, 8, 37):  # both of the kernel's forms and several row groups
                x = torch.randn(m, 576, generator=gen).to(dtype)
                assert torch.equal(lin(x), other(x)), (four_bit, dtype, m)


def test_a_compiler_without_the_cpus_extra_flags_gets_the_avx2_build(tmp_path, monkeypatch, caplog):
    """Where the extra ISA flags do not compile (a compiler older than the CPU), the library is built with the
    AVX2 baseline flags (same bits) instead of failing, which would fall back to dequantized weights."""
    from lookahead_serve.engine import loader, native
    from lookahead_serve.engine.quant.kernel import declare

    monkeypatch.setattr(native, "flags", lambda: native.FLAGS + ["-mno-such-isa-flag"])
    monkeypatch.setattr(loader, "cache_root", lambda: tmp_path)
    with caplog.at_level("WARNING", logger=native.__name__):
        lib = declare(native.library.__wrapped__())
    assert "building them for AVX2" in caplog.text
    assert list((tmp_path / "kernels").glob("engine-*.so"))
    lin = BlockQuantLinear.from_weight(_weight(8, 64, True, seed=0))
    other = BlockQuantLinear(lin.packed, 8, 64, True, lib=lib)
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(other(x), lin(x))


def test_rejects_shapes_and_dtypes_it_cannot_hold():
    with pytest.raises(ValueError, match="multiples"):
        BlockQuantLinear.from_weight(_weight(6, 64, True, seed=0))
    lin = BlockQuantLinear.from_weight(_weight(8, 64, True, seed=0))
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        lin(torch.zeros(2, 64, dtype=torch.float16))
    assert lin(torch.zeros(0, 64)).shape == (0, 8)
    with pytest.raises(ValueError, match="quantization must be"):
        resolve_quantization("int4", None, "cpu")
    with pytest.raises(ValueError, match="not a GGUF file"):
        resolve_quantization("gguf", None, "cpu")
    assert resolve_quantization("auto", None, "cpu") == "none"


def test_a_fused_projection_needs_all_or_none_of_its_biases():
    from transformers import LlamaConfig

    from lookahead_serve.engine.models.llama import LlamaForCausalLM
    from lookahead_serve.engine.quant import FUSED, PackedWeight
    from lookahead_serve.engine.quant.linear import pack

    cfg = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, attention_bias=True)
    packed = {}
    for name, parts in FUSED.items():
        w = _weight(64 * len(parts), 64, True, seed=0)
        packed["model.layers.0." + name] = PackedWeight(pack(w), *w.shape, True)
    model = LlamaForCausalLM(cfg, None, 8)
    model.use_block_weights(packed)
    assert model.model.layers[0].self_attn.qkv_proj.bias.shape == (192,)
    model = LlamaForCausalLM(cfg, None, 8)
    model.model.layers[0].self_attn.k_proj.bias = None
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.qkv_proj"):
        model.use_block_weights(packed)


@pytest.mark.slow
def test_gguf_blocks_dequantize_to_the_converted_weights(default_model_path):
    """The default model's Q4_1 / Q8_0 blocks, read as stored (q/k rows put back in Hugging Face's rotary
    order), dequantize bit for bit to the weights transformers converted the same file into."""
    from safetensors import safe_open

    from lookahead_serve.engine.loader import default_model_file, load_hf_config
    from lookahead_serve.engine.quant.gguf import read_block_weights

    weights, why = read_block_weights(default_model_file(), load_hf_config(default_model_path))
    assert why is None
    assert len(weights) == 1 + 7 * 30  # the tied embedding / output layer and seven linears per layer
    with safe_open(str(default_model_path / "model.safetensors"), framework="pt") as f:
        bad = [name for name, w in weights.items() if not torch.equal(w.dequantize(), f.get_tensor(name))]
    assert bad == []
