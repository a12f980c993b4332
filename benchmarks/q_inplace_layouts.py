"""The in-place query kernel by pair layout, direction and tile (GPU lane; docs/perf_log.md, v10).

The benchmark once found the in-place forward (interleaved in, half-split out) about 9 µs slower
with 1 and 4 sequences than the backward (half-split in, interleaved out) and than the forward
at 64-4,096 sequences. This times the kernel alone (``rope_q_launch`` onto itself, positions
precomputed outside the timed call for thd) at DeepSeek-V3 shapes, with ``do_bench`` (L2
flushed before every call): with ``--layouts``, every (interleaved_in, interleaved_out,
transpose) with the heuristic's tile; by default, the forward's and the backward's layouts
(interleaved -> half-split and back) with the heuristic's tile and the candidates in CONFIGS.

    PYTHONPATH=src python3 benchmarks/q_inplace_layouts.py [--layouts]
"""

from __future__ import annotations

import argparse
import itertools

import torch
from triton.testing import do_bench

import sweep  # benchmarks/sweep.py: this script's folder is first on sys.path
from mlarope import YarnConfig
from mlarope.kernels import lookup
from mlarope.kernels.q import QLaunchConfig, choose_q_config, rope_q_launch
from mlarope.positions import Positions

TOKENS, HEADS, NOPE, ROPE = 16384, 128, 128, 64
# (block_t, block_h, block_n, num_warps) candidates beside the heuristic: the heuristic before
# v10, (1, 64, 64, 2) with loaded positions and (1, 128, 64, 4) without, and the fastest tiles
# of the sweep with the search in the call (docs/perf_log.md, v10).
CONFIGS = [(1, 32, 64, 1), (1, 16, 64, 1), (1, 64, 64, 1), (1, 64, 64, 2), (1, 128, 64, 4)]


def main(device: torch.device | None = None, argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", action="store_true")
    args = parser.parse_args(argv)
    device = device or torch.device("cuda")
    cos, sin = YarnConfig.deepseek_v3(dim=ROPE).cos_sin(32768, device)
    copy_tbps = sweep.copy_tbps(1 << 29, device)  # 1 GiB of bf16
    print(f"copy {copy_tbps:.3f} TB/s")
    rope_bytes = TOKENS * HEADS * 2 * ROPE * 2
    for case in ("sbhd", "thd1", "thd4", "thd64", "thd1024", "thd4096"):
        if case == "sbhd":
            q = torch.randn(4096, 4, HEADS, NOPE + ROPE, device=device, dtype=torch.bfloat16)
            positions = Positions("sbhd", None, None, 0, 1)
        else:
            n = int(case[3:])
            q = torch.randn(TOKENS, HEADS, NOPE + ROPE, device=device, dtype=torch.bfloat16)
            cu = (torch.arange(n + 1, dtype=torch.int32) * (TOKENS // n)).to(device)
            found = torch.empty(TOKENS, dtype=torch.int64, device=device)
            lookup.launch_cu_seqlens_search(cu, found, 0, 1)
            # The precomputed positions as position_ids: the same loads as the cu_seqlens path
            # without its search launch.
            positions = Positions("thd", None, found, 0, 1)
        if args.layouts:
            runs = [(*flags, None) for flags in itertools.product((True, False), repeat=3)]
        else:
            heuristic = choose_q_config(TOKENS, HEADS, NOPE, ROPE, True)
            configs = [None] + [
                QLaunchConfig(*c) for c in CONFIGS if QLaunchConfig(*c) != heuristic
            ]
            runs = [
                (il_in, not il_in, not il_in, cfg) for il_in in (True, False) for cfg in configs
            ]
        for il_in, il_out, transpose, cfg in runs:

            def call(q=q, positions=positions, il_in=il_in, il_out=il_out, tr=transpose, c=cfg):
                rope_q_launch(
                    q, q, cos, sin, positions, interleaved_in=il_in, interleaved_out=il_out,
                    inverse=False, transpose=tr, config=c,
                )  # fmt: skip

            ms = do_bench(call, warmup=25, rep=100)
            pct = 100 * rope_bytes / (ms * 1e-3) / 1e12 / copy_tbps
            label = "heuristic" if cfg is None else str(tuple(vars(cfg).values()))
            print(
                f"{case:8s} in={'il' if il_in else 'half':4s} out={'il' if il_out else 'half':4s}"
                f" transpose={transpose!s:5s} {label:17s} {ms * 1e3:7.1f} us {pct:5.1f} %",
                flush=True,
            )


if __name__ == "__main__":
    main()
