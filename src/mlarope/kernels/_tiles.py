"""How tensors and the launch grid map onto the kernels' tiles of tokens x heads.

Every rotation kernel runs on a 1-D grid of ``token blocks x head blocks`` programs, head blocks
fastest: program ``p`` owns token block ``p // n_head_blocks`` and head block
``p % n_head_blocks``. The programs of one token block are therefore adjacent in launch order
and run side by side, so every row of a token is read and written at about the same time. With
token blocks fastest (a 2-D grid ``(token blocks, head blocks)``), the key/value backward's
first head block, whose programs also read every head's rope slice for the head sum, ran as one
wave ahead of the others, so each ``dk`` row was read in two parts far apart in time: 89-91 %
of the copy bandwidth against 97-99 % head-major. Nsight Compute on the H200 counted the same
DRAM bytes both ways (1.34 GB read, 1.06 GB written) at 80.6 % against 86.7 % of the peak
DRAM throughput (docs/perf_log.md, v8).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def program_tile(n_head_blocks):
    """``(token block, head block)`` of this program (1-D grid, head blocks fastest)."""
    pid = tl.program_id(0)
    return pid // n_head_blocks, pid % n_head_blocks


MAX_PROGRAMS = 2**31 - 1  # CUDA's limit on a grid's first dimension


def tile_grid(n_tokens: int, block_t: int, n_heads: int, block_h: int) -> tuple[tuple[int], int]:
    """``((programs,), n_head_blocks)`` for ``program_tile``."""
    n_head_blocks = cdiv(n_heads, block_h)
    programs = cdiv(n_tokens, block_t) * n_head_blocks
    if programs > MAX_PROGRAMS:
        raise ValueError(
            f"{n_tokens} tokens x {n_heads} heads in tiles of {block_t} x {block_h} need "
            f"{programs} programs, more than one launch takes ({MAX_PROGRAMS}); use larger tiles"
        )
    return (programs,), n_head_blocks


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= ``n`` (1 for ``n <= 1``): tile sizes are powers of 2."""
    return triton.next_power_of_2(max(int(n), 1))


def cdiv(a: int, b: int) -> int:
    """Ceiling division in plain Python (``triton.cdiv`` goes through Triton's JIT wrapper,
    several microseconds a call on the launch path)."""
    return -(-a // b)


def geometry(t: torch.Tensor) -> tuple[int, int, int, int, int, int, int]:
    """``(D0, D1, H, D, stride0, stride1, stride_h)`` of ``[D0, D1, H, D]`` or ``[T, H, D]``
    (as ``[T, 1, H, D]``), read without making views: this runs on every call."""
    shape, stride = t.shape, t.stride()
    if len(shape) == 3:
        return shape[0], 1, shape[1], shape[2], stride[0], 0, stride[1]
    return shape[0], shape[1], shape[2], shape[3], stride[0], stride[1], stride[2]
