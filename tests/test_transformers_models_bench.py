"""``benchmarks/transformers_models.py``'s CPU smoke: two families' two-layer models build, run
their training step unpatched and patched, and report every table (small widths, the PyTorch
reference backend: the kernels under Triton's interpreter would take minutes a family). The
timings mean nothing here; the structure, the patch reaching mlarope, and the categories
summing to the total do.

The families are fixed, two that ``apply_mlarope_to_all()`` patches by default under
transformers 5.25 (the measured record in ``_measured.py``; docs/transformers.md, "Worth it"):
``longcat_flash`` (one decoder layer of two MLA sublayers, MoE with zero experts) and
``deepseek_v3`` (a dense and an MoE layer). (``glm_moe_dsa``, the other one before, is off by
default since that record: its patched step would rotate nothing.)"""

from __future__ import annotations

import collections
import json
import types

import pytest
import torch

pytest.importorskip("transformers")

from benchmarks import step_profile, transformers_models

FAMILIES = ("longcat_flash", "deepseek_v3")


@pytest.mark.cpu
def test_two_families_run_on_the_cpu(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # read per call: the reference backend
    out, data = tmp_path / "models.md", tmp_path / "models.json"
    argv = ["--device", "cpu", "--tiny", "--seq", "16", "--families", ",".join(FAMILIES),
            "--iters", "1", "--rounds", "1", "--warmup", "0", "--host-iters", "1",
            "--out", str(out), "--json", str(data)]  # fmt: skip
    status = transformers_models.main(argv)
    printed = capsys.readouterr().out
    table = out.read_text()
    assert status == 0, printed
    assert "FAILED" not in table
    assert table in printed + "\n"
    assert "python -m benchmarks.transformers_models --device cpu --tiny" in table
    rows = json.loads(data.read_text())["rows"]
    assert {(r["family"], r["variant"]) for r in rows} == {
        (f, v) for f in FAMILIES for v in ("unpatched", "patched")
    }
    for r in rows:
        # the patch reaches mlarope in the patched step only
        assert (r["rotations"] > 0) == (r["variant"] == "patched"), r
        assert r["verdict"] == ("baseline" if r["variant"] == "unpatched" else r["verdict"])
        cells = _profile_cells(table, r)
        assert len(cells) == 1 + len(step_profile.CATEGORIES), cells
        total, parts = cells[0], cells[1:]
        # each cell is rounded to 0.01 ms: the sum is within half a unit per cell
        assert abs(sum(parts) - total) <= 0.005 * len(cells) + 1e-9, cells
        assert total > 0 and min(parts) >= 0
        assert parts[step_profile.CATEGORIES.index("GEMM")] > 0
        assert parts[step_profile.CATEGORIES.index("RoPE")] > 0
        assert parts[step_profile.CATEGORIES.index("norms")] > 0
    for family in FAMILIES:
        model = next(line for line in table.splitlines() if f"({family}) | MLA" in line)
        assert "8, top" in model, model


def _profile_cells(table: str, row: dict) -> list[float]:
    """The category table's numbers for ``row`` (its family, sequence and variant)."""
    for line in table.split("time of one profiled step by category")[1].splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) > 3 and f"({row['family']})" in cells[0] and cells[2] == row["variant"]:
            return [float(c) for c in cells[3:]]
    raise AssertionError(f"no category row for {row['family']} {row['variant']}")


def test_kernel_names_fall_in_their_categories():
    rope = step_profile.mlarope_kernel_names()
    assert {"_rope_q_kernel", "_rope_kv_fwd_kernel", "_rope_kv_bwd_kernel"} <= rope
    cases = {
        "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNN": "GEMM",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "GEMM",
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn>": (
            "GEMM"
        ),
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<192, 128, 64, 4>>": (
            "attention"
        ),
        "fmha_cutlassB_bf16_aligned_64x64_k128_sm80": "attention",
        "_rope_q_kernel": "RoPE",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous "
        "namespace)::OpaqueType<2u>, unsigned int, 4, 64, 64>": "copies & cat",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda"
        "(at::TensorIteratorBase&)::{lambda()#3}>": "copies & cat",
        "void at::native::index_elementwise_kernel<128, 4>": "copies & cat",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": (
            "copies & cat"
        ),
        "Memcpy DtoD (Device -> Device)": "copies & cat",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add"
        "<c10::BFloat16>>": "other elementwise",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::"
        "func_wrapper_t<float, at::native::sum_functor<float, float, float>>, unsigned int, "
        "float, 4>>": "other",
        "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>": "other",
    }
    for name, category in cases.items():
        assert step_profile.kernel_category(name, None, rope) == category, name
    # A scope decides for kernels whose name does not: transformers' RMSNorm's multiply.
    mul = "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float>>"
    assert step_profile.kernel_category(mul, "norm", rope) == "norms"
    assert step_profile.kernel_category(mul, "rope", rope) == "RoPE"
    assert step_profile.kernel_category("nvjet_tst_x", "norm", rope) == "GEMM"


