"""The tile map of every kernel (``kernels/_tiles.py``): a 1-D grid, head blocks fastest."""

from __future__ import annotations

import pytest
import torch

from mlarope.kernels._tiles import cdiv, geometry, tile_grid


@pytest.mark.parametrize(
    ("n_tokens", "block_t", "n_heads", "block_h", "programs", "head_blocks"),
    [
        (16384, 1, 128, 16, 16384 * 8, 8),
        (10, 4, 20, 8, 3 * 3, 3),  # partial token and head blocks
        (1, 1, 128, 128, 1, 1),
        (7, 8, 3, 4, 1, 1),
    ],
)
def test_tile_grid_covers_every_token_and_head_block(
    n_tokens, block_t, n_heads, block_h, programs, head_blocks
):
    grid, n_head_blocks = tile_grid(n_tokens, block_t, n_heads, block_h)
    assert grid == (programs,) and n_head_blocks == head_blocks
    # program p -> (p // n_head_blocks, p % n_head_blocks), as kernels' program_tile computes:
    # every (token block, head block) exactly once, a token block's head blocks adjacent.
    tiles = [(p // n_head_blocks, p % n_head_blocks) for p in range(min(programs, 64))]
    assert (
        tiles
        == [(t, h) for t in range(cdiv(n_tokens, block_t)) for h in range(head_blocks)][
            : len(tiles)
        ]
    )


def test_geometry_reads_thd_and_4d_layouts():
    x = torch.empty(5, 3, 24)
    assert geometry(x) == (5, 1, 3, 24, 72, 0, 24)
    y = torch.empty(2, 5, 3, 24).transpose(0, 1)  # bshd viewed as sbhd
    assert geometry(y) == (5, 2, 3, 24, 72, 360, 24)
    assert cdiv(7, 2) == 4 and cdiv(8, 2) == 4 and cdiv(0, 3) == 0


def test_tile_grid_refuses_more_programs_than_a_launch_takes():
    with pytest.raises(ValueError, match="2147483648 programs"):
        tile_grid(2**31, 1, 1, 1)
