"""Compile the serving kernels for an H100/H200 (sm_90a) without a GPU and report what the
compiler made.

``python benchmarks/serving_kernel_report.py`` prints, per serving kernel at DeepSeek-V3 shapes
(the fp8_584 append and the attention output at DeepSeek-V4's) with the prefill batch's launch
configuration: registers and spill bytes (``ptxas -v``) and the instructions that matter
(hardware FP8 and bf16 conversions, IEEE vs approximate division, 16-byte vector copies, 64-bit
divisions, rounded multiplications and fused multiply-adds). ``tests/test_serving_compiled.py``
runs it on every lane. It compiles as ``kernel_report.py`` does: Triton's bundled ``ptxas``, no GPU.
"""

from __future__ import annotations

import argparse

from kernel_report import compile_report  # benchmarks/kernel_report.py (this script's folder)
from mlarope.kernels import output_quant
from mlarope.kernels import serving as kernels

REPORT_PATTERNS = {
    "st.global": r"st\.global",
    "st.global.v4": r"st\.global\S*\.v4",
    "ld.global.v4": r"ld\.global\S*\.v4",
    "cvt e4m3": r"cvt\.rn\.satfinite\.e4m3x2\.f32",
    "cvt bf16": r"cvt\.rn\.bf16(x2)?\.f32",
    "div.rn": r"div\.rn\.f32",
    "div approx": r"div\.(full|approx)\.f32",
    "div/rem.64": r"(div|rem)\.[su]64",
    "mul.rn": r"mul\.rn\.f32",
    "fma.f32": r"fma\.rn\.f32",
}


def kernel_report() -> list[dict]:
    """Compile the serving kernels for sm_90a at DeepSeek-V3 shapes, with the prefill batch's
    launch configuration and the argument alignment a real launch specializes on (pointers and
    strides multiples of 16), and read registers and spills (``ptxas -v``) and instruction
    counts (the PTX): FP8 through the hardware conversion, per-tensor scales through IEEE
    division, 16-byte vector stores of the copies. Needs Triton's bundled ptxas, not a GPU."""

    def compile_one(name, fn, pointers, constexprs, num_warps) -> dict:
        scalars = {"scale_value": "fp32"} if "scale_value" in fn.arg_names else {}
        r = compile_report(
            fn, pointers, constexprs, num_warps, name, scalar_types=scalars,
            patterns=REPORT_PATTERNS,
        )  # fmt: skip
        row = {"kernel": name, "warps": num_warps, "registers": r.registers}
        return {**row, "spill bytes": r.spill_bytes, **r.counts}

    tables = {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64", "scale_ptr": "*fp32"}
    rows = []
    # (name, NOPE_MODE, ROPE_MODE, kv_c, destination, tiles, ROPE_OFFSET, TILE_OFFSET, L,
    # PAIR_TABLE); fp8_584 at DeepSeek-V4's shapes (L = 448) and FlashMLA's block size of 64.
    for name, nope_mode, rope_mode, kvc, dst, tiles, rope_at, tile_at, latent, pair in (
        ("append concat bf16", 0, 5, "*i16", "*i16", "*i32", 512, 0, 512, False),
        ("append concat bf16, pair tables", 0, 5, "*i16", "*i16", "*i32", 512, 0, 512, True),
        ("append concat fp8", 1, 1, "*bf16", "*u8", "*i32", 512, 0, 512, False),
        ("append fp8_656", 2, 5, "*bf16", "*u8", "*i32", 264, 128, 512, False),
        ("append fp8_584", 6, 5, "*bf16", "*u8", "*u8", 224, 64 * 576, 448, False),
    ):
        ac = kernels.choose_append_config(16384, latent)
        pointers = dict(
            tables, slot_ptr="*i64", kvc_ptr=kvc, kpe_ptr="*bf16", nope_ptr=dst,
            rope_ptr="*i16" if nope_mode in (2, 6) else dst, tile_ptr=tiles,
        )  # fmt: skip
        constexprs = dict(
            ROPE_OFFSET=rope_at, TILE_OFFSET=tile_at, BLOCK_SHIFT=6, L=latent, BLOCK_L=512,
            HALF=32, PAIR_TABLE=pair, BLOCK_T=ac.block_t, NOPE_MODE=nope_mode,
            ROPE_MODE=rope_mode, SCALE_MODE=2 if nope_mode == 1 else 0, INTERLEAVED_IN=True,
            INTERLEAVED_OUT=True, NATIVE=1,
        )  # fmt: skip
        rows.append(compile_one(name, kernels._rope_append_kernel, pointers, constexprs,
                                ac.num_warps))  # fmt: skip
    qc = kernels.choose_query_config(16384, 128, 512)
    for name, nope_mode, rope_mode, qn, out in (
        ("query bf16", 0, 5, "*i16", "*i16"),
        ("query fp8", 1, 1, "*bf16", "*u8"),
    ):
        pointers = dict(tables, qn_ptr=qn, qp_ptr="*bf16", out_ptr=out)
        constexprs = dict(
            L=512, HALF=32, PAIR_TABLE=False, BLOCK_T=qc.block_t, BLOCK_H=qc.block_h,
            BLOCK_C=qc.block_c, NOPE_MODE=nope_mode, ROPE_MODE=rope_mode,
            SCALE_MODE=2 if nope_mode else 0, INTERLEAVED_IN=True, INTERLEAVED_OUT=True,
            NATIVE=1,
        )  # fmt: skip
        rows.append(compile_one(name, kernels._rope_decode_query_kernel, pointers, constexprs,
                                qc.num_warps))  # fmt: skip
    # The attention output at DeepSeek-V4-Pro's prefill shape (128 heads of 512, 16 groups).
    oc = output_quant.choose_output_config(16384, 128)
    for name, scale_ptr, pack, fmt, whole_row, pair in (
        ("output fp8, fp32 scales", "*i32", 1, output_quant.SCALE_FP32, False, False),
        ("output fp8, fp32 scales, pair tables", "*i32", 1, output_quant.SCALE_FP32, False, True),
        ("output fp8, packed ue8m0", "*i32", 4, output_quant.SCALE_E8M0, False, False),
        ("output fp8, fp32 scales, whole row", "*i32", 1, output_quant.SCALE_FP32, True, False),
    ):
        pointers = dict(tables, o_ptr="*bf16", out_ptr="*u8", scale_ptr=scale_ptr)
        constexprs = dict(
            D=512, HALF=32, PAIR_TABLE=pair, HEADS_PER_GROUP=8, BLOCK_T=oc.block_t,
            BLOCK_H=oc.block_h, PACK=pack, SCALE_FMT=fmt, INTERLEAVED_IN=True,
            INTERLEAVED_OUT=True, NATIVE=1, WHOLE_ROW=whole_row,
        )  # fmt: skip
        rows.append(compile_one(name, output_quant._rope_inverse_quant_kernel, pointers,
                                constexprs, oc.num_warps))  # fmt: skip
    return rows


def _report_table(rows: list[dict]) -> str:
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    lines += ["| " + " | ".join(str(r[h]) for h in header) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/serving_kernel_report.py``: print the report as a Markdown table."""
    parser = argparse.ArgumentParser(
        prog="python benchmarks/serving_kernel_report.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.parse_args(argv)
    print(_report_table(kernel_report()))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
