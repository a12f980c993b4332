"""Megatron-Core's own ``MLASelfAttention``, built without TransformerEngine: the layer of
``tests/test_integration_megatron.py`` and of ``benchmarks/megatron_layers.py``.

Megatron-Core's local (non-TransformerEngine) spec cannot build MLA: its ``DotProductAttention``
takes no ``k_channels`` / ``v_channels`` (and no packed sequences), and the GPU lane has no
TransformerEngine. So the layer is built from the local spec (its linear layers and RMSNorms)
with the core attention replaced by a plain PyTorch causal attention (:class:`TorchCoreAttention`);
everything that computes the queries and keys, the tables and the RoPE calls is Megatron-Core's
own code. Needs a Megatron-LM checkout on ``sys.path`` (:func:`megatron_core` puts it there).

Shapes (Megatron's): the layer takes ``hidden_states: [S, B, hidden]`` (sbhd) or
``[T, 1, hidden]`` with ``packed_seq_params`` (thd) and returns ``(output, bias)``, the output
of the same shape.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Widths:
    """An MLA layer's widths (Megatron's config names in the comments)."""

    hidden: int  # hidden_size
    heads: int  # num_attention_heads
    q_lora: int  # q_lora_rank
    kv_lora: int  # kv_lora_rank
    nope: int = 128  # qk_head_dim (the per-head nope width)
    rope: int = 64  # qk_pos_emb_head_dim
    v: int = 128  # v_head_dim


# DeepSeek-V3's MLA (config.json of deepseek-ai/DeepSeek-V3: hidden_size 7168, 128 heads,
# q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128).
DEEPSEEK_V3 = Widths(hidden=7168, heads=128, q_lora=1536, kv_lora=512)
# The integration test's: DeepSeek-V3's per-head dims, the rest scaled down.
SMALL = Widths(hidden=512, heads=8, q_lora=192, kv_lora=128)


@contextlib.contextmanager
def megatron_core(path: str | None) -> Iterator[None]:
    """Megatron-Core from the checkout at ``path`` (put first on ``sys.path``; None: an
    installed megatron-core), with a one-process model-parallel state (NCCL with a GPU, gloo
    without) for the block. A process group that already exists is used and left alone."""
    if path and path not in sys.path:
        sys.path.insert(0, path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.transformer.multi_latent_attention  # noqa: F401
        from megatron.core import parallel_state
    created = not torch.distributed.is_initialized()
    if created:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        store = torch.distributed.HashStore()
        torch.distributed.init_process_group(backend, store=store, rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(123)  # Megatron's modules may fork its CUDA RNG tracker
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if created:
            torch.distributed.destroy_process_group()


@contextlib.contextmanager
def yarn_on(device: torch.device) -> Iterator[None]:
    """Megatron's YaRN module moves its frequencies to ``torch.cuda.current_device()``; on the
    CPU, point that at the CPU for the block (a no-op on CUDA)."""
    if device.type != "cpu":
        yield
        return
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = saved


class TorchCoreAttention(torch.nn.Module):
    """Causal softmax attention in plain PyTorch (``scaled_dot_product_attention``), with the
    constructor and call of Megatron-Core's core attention.

    - sbhd: ``query, key: [S, B, H, D]``, ``value: [S, B, H, Dv]`` in, ``[S, B, H * Dv]`` out;
    - thd (``packed_seq_params`` given): ``[T, H, D]`` / ``[T, H, Dv]`` in, ``[T, H, Dv]`` out,
      one causal block per sequence of ``packed_seq_params.cu_seqlens_q``. Sequences of equal
      length (``T == n * max_seqlen_q`` for ``n`` sequences, checked on the device without a
      sync) run as one batched call of ``[n, H, L, D]``; any other packing one call per
      sequence (with a sync to read ``cu_seqlens_q``)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None,
                 k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None,
                 **kwargs):  # fmt: skip
        super().__init__()
        self.softmax_scale = softmax_scale

    def _attend(self, q, k, v):  # [..., H, L, D]
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale
        )

    def forward(self, query, key, value, attention_mask, packed_seq_params=None,
                attn_mask_type=None, **kwargs):  # fmt: skip
        if packed_seq_params is None:
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
            out = self._attend(q, k, v).permute(2, 0, 1, 3)
            return out.reshape(*out.shape[:2], -1)
        cu_seqlens = packed_seq_params.cu_seqlens_q
        tokens, n = query.shape[0], cu_seqlens.numel() - 1
        length = packed_seq_params.max_seqlen_q
        if length and n * length == tokens:
            # Every sequence is max_seqlen_q long exactly when the lengths all equal it.
            torch._assert_async(torch.all(cu_seqlens.diff() == length))
            q, k, v = (x.view(n, length, *x.shape[1:]).transpose(1, 2) for x in (query, key, value))
            out = self._attend(q, k, v).transpose(1, 2)  # [n, L, H, Dv]
            return out.reshape(tokens, *out.shape[2:])
        parts = []
        for start, end in itertools.pairwise(cu_seqlens.tolist()):
            q, k, v = (x[start:end].transpose(0, 1) for x in (query, key, value))
            parts.append(self._attend(q, k, v).transpose(0, 1))
        return torch.cat(parts, dim=0)


def build_mla(fusion: bool, dtype: torch.dtype, device, widths: Widths):
    """Megatron-Core's ``MLASelfAttention`` (layer 1 of 1) from an ``MLATransformerConfig`` with
    ``widths``, DeepSeek-V3's YaRN settings (factor 40 over 4,096 positions, beta 32/1, mscale
    and mscale_all_dim 1), RMSNorm q/kv norms, no biases, no dropout, ``apply_rope_fusion =
    fusion``, parameters in ``dtype``; weights from ``torch.manual_seed(0)`` (CPU
    initialization, so every build has the same weights), moved to ``device``. Needs
    :func:`megatron_core` active."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    w = widths
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = MLATransformerConfig(
            num_layers=1, hidden_size=w.hidden, num_attention_heads=w.heads, q_lora_rank=w.q_lora,
            kv_lora_rank=w.kv_lora, qk_head_dim=w.nope, qk_pos_emb_head_dim=w.rope,
            v_head_dim=w.v, rope_type="yarn", rotary_base=10000, rotary_scaling_factor=40,
            original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0,
            mscale_all_dim=1.0, qk_layernorm=True, normalization="RMSNorm",
            apply_rope_fusion=fusion, use_cpu_initialization=True, params_dtype=dtype,
            bf16=dtype == torch.bfloat16, attention_dropout=0.0, hidden_dropout=0.0,
            gradient_accumulation_fusion=False, add_bias_linear=False,
        )  # fmt: skip
        spec = get_gpt_layer_local_spec(
            multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm"
        ).submodules.self_attention
        spec.submodules.core_attention = TorchCoreAttention
        torch.manual_seed(0)
        layer = build_module(spec, config=config, layer_number=1)
    return layer.to(device)


def packed_seq_params(cu_seqlens: Sequence[int], device):
    """Megatron-Core's ``PackedSeqParams`` (thd) for the cumulative lengths ``cu_seqlens``
    (``[n + 1]``, from 0; int32 on ``device``), the same for queries and keys, with the longest
    sequence as ``max_seqlen_q`` / ``max_seqlen_kv``."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor(list(cu_seqlens), dtype=torch.int32, device=device)
    longest = max(b - a for a, b in itertools.pairwise(cu_seqlens))
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=longest, max_seqlen_kv=longest)  # fmt: skip
