"""A deliberately racy in-place kernel: the negative control of the stress harness.

It does what the incumbent fused MLA RoPE kernel does in its in-place thd path: each program
finds its token's sequence by a linear scan over ``cu_seqlens``, loads a ``[BLOCK_H, R]`` tile
of interleaved pairs ``(x[2j], x[2j+1])``, rotates them and stores the result half-split
(``x[j]``, ``x[half+j]``) into the same memory, *without* a barrier between the loads and the
stores. Element ``x[k]`` is loaded by the thread that owns pair ``k // 2`` and stored by the
thread that owns output ``k`` (and, when the tile is smaller than the CTA, by copies of them in
other warps); nothing orders a store of one warp after a load of another, and the scan lets
warps drift apart, so a late warp can read an already-rotated value.

``skew_steps > 0`` (GPU only) adds a skew injector that changes nothing in the arithmetic:
before its loads, warp 0 of each program walks a chain of ``skew_steps`` dependent loads that
the other warps skip (the warp is read from ``%tid.x``), so the other warps load, rotate and
store first and warp 0 then loads values they already rotated. It makes the same missing
barrier show up reliably instead of once in a hundred trials.

Never used by the library. It exists so that ``python -m mlarope stress`` can show that its
harness sees races: the control must fail where ours never does. (Under Triton's interpreter
programs and threads run one after another, so the control never races there.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlarope.kernels._triton_compat import loop_bound


@triton.jit
def _racy_rope_inplace_kernel(
    x_ptr,  # [T, H, N + R], rotated in place
    cos_ptr,
    sin_ptr,  # [P, R]
    cu_ptr,  # cu_seqlens [n + 1], covering every token
    n_seqs,
    n_heads,
    n_nope,
    stride_xt,
    stride_xh,
    stride_table,
    skew_ptr,  # int32 zeros, the skew chain's target (SKEW only)
    skew_steps,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SKEW: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.arange(0, HALF)
    m = (o_h < n_heads)[:, None] & (j < HALF)[None, :]
    row = x_ptr + i_t * stride_xt + o_h.to(tl.int64)[:, None] * stride_xh + n_nope
    seq = 0
    for i in range(loop_bound(n_seqs)):  # the incumbent's linear scan
        seq = tl.where(tl.load(cu_ptr + i).to(tl.int64) <= i_t, i, seq)
    pos = i_t - tl.load(cu_ptr + seq).to(tl.int64)
    c_a = tl.load(cos_ptr + pos * stride_table + j).to(tl.float32)[None, :]
    c_b = tl.load(cos_ptr + pos * stride_table + HALF + j).to(tl.float32)[None, :]
    s_a = tl.load(sin_ptr + pos * stride_table + j).to(tl.float32)[None, :]
    s_b = tl.load(sin_ptr + pos * stride_table + HALF + j).to(tl.float32)[None, :]
    hop = tl.zeros((BLOCK_H, HALF), dtype=tl.int32)
    if SKEW:
        tid = tl.inline_asm_elementwise(
            "mov.u32 $0, %tid.x;", "=r,r", [hop], dtype=tl.int32, is_pure=True, pack=1
        )
        slow = (tid // 32) == 0
        for _ in range(loop_bound(skew_steps)):
            hop = tl.load(skew_ptr + hop, mask=slow, other=0)
    a = tl.load(row + 2 * j[None, :] + hop, mask=m).to(tl.float32)
    b = tl.load(row + 2 * j[None, :] + 1 + hop, mask=m).to(tl.float32)
    out_a = a * c_a - b * s_a
    out_b = b * c_b + a * s_b
    # The bug: no barrier here.
    tl.store(row + j[None, :], out_a.to(x_ptr.dtype.element_ty), mask=m)
    tl.store(row + HALF + j[None, :], out_b.to(x_ptr.dtype.element_ty), mask=m)


def racy_rope_inplace(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    block_h: int = 2,
    num_warps: int = 4,
    skew_steps: int = 0,
) -> None:
    """Rotate ``x: [T, H, N + R]`` (interleaved in, half-split out) in place, racily.

    ``cos, sin: [P, R]`` contiguous; ``cu_seqlens: [n + 1]`` with ``cu_seqlens[-1] == T``;
    ``skew_steps > 0`` delays warp 0 (CUDA only, see the module docstring).
    """
    skew = torch.zeros(16, dtype=torch.int32, device=x.device)
    n_tokens, n_heads, width = x.shape
    rope_dim = cos.shape[-1]
    grid = (n_tokens, triton.cdiv(n_heads, block_h))
    _racy_rope_inplace_kernel[grid](
        x, cos, sin, cu_seqlens, cu_seqlens.shape[0] - 1, n_heads, width - rope_dim,
        x.stride(0), x.stride(1), cos.stride(0), skew, skew_steps, HALF=rope_dim // 2,
        BLOCK_H=block_h, SKEW=skew_steps > 0, num_warps=num_warps,
    )  # fmt: skip
