"""The serving benchmark's sweeps: the prefill batch under other launch configurations (and the
integer FP8 encoder), and the decode query's configurations at each decode batch."""

from __future__ import annotations

import dataclasses

import torch

from ..cases import rotation_sets
from ..timers import CudaTimer, Timing
from .inputs import make_inputs, rope_tables
from .model import OPS_BY_KEY, bytes_moved, fp8_cache, table_bytes, takes_pair_tables


def run_sweep(
    op_keys, tokens, dims, device, gen, cos, sin, timer, copy_tbps, limit: int | None = None
) -> list[dict]:
    """The prefill batch under other launch configurations (the first ``limit`` of them), and
    FP8 with the integer encoder (``kernels.serving.NATIVE_CASTS = False``): kernel time and %
    of copy. Each launch is captured in a CUDA graph and its replays timed by ``do_bench``, the
    L2 flushed before each: a launch through Triton's own binder, as here, can take longer on
    the host than the flush on the GPU, and was then timed with its host time (the split FP8
    append: 24-36 us in the sweep, 17.8 in the main table; perf_log v16). The appends also run with
    every position 0 (one table row, which stays in the L2: what the table rows cost) and with
    the other tables (full or pair)."""
    from mlarope.kernels import output_quant
    from mlarope.kernels import serving as kernels
    from mlarope.serving import checks, ops

    results = []
    for key in op_keys:
        op = OPS_BY_KEY[key]
        inp = make_inputs(op, tokens, dims, device, gen, prefill=True)
        nbytes = bytes_moved(op, tokens, dims)
        extra = []  # (label, launch, bytes): the heuristic's launch on other inputs
        if op.kind == "output":
            # The whole-row variant first (perf_log v14: every load before the first store;
            # 16 to 64 elements a thread of the row), then 1 to 16 heads a program, 4 to 32
            # elements a thread of one 128-channel block
            configs = [
                output_quant.OutputConfig(1, bh, w, whole_row=True)
                for bh in (16, 8, 4)
                for w in (8, 4)
                if 16 <= bh * dims.head_dim // (32 * w) <= 64
            ] + [
                output_quant.OutputConfig(bt, bh, w)
                for bt in (2, 1)
                for bh in (16, 8, 4, 2, 1)
                for w in (8, 4, 2, 1)
                if 4 <= bt * bh * 128 // (32 * w) <= 32
            ]
            out = torch.empty(tokens, inp.groups, dims.heads // inp.groups * dims.head_dim,
                              dtype=torch.uint8, device=device)  # fmt: skip
            scale_out = torch.empty(*out.shape[:2], out.shape[2] // 128, device=device)

            def launch(config, inp=inp, out=out, scale_out=scale_out, op=op):
                ops.output_with_kernel(
                    inp.o, *rope_tables(op, dims, cos, sin), inp.positions, out, scale_out,
                    inp.groups, True, True, takes_pair_tables(op, dims), config=config,
                )  # fmt: skip
        elif op.kind == "append":
            scale = inp.scale if fp8_cache(op) else None

            def checked(tables, positions, pair, inp=inp, scale=scale, op=op):
                return checks.check_append_call(
                    inp.kv_c, inp.k_pe, *tables, positions, inp.cache, inp.slots, op.fmt,
                    scale, True, True, pair,
                )  # fmt: skip

            flipped = dataclasses.replace(dims, pair_tables=not dims.pair_tables)
            tables, other = rope_tables(op, dims, cos, sin), rope_tables(op, flipped, cos, sin)
            call = checked(tables, inp.positions, dims.pair_tables)
            # 8 to 32 latent elements a thread, 1 to 16 tokens a program
            configs = [
                kernels.AppendConfig(bt, w)
                for bt in (1, 2, 4, 8, 16)
                for w in (1, 2, 4, 8)
                if bt * dims.latent // (32 * w) in (8, 16, 32)
            ]

            def launch(config, call=call):
                ops.append_with_kernel(*call.op_args(), config=config)

            # their own bytes: one table row; the other tables' rows
            one_row = nbytes - table_bytes(op, tokens, dims) + table_bytes(op, 1, dims)
            for label, c, n in (
                (
                    "heuristic, every position 0",
                    checked(tables, torch.zeros_like(inp.positions), dims.pair_tables), one_row,
                ),
                (
                    f"heuristic, {'full' if dims.pair_tables else 'pair'} tables",
                    checked(other, inp.positions, not dims.pair_tables),
                    bytes_moved(op, tokens, flipped),
                ),
            ):  # fmt: skip
                extra.append((label, lambda c=c: ops.append_with_kernel(*c.op_args()), n))
        else:
            dtype = torch.float8_e4m3fn if op.fp8_out else dims.dtype
            out = torch.empty(tokens, dims.heads, dims.latent + dims.rope, dtype=dtype,
                              device=device)  # fmt: skip
            # 16 or 32 elements a thread per copy step
            configs = [
                kernels.QueryConfig(1, bh, bc, w)
                for bh in (1, 2, 4, 8, 16, 32)
                for bc in (128, 256, 512)
                for w in (1, 2, 4, 8)
                if bh * bc // (32 * w) in (16, 32)
            ]

            def launch(config, inp=inp, out=out, op=op):
                query_launch(op, inp, out, *rope_tables(op, dims, cos, sin), config)

        variants = [(str(c), c, True) for c in configs[:limit]]
        if op.fp8_out or fp8_cache(op) or op.fmt in ("fp8_656", "fp8_584"):
            variants.append(("heuristic, integer e4m3 encoder", None, False))
        variants.insert(0, ("heuristic", None, True))
        runs = [
            (label, native, lambda c=config: launch(c), nbytes)
            for label, config, native in variants
        ]
        runs += [(label, True, fn, n) for label, fn, n in extra]
        for label, native, fn, n in runs:
            kernels.NATIVE_CASTS = native
            try:
                t: Timing = timer.large_graphed(fn)
                pct = 100.0 * n / (t.median * 1e-3) / 1e12 / copy_tbps
                results.append({"op": key, "variant": label, "ms": t.median, "pct_copy": pct})
            except Exception as exc:
                results.append({"op": key, "variant": label, "error": str(exc)[:200]})
            finally:
                kernels.NATIVE_CASTS = True
        del inp
    return results


def query_launch(op, inp, out, cos, sin, config, float_scale: float | None = None) -> None:
    """The decode query kernel on ``inp`` into ``out`` under ``config`` (the sweeps' launch);
    ``float_scale``: FP8's scale as a Python float (FlashInfer's form; read from the tensor
    before any capture, which a read would break), not the tensor."""
    from mlarope.serving import ops

    scale = inp.scale if op.fp8_out and float_scale is None else None
    value = 1.0 if float_scale is None else float_scale
    ops.query_with_kernel(
        inp.q_nope, inp.q_pe, cos, sin, inp.positions, out, scale, value, True, True,
        config=config,
    )  # fmt: skip


def run_decode_sweep(
    op_keys, case: str, tokens: int, dims, device, gen, cos, sin, timer, limit: int | None = None
) -> list[dict]:
    """The decode query at a decode batch under other launch configurations (the first
    ``limit`` of them): one token a program, 1 to 16 heads, 128 to 512 latent channels a step,
    1 to 4 warps; timed by CUDA-graph replays over rotated input sets, as the main table times
    decode, but with an output buffer per input set where the main table's call allocates its
    own, so compare the rows with each other, not with the main table. Ops that write into a
    caller's buffer are left out (they would time the same launches). Rows: ``op``, ``variant``
    (``case: config``), ``ms``; ``pct_copy`` None."""
    from mlarope.kernels import serving as kernels

    configs = [
        kernels.QueryConfig(1, bh, bc, w)
        for bc in (512, 256, 128)
        for bh in (1, 2, 4, 8, 16)
        for w in (1, 2, 4)
        if 8 <= bh * bc // (32 * w) <= 32
    ]
    results = []
    for key in op_keys:
        op = OPS_BY_KEY[key]
        if op.out_given:
            continue
        use_graph = isinstance(timer, CudaTimer)
        nbytes = bytes_moved(op, tokens, dims)
        sets = rotation_sets(nbytes, timer.l2_bytes, timer.max_graph_calls) if use_graph else 1
        inputs = [make_inputs(op, tokens, dims, device, gen, False) for _ in range(sets)]
        dtype = torch.float8_e4m3fn if op.fp8_out else dims.dtype
        outs = [torch.empty(tokens, dims.heads, dims.latent + dims.rope, dtype=dtype,
                            device=device) for _ in inputs]  # fmt: skip

        tables = rope_tables(op, dims, cos, sin)
        values = [float(inp.scale) for inp in inputs]

        def calls(
            config, inputs=inputs, outs=outs, op=op, tables=tables, values=values,
            float_scale=False,
        ):  # fmt: skip
            return [
                lambda inp=inp, out=out, v=v: query_launch(
                    op, inp, out, *tables, config, v if float_scale else None
                )
                for inp, out, v in zip(inputs, outs, values, strict=True)
            ]

        variants = [("heuristic", None), *((str(c), c) for c in configs[:limit])]
        if op.fp8_out:
            # FlashInfer's forms: the scale a float, which arrives with the launch; and, on top,
            # x * (1 / s) for x / s (RECIPROCAL_QUOTIENT: inexact near ties, measurement only)
            variants[1:1] = [("heuristic, float scale", "float"),
                             ("heuristic, float scale, x * (1 / s)", "reciprocal")]  # fmt: skip
        for label, config in variants:
            kernels.RECIPROCAL_QUOTIENT = config == "reciprocal"
            try:
                fns = (
                    calls(None, float_scale=True) if config in ("float", "reciprocal")
                    else calls(config)
                )  # fmt: skip
                t: Timing = timer.graph(fns) if use_graph else timer.large(fns[0])
                results.append({"op": key, "variant": f"{case}: {label}", "ms": t.median,
                                "pct_copy": None})  # fmt: skip
            except Exception as exc:
                results.append({"op": key, "variant": f"{case}: {label}", "error": str(exc)[:200]})
            finally:
                kernels.RECIPROCAL_QUOTIENT = False
        del inputs, outs
    return results
