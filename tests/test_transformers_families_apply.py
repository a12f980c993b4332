"""Applying and reverting by model, name, alias and all; what cannot be patched says why;
mistral_large4's trainable rope scale falls back in training; ``mlarope info`` lists the
families.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

pytest.importorskip("transformers")

import transformers

import mlarope
from mlarope.integrations import transformers as mt
from mlarope.integrations.transformers import _patch, _rotation
from tests import families_harness
from tests.families_harness import (
    NOT_PATCHED,
    PATCHED,
    REPORT,
    CallCounter,
    assert_fp32_close,
    assert_identical,
    run,
    tiny_model,
    token_ids,
)

# The harness's fixtures, found by pytest under these names: one intra-op thread for the tiny
# models, and every family unpatched after each test.
one_thread = families_harness.one_thread
unpatched_after = families_harness.unpatched_after


def test_apply_by_model_name_alias_and_all(device):
    module = importlib.import_module(_patch.family("glm4_moe_lite").module)
    original = {f.name: getattr(module, f.name) for f in REPORT["glm4_moe_lite"].functions}
    model = tiny_model(REPORT["glm4_moe_lite"], torch.float32, device)
    assert mt.apply_mlarope(model) == ("glm4_moe_lite",)
    assert mt.is_mlarope_applied("glm4_moe_lite")
    assert all(getattr(module, n).__wrapped__ is f for n, f in original.items())
    assert mt.apply_mlarope("glm4_moe_lite") == ("glm4_moe_lite",)  # idempotent
    mt.revert_mlarope(model)
    assert all(getattr(module, n) is f for n, f in original.items())

    # a config-only family and a text model type select the family whose code they run
    # (transformers 5.24; earlier releases have neither)
    if "sarvam_mla" in REPORT:
        assert mt.apply_mlarope("sarvam_mla") == ("deepseek_v3",)
        assert mt.is_mlarope_applied("deepseek_v3") and mt.is_mlarope_applied("sarvam_mla")
        mt.revert_mlarope("deepseek_v3")
        assert not mt.is_mlarope_applied("sarvam_mla")
    if "dots3_note" in REPORT:
        assert mt.apply_mlarope("dots3_note_text") == ("dots3_note",)
        mt.revert_mlarope("dots3_note")

    with mt.mlarope_patched(model):
        assert mt.is_mlarope_applied("glm4_moe_lite")
    assert not mt.is_mlarope_applied("glm4_moe_lite")
    with mt.mlarope_patched_all(include_off_by_default=True):
        assert all(mt.is_mlarope_applied(n) for n in PATCHED)
    assert not any(mt.is_mlarope_applied(n) for n in PATCHED)
    # By default *_all leave the families the measured run puts off (_measured.py).
    on = {n for n in PATCHED if REPORT[n].runs_on is None and not REPORT[n].off_by_default}
    with mt.mlarope_patched_all():
        assert {n for n in PATCHED if mt.is_mlarope_applied(n) and REPORT[n].runs_on is None} == on
    assert set(mt.apply_mlarope_to_all()) == on
    assert all(row.applied != bool(row.off_by_default)
               for row in mt.family_report() if row.status == "patched")  # fmt: skip
    mt.revert_mlarope_all()
    everything = {n for n in PATCHED if REPORT[n].runs_on is None}
    assert set(mt.apply_mlarope_to_all(include_off_by_default=True)) == everything
    mt.revert_mlarope_all()
    assert not any(row.applied for row in mt.family_report())
    assert set(mt.SUPPORTED_MODEL_TYPES) >= {"deepseek_v3", "glm4_moe_lite"}
    assert not {"glm5_next", "kimi_linear"} & set(mt.SUPPORTED_MODEL_TYPES)


def test_what_cannot_be_patched_says_why(device):
    for name in NOT_PATCHED:
        if REPORT[name].status == "nothing to patch":
            with pytest.raises(ValueError, match="nothing to patch: its MLA attention calls no"):
                mt.apply_mlarope(name)
            with pytest.raises(ValueError, match="nothing to patch"):
                mt.apply_mlarope(tiny_model(REPORT[name], torch.float32, device))
    with pytest.raises(ValueError, match=r"must name an MLA family.*got 'llama'"):
        mt.apply_mlarope("llama")
    with pytest.raises(ValueError, match="must name an MLA family"):
        mt.mlarope_patched("llama")
    names = r"must be a family name or model type \(a str such as 'deepseek_v3'.*\) or a torch"
    for what, select in (("target", mt.apply_mlarope), ("target", mt.revert_mlarope),
                         ("model_type", mt.mlarope_patched)):  # fmt: skip
        with pytest.raises(TypeError, match=rf"{what} {names}\.nn\.Module.*, got int"):
            select(3)
    with pytest.raises(TypeError, match="pass the model once"):
        mt.mlarope_patched(torch.nn.Linear(2, 2), model=torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="has no MLA attention layer"):
        mt.apply_mlarope(torch.nn.Linear(2, 2))
    wide = tiny_model(REPORT["minicpm3"], torch.float32, device)
    for layer in wide.modules():
        if hasattr(layer, "qk_rope_head_dim"):
            layer.qk_rope_head_dim = 48
    with pytest.raises(ValueError, match="qk_rope_head_dim is 48"):
        mt.apply_mlarope(wide)
    with pytest.raises(ValueError, match="has no DeepseekV3Attention layer"):
        mt.apply_mlarope_to_deepseek_v3(model=wide)
    assert not any(row.applied for row in mt.family_report())


@pytest.mark.skipif("mistral_large4" not in REPORT, reason="no mistral_large4 in this transformers")
def test_mistral_large4_learnable_alpha_falls_back_in_training(device, monkeypatch):
    """With its learnable rope scale trainable, mistral_large4's tables require grad: the
    attention's rotation runs transformers' own function (mlarope does not differentiate tables)
    and alpha gets its gradient; the DSA indexer, which runs without grad, goes through mlarope.
    Without grad (inference) every rotation goes through mlarope."""
    family = "mistral_large4"
    model = tiny_model(REPORT[family], torch.float32, device)
    alpha = model.rotary_emb.alpha
    alpha.requires_grad_(True)
    ids = token_ids(8, device)
    counter = CallCounter(monkeypatch, family)
    unpatched = counter.expected(lambda: run(model, ids))
    with mt.mlarope_patched(family):
        counter.mlarope = 0
        patched = run(model, ids)
        in_training = counter.mlarope
        counter.mlarope = 0
        with torch.no_grad():
            model(input_ids=ids)
        assert counter.mlarope == counter.rotated
    assert 0 < in_training < counter.rotated  # the indexers only
    assert float(unpatched["rotary_emb.alpha"].abs().max()) > 0
    if torch.device(device).type == "cpu":
        assert_identical(patched, unpatched, "mistral_large4 with a trainable alpha")
    else:
        truth = run(copy.deepcopy(model).double(), ids)
        assert_fp32_close(patched, unpatched, truth, "mistral_large4 with a trainable alpha")


def test_rope_widths_match_the_library():
    from mlarope._checks import ROPE_DIMS

    assert _rotation.ROPE_DIMS == ROPE_DIMS == mlarope.SUPPORTED_ROPE_DIMS


def test_info_lists_the_families(capsys, monkeypatch, tmp_path):
    """``mlarope info``: every family, patched or not and why; the second run reads the
    on-disk copy (no modeling module needed) and prints the same."""
    from mlarope.tools import cli

    monkeypatch.setenv("MLAROPE_CACHE_DIR", str(tmp_path))
    assert cli.main(["info"]) == 0
    first = capsys.readouterr().out
    assert list(tmp_path.glob("transformers-families-*.json"))
    assert cli.main(["info"]) == 0
    assert capsys.readouterr().out == first
    assert f"transformers {transformers.__version__}: MLA families" in first
    for name, row in REPORT.items():
        line = next(line for line in first.splitlines() if line.startswith(name + " "))
        assert row.status in line, line
    assert "glm5_next" in first and "nothing to patch" in first
