"""The serving benchmark's inputs: one input set of an op (activations, positions, slots and the
cache or output buffers, as engines lay them out) and the tables each op is given."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .model import Dims, OpSpec, takes_pair_tables


@dataclass
class Inputs:
    """One input set of an op: the activations, positions, slots and the destination."""

    kv_c: torch.Tensor | None = None
    k_pe: torch.Tensor | None = None
    q_nope: torch.Tensor | None = None
    q_pe: torch.Tensor | None = None
    o: torch.Tensor | None = None  # output op: [T, H, D]
    groups: int = 1  # output op: the head groups of the output projection
    scale_out: torch.Tensor | None = None  # output op, vLLM's layout: MN-major fp32 scales
    positions: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    cache: object = None
    out: torch.Tensor | None = None
    scale: torch.Tensor | None = None


def _slots(tokens: int, dims: Dims, gen, prefill: bool) -> tuple[torch.Tensor, int]:
    """``(slots, num_blocks)``: prefill tokens fill shuffled pages in order (a sequence's
    pages), decode tokens go to random slots of a cache twice their number."""
    bs = dims.block_size
    if prefill:
        n_blocks = -(-tokens // bs)
        pages = torch.randperm(n_blocks, generator=gen)
        t = torch.arange(tokens)
        return pages[t // bs] * bs + t % bs, n_blocks
    n_blocks = max(1, -(-2 * tokens // bs))
    return torch.randperm(n_blocks * bs, generator=gen)[:tokens], n_blocks


def make_inputs(op: OpSpec, tokens: int, dims: Dims, device, gen, prefill: bool) -> Inputs:
    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dims.dtype).to(device)

    positions = torch.randint(0, dims.positions, (tokens,), generator=gen).to(device)
    inp = Inputs(positions=positions, scale=torch.tensor([0.05], device=device))
    width = dims.latent + dims.rope
    if op.kind == "output":
        inp.o = randn(tokens, dims.heads, dims.head_dim)
        inp.groups = max(1, dims.heads // dims.heads_per_group)
        if op.out_given:
            inp.out, inp.scale_out = vllm_output_buffers(tokens, dims, device)
        return inp
    if op.kind == "query":
        inp.q_nope = randn(tokens, dims.heads, dims.latent)
        inp.q_pe = randn(tokens, dims.heads, dims.rope)
        if op.out_given:
            dtype = torch.float8_e4m3fn if op.fp8_out else dims.dtype
            inp.out = torch.empty(tokens, dims.heads, width, dtype=dtype, device=device)
        return inp
    # a fused projection's output, as engines slice it
    latent = dims.v4_latent if op.fmt == "fp8_584" else dims.latent
    proj = randn(tokens, latent + dims.rope)
    inp.kv_c, inp.k_pe = proj[:, :latent], proj[:, latent:]
    slots, n_blocks = _slots(tokens, dims, gen, prefill)
    inp.slots = slots.to(device)
    bs = dims.block_size
    if op.fmt == "fp8_656":
        inp.cache = torch.zeros(n_blocks, bs, 656, dtype=torch.uint8, device=device)
    elif op.fmt == "fp8_584":  # as FlashMLA allocates it: blocks padded to 576 bytes
        padded = -(-bs * 584 // 576) * 576
        raw = torch.zeros(n_blocks, padded, dtype=torch.uint8, device=device)
        inp.cache = raw[:, : bs * 584].view(n_blocks, bs, 1, 584)
    elif op.fmt == "concat":
        inp.cache = torch.zeros(n_blocks, bs, width, dtype=op.cache_dtype, device=device)
    else:
        inp.cache = (
            torch.zeros(n_blocks, bs, dims.latent, dtype=op.cache_dtype, device=device),
            torch.zeros(n_blocks, bs, dims.rope, dtype=op.cache_dtype, device=device),
        )
    return inp


def vllm_output_buffers(tokens: int, dims: Dims, device) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's buffers for DeepSeek-V4's FP8 output projection on Hopper
    (``fused_inv_rope_fp8_quant``): codes ``[G, T, W]`` and fp32 scales ``[G, K, T']`` (``T'``
    the tokens rounded up to 4, MN-major, as DeepGEMM takes them), as the ``[T, G, ..]`` views
    the op writes."""
    g = max(1, dims.heads // dims.heads_per_group)
    width = dims.heads // g * dims.head_dim
    k = width // 128
    padded = -(-tokens // 4) * 4
    codes = torch.empty(g, tokens, width, dtype=torch.float8_e4m3fn, device=device)
    scales = torch.zeros(g * k * padded, dtype=torch.float32, device=device)
    scales = scales.as_strided((g, tokens, k), (k * padded, 1, padded))
    return codes.transpose(0, 1), scales.transpose(0, 1)


def rope_tables(op: OpSpec, dims: Dims, cos, sin):
    """The tables ours is given: with ``dims.pair_tables`` the pair tables ``[P, R / 2]``
    (column views of the ``[P, R]`` tables, as an engine's ``cos_sin_cache`` halves are), else
    the full tables."""
    if takes_pair_tables(op, dims):
        half = cos.shape[1] // 2
        return cos[:, :half], sin[:, :half]
    return cos, sin


def clone_inputs(a: Inputs) -> Inputs:
    def clone(v):  # with the same strides (fp8_584's padded blocks, MN-major scales)
        if not isinstance(v, torch.Tensor):
            return v
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device).copy_(v)

    b = Inputs(**{k: clone(v) for k, v in vars(a).items()})
    if isinstance(a.cache, tuple):
        b.cache = tuple(c.clone() for c in a.cache)
    if a.kv_c is not None:  # keep kv_c and k_pe slices of one projection, as engines pass them
        proj = torch.cat((a.kv_c, a.k_pe), dim=1)
        b.kv_c, b.k_pe = proj[:, : a.kv_c.shape[1]], proj[:, a.kv_c.shape[1] :]
    return b