def _events(linked: bool) -> list:
    """A profile's events as torch.profiler gives them, on CUDA: a norm's forward multiply and
    its backward, an add and its backward's copy outside the scopes, a GEMM, the scope's own
    device-side span, and a CUDA runtime event whose id collides with an op's."""
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    Kernel = collections.namedtuple("Kernel", ["name", "device", "duration"])

    def event(name, eid, *, device=cpu, parent=None, seq=-1, start=0.0, us=0.0, link=0, **kw):
        span = types.SimpleNamespace(start=start, elapsed_us=lambda: us)
        fields = dict(name=name, id=eid, device_type=device, cpu_parent=parent, sequence_nr=seq,
                      time_range=span, kernels=[], is_user_annotation=False,
                      self_cpu_time_total=0.0, **kw)  # fmt: skip
        if linked or device == cpu:
            fields["linked_correlation_id"] = link
        return types.SimpleNamespace(**fields)

    norm = event(step_profile.SCOPE + "norm", 1, start=0.5)
    mul = event("aten::mul", 2, parent=norm, seq=5, start=1.0)
    add = event("aten::add", 3, seq=6, start=2.0)
    mm = event("aten::mm", 4, seq=7, start=3.0)
    mul_node = event("autograd::engine::evaluate_function: MulBackward0", 10, seq=5, start=4.0)
    mul_bwd = event("aten::mul", 11, parent=mul_node, start=4.1)
    add_node = event("autograd::engine::evaluate_function: AddBackward0", 12, seq=6, start=5.0)
    copy = event("aten::copy_", 13, parent=add_node, start=5.1)
    runtime = event("cudaLaunchKernel", 2, link=4)  # a runtime event: its id is CUPTI's
    elementwise = "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor>"
    kernels = [
        (elementwise, 10.0, mul),
        (elementwise, 20.0, add),
        ("nvjet_tst_128x256_64x4_2x1_v_bz_TNN", 30.0, mm),
        (elementwise, 40.0, mul_bwd),
        ("void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>", 5.0, copy),
    ]
    device = [event(n, 100 + i, device=cuda, us=us, link=op.id) for i, (n, us, op) in
              enumerate(kernels)]  # fmt: skip
    for name, us, op in kernels:
        op.kernels.append(Kernel(name, 0, us))
    span = event(step_profile.SCOPE + "norm", 200, device=cuda, us=99.0, link=1)
    span.is_user_annotation = True
    unlisted = [] if linked else [event("_rope_q_kernel", 300, device=cuda, us=7.0)]
    cpu_events = [norm, mul, add, mm, mul_node, mul_bwd, add_node, copy, runtime]
    return cpu_events + device + [span] + unlisted


@pytest.mark.parametrize("linked", [True, False], ids=["linked ids", "kernels of each op"])
def test_device_time_goes_to_the_scope_of_its_forward(linked):
    """The CUDA path on fake events: a backward kernel belongs to the norm whose forward op made
    its autograd node; what no op launched still counts (torch without linked ids)."""
    prof = types.SimpleNamespace(events=lambda: _events(linked))
    rope = step_profile.mlarope_kernel_names()
    got = step_profile.categorize(prof, torch.device("cuda"), rope, top=10)
    want = dict.fromkeys(step_profile.CATEGORIES, 0.0)
    want.update({"norms": 0.05, "other elementwise": 0.02, "GEMM": 0.03, "copies & cat": 0.005})
    if not linked:
        want["other"] = 0.007  # the unlisted kernel: no op, no name to go by
    assert {k: round(got[k], 9) for k in step_profile.CATEGORIES} == want
    assert got["total"] == pytest.approx(sum(want.values()))
