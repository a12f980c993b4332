"""Compile the kernels for an H100/H200 (sm_90a) without a GPU and report what the compiler made.

``python benchmarks/kernel_report.py`` prints, per kernel at DeepSeek-V3 shapes: registers per
thread and spill bytes (from ``ptxas -v``), shared memory, and the memory instruction mix of
the PTX (global loads and stores, how many are 16-byte vectors, barriers, shared-memory
stores, 64-bit divisions). Pointers and the strides that a real launch sees as multiples of 16
are marked so, as Triton's launcher specializes them, so the code is the code that runs.

It needs Triton's bundled ``ptxas`` (part of the triton wheel on x86-64 Linux), not a GPU.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mlarope.kernels.kv import (
    _rope_kv_bwd_kernel,
    _rope_kv_fwd_kernel,
    choose_kv_backward_config,
    choose_kv_config,
)
from mlarope.kernels.lookup import SEARCH_BLOCK, SEARCH_WARPS, _cu_seqlens_search_kernel
from mlarope.kernels.q import _rope_q_kernel, choose_q_config

PATTERNS = {
    "ld.global": r"ld\.global",
    "ld.global.v4": r"ld\.global\S*\.v4",
    "st.global": r"st\.global",
    "st.global.v4": r"st\.global\S*\.v4",
    "bar.sync": r"\bbar\.sync|\bbarrier\.sync",
    "st.shared": r"st\.shared",
    "div/rem.64": r"(div|rem)\.[su]64",
}


@dataclass
class KernelReport:
    name: str
    num_warps: int
    registers: int
    spill_bytes: int
    shared_bytes: int
    counts: dict


def _ptxas() -> str:
    """The ptxas Triton itself runs for sm_90a: from 3.9 on that is the newer ``ptxas-blackwell``
    (Triton 3.9 writes PTX 9.4, which the older ``ptxas`` it also bundles rejects)."""
    from triton.backends.nvidia.compiler import get_ptxas

    path = get_ptxas(90).path
    if not path or not os.path.exists(path):
        raise FileNotFoundError(f"Triton's sm_90a ptxas is not at {path}")
    return path


def compile_report(
    fn, pointer_types: dict, constexprs: dict, num_warps: int, name: str, *,
    scalar_types: dict | None = None, patterns: dict = PATTERNS,
):  # fmt: skip
    """Compile ``fn`` for sm_90a with the given pointer dtypes and constexprs -> KernelReport
    (``scalar_types``: non-i32 scalar arguments, not marked aligned; ``patterns``: the PTX
    lines counted, by name)."""
    signature = {
        arg: "constexpr" if arg in constexprs else pointer_types.get(arg, "i32")
        for arg in fn.arg_names
    }
    signature.update(scalar_types or {})
    aligned = [
        i
        for i, arg in enumerate(fn.arg_names)
        if arg in pointer_types
        or (arg.startswith("stride") and not arg.startswith("stride_id"))
        or arg in ("n_nope", "k_dim", "v_dim")
    ]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}
    )
    ptx = kernel.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path = os.path.join(tmp, "k.ptx")
        with open(ptx_path, "w") as f:
            f.write(ptx)
        log = subprocess.run(
            [_ptxas(), "-v", "-arch=sm_90a", ptx_path, "-o", os.path.join(tmp, "k.cubin")],
            capture_output=True, text=True, check=True,
        ).stderr  # fmt: skip
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    spill = re.search(r"(\d+) bytes spill stores", log)
    lines = ptx.splitlines()
    counts = {k: sum(1 for line in lines if re.search(p, line)) for k, p in patterns.items()}
    return KernelReport(
        name, num_warps, registers, int(spill.group(1)) if spill else 0,
        kernel.metadata.shared, counts,
    )  # fmt: skip


def deepseek_v3_reports() -> list[KernelReport]:
    """The kernels with the launch configuration the heuristics pick at DeepSeek-V3 shapes
    (H = 128, N = 128, R = 64, K = V = 128, bf16, fp32 tables)."""
    # ids_ptr: the int64 positions the cu_seqlens search kernel writes (thd rows).
    tables = {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "ids_ptr": "*i64"}
    reports = []
    q_ptrs = {"x_ptr": "*bf16", "out_ptr": "*bf16", **tables}
    for mode, label in ((0, "sbhd"), (2, "thd cu_seqlens")):
        for inplace in (True, False):
            qc = choose_q_config(16384, 128, 128, 64, inplace)
            consts = dict(
                POS_MODE=mode, HALF=32, BLOCK_T=qc.block_t, BLOCK_H=qc.block_h,
                BLOCK_N=qc.block_n, INTERLEAVED_IN=True, INTERLEAVED_OUT=False, INVERSE=False,
                TRANSPOSE=False, IN_PLACE=inplace,
            )  # fmt: skip
            name = f"q {'in place' if inplace else 'out of place'}, {label}"
            reports.append(compile_report(_rope_q_kernel, q_ptrs, consts, qc.num_warps, name))
    kc = choose_kv_config(16384, 128, 128)
    kv_ptrs = {"kv_ptr": "*bf16", "kpe_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", **tables}
    for copy_v in (True, False):
        consts = dict(
            POS_MODE=0, HALF=32, BLOCK_T=kc.block_t, BLOCK_H=kc.block_h, BLOCK_C=kc.block_c,
            INTERLEAVED_IN=True, INTERLEAVED_OUT=False, COPY_V=copy_v,
        )  # fmt: skip
        name = "kv fwd" if copy_v else "kv fwd, no copy_v"
        reports.append(compile_report(_rope_kv_fwd_kernel, kv_ptrs, consts, kc.num_warps, name))
    bc = choose_kv_backward_config(16384, 128, 128, 64)
    bwd_ptrs = {
        "dk_ptr": "*bf16",
        "dv_ptr": "*bf16",
        "dkv_ptr": "*bf16",
        "dpe_ptr": "*bf16",
        **tables,
    }
    consts = dict(
        POS_MODE=0, HALF=32, BLOCK_T=bc.block_t, BLOCK_H=bc.block_h, BLOCK_C=bc.block_c,
        HEADS_PADDED=128, INTERLEAVED_IN=True, INTERLEAVED_OUT=False,
    )  # fmt: skip
    reports.append(compile_report(_rope_kv_bwd_kernel, bwd_ptrs, consts, bc.num_warps, "kv bwd"))
    reports.append(
        compile_report(
            _cu_seqlens_search_kernel, {"cu_ptr": "*i32", "out_ptr": "*i64"},
            {"BLOCK": SEARCH_BLOCK}, SEARCH_WARPS, "thd positions (cu_seqlens search)",
        )
    )  # fmt: skip
    return reports


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/kernel_report.py``: print the report as a Markdown table."""
    parser = argparse.ArgumentParser(
        prog="python benchmarks/kernel_report.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.parse_args(argv)
    print(
        "| kernel | warps | registers | spill bytes | shared bytes | " + " | ".join(PATTERNS) + " |"
    )
    print("|---" * (5 + len(PATTERNS)) + "|")
    for r in deepseek_v3_reports():
        cells = [r.name, r.num_warps, r.registers, r.spill_bytes, r.shared_bytes]
        cells += [r.counts[k] for k in PATTERNS]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
