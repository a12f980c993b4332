"""The serving benchmark's cases and bytes model: DeepSeek-V3's and V4's shapes, the ops it
times, and the fewest bytes each call moves (what % of a copy is measured against)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

PREFILL_TARGET = 0.90
HOST_TARGET_US = 15.0


@dataclass(frozen=True)
class Dims:
    latent: int = 512
    rope: int = 64
    heads: int = 128
    block_size: int = 64
    positions: int = 32768
    dtype: torch.dtype = torch.bfloat16
    v4_latent: int = 448  # DeepSeek-V4's nope width: fp8_584's latent
    head_dim: int = 512  # DeepSeek-V4's head, [nope 448 | rope 64]: the output op's D
    heads_per_group: int = 8  # V4's o_groups split its heads in groups of 8 (Pro: 128 / 16)
    # Every op is given pair tables [P, R / 2] (an engine's cos_sin_cache halves; FlashInfer's
    # input too), else the full tables [P, R] (--tables full).
    pair_tables: bool = True


@dataclass(frozen=True)
class OpSpec:
    key: str
    label: str
    kind: str  # "append" | "query" | "output"
    fmt: str = ""  # cache format (append)
    cache_dtype: torch.dtype | None = None  # concat / split: the cache's dtype
    fp8_out: bool = False  # query: FP8 output
    out_given: bool = False  # query, output: into a caller's buffers (output: vLLM's layout)


OPS = (
    OpSpec("append_concat_bf16", "append concat bf16", "append", "concat", torch.bfloat16),
    OpSpec("append_concat_fp8", "append concat fp8", "append", "concat", torch.float8_e4m3fn),
    OpSpec("append_split_bf16", "append split bf16", "append", "split", torch.bfloat16),
    OpSpec("append_split_fp8", "append split fp8", "append", "split", torch.float8_e4m3fn),
    OpSpec("append_fp8_656", "append fp8_656", "append", "fp8_656"),
    OpSpec("append_fp8_584", "append fp8_584 (V4)", "append", "fp8_584"),
    OpSpec("query_bf16", "decode query bf16", "query"),
    OpSpec("query_fp8", "decode query fp8", "query", fp8_out=True),
    OpSpec("query_fp8_out", "decode query fp8 into buffer", "query", fp8_out=True, out_given=True),
    OpSpec("output_fp8", "inverse rope fp8 output (V4)", "output", fp8_out=True),
    OpSpec(
        "output_fp8_vllm",
        "inverse rope fp8 output, vLLM layout",
        "output",
        fp8_out=True,
        out_given=True,
    ),
)
OPS_BY_KEY = {op.key: op for op in OPS}
CASES = {"prefill": 16384, "decode1": 1, "decode8": 8, "decode64": 64, "decode256": 256}
SMOKE_CASES = {"prefill": 16, "decode1": 1, "decode8": 8}


def bytes_moved(op: OpSpec, tokens: int, dims: Dims) -> int:
    """Fewest bytes a call moves: each input read once, each output written once, and the
    table rows the positions select (:func:`table_bytes`); positions and slots not counted (16
    bytes a token). ``e``: the activation dtype's bytes.

    - append, concat / split: read ``kv_c`` and ``k_pe`` (``(L + R) * e``), write the entry
      (``(L + R)`` elements of the cache's dtype) per token;
    - append, fp8_656: read ``(L + R) * e``, write 656 bytes per token;
    - append, fp8_584: read ``(448 + R) * e``, write 584 bytes per token;
    - decode query: read ``q_nope`` and ``q_pe``, write ``[T, H, L + R]`` in the output dtype
      (``e`` or 1 byte) per token and head;
    - output: read ``o`` (``D * e``), write ``D`` codes and ``D / 128`` fp32 scales per token
      and head.
    """
    return _data_bytes(op, tokens, dims) + table_bytes(op, tokens, dims)


def table_bytes(op: OpSpec, tokens: int, dims: Dims) -> int:
    """The fp32 ``cos`` and ``sin`` rows of the distinct positions: the benchmark's positions
    are uniform over the table's ``P`` rows, ``P * (1 - (1 - 1/P) ** T)`` distinct ones
    expected (12,893 of 16,384 prefill tokens), each row read from memory once (do_bench flushes
    the L2 before each prefill call; decode rotates input sets past it). 512 bytes a row of the
    full tables, 256 of pair tables (at prefill 6.6 or 3.3 MB: a quarter to an eleventh of an
    append's data bytes, docs/perf_log.md v16); under a thousandth of the query's."""
    p = dims.positions
    rows = round(p * -math.expm1(tokens * math.log1p(-1.0 / p)))
    width = dims.rope // 2 if takes_pair_tables(op, dims) else dims.rope
    return rows * 2 * width * 4


def _data_bytes(op: OpSpec, tokens: int, dims: Dims) -> int:
    e = torch.empty((), dtype=dims.dtype).element_size()
    width = dims.latent + dims.rope
    if op.kind == "output":
        d = dims.head_dim
        return tokens * dims.heads * (d * e + d + d // 128 * 4)
    if op.kind == "append":
        if op.fmt == "fp8_656":
            return tokens * (width * e + 656)
        if op.fmt == "fp8_584":
            return tokens * ((dims.v4_latent + dims.rope) * e + 584)
        cache_e = torch.empty((), dtype=op.cache_dtype).element_size()
        return tokens * width * (e + cache_e)
    out_e = 1 if op.fp8_out else e
    return tokens * dims.heads * width * (e + out_e)


def fp8_cache(op: OpSpec) -> bool:
    return op.cache_dtype == torch.float8_e4m3fn


def takes_pair_tables(op: OpSpec, dims: Dims) -> bool:
    """Whether ours is given pair tables: ``dims.pair_tables``, for every op."""
    return dims.pair_tables
