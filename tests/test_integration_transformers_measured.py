"""Worth it: a family whose measured training step misses the target is off by default
(``_measured.py``): left out of ``*_all``, patched when named, its reason carrying the figures
and the run that measured it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import transformers

from mlarope.integrations import transformers as mt
from tests import deepseek_harness

# The harness's fixture, found by pytest under this name: transformers' own functions in place
# around every test.
unpatched = deepseek_harness.unpatched


def measured_steps(unpatched_4096, ours_4096, unpatched_128, ours_128):
    from mlarope.integrations.transformers import _measured

    return _measured.Measured(
        step_4096=(unpatched_4096, ours_4096), step_128=(unpatched_128, ours_128),
        rotary_4096=(0.30, 0.10),
    )  # fmt: skip


def test_a_family_measured_short_of_the_target_is_off_by_default(monkeypatch):
    """minicpm3 measured at 0.99x at sequence 4096 (target 0.98x): apply_mlarope_to_all and
    mlarope_patched_all leave it, family_report says why with the figures, and a request by
    name (or include_off_by_default) still patches it. deepseek_v3 measured within both targets
    stays on."""
    from mlarope.integrations.transformers import _measured

    monkeypatch.setattr(_measured, "MEASURED", {
        "minicpm3": measured_steps(10.0, 9.9, 4.0, 3.9),
        "deepseek_v3": measured_steps(10.0, 9.5, 4.0, 3.9),
    })  # fmt: skip
    rows = {r.name: r for r in mt.family_report()}
    off = rows["minicpm3"].off_by_default
    assert "0.990x at sequence 4096 (target <= 0.98x)" in off and "2.0%" in off
    assert rows["minicpm3"].status == "patched" and "off by default" in rows["minicpm3"].summary()
    assert rows["deepseek_v3"].off_by_default == ""
    assert rows["glm4_moe_lite"].off_by_default == "", "a family not measured is on"
    patched = mt.apply_mlarope_to_all()
    try:
        assert "minicpm3" not in patched and "deepseek_v3" in patched
        assert not mt.is_mlarope_applied("minicpm3")
        with mt.mlarope_patched_all():
            assert not mt.is_mlarope_applied("minicpm3")
        with mt.mlarope_patched_all(include_off_by_default=True):
            assert mt.is_mlarope_applied("minicpm3")
        assert mt.apply_mlarope("minicpm3") == ("minicpm3",)
        assert mt.is_mlarope_applied("minicpm3")
    finally:
        mt.revert_mlarope_all()
    assert "minicpm3" in mt.apply_mlarope_to_all(include_off_by_default=True)
    mt.revert_mlarope_all()


def test_the_recorded_measurements_name_known_families():
    """Every family of the recorded run is one the integration patches (transformers 5.24,
    the run's version), and each off family's reason carries its figures."""
    from mlarope.integrations.transformers import _measured

    report = {r.name: r for r in mt.family_report()}
    if transformers.__version__ not in _measured.RUN:
        pytest.skip(f"the run measured another transformers ({_measured.RUN})")
    for name, figures in _measured.MEASURED.items():
        assert report[name].status == "patched", name
        assert bool(figures.misses()) == bool(report[name].off_by_default), name


def test_the_off_by_default_reason_names_the_run_that_measured_the_family(monkeypatch):
    """DeepSeek-V4 was measured in a later run than the other families (docs/perf_log.md): a
    family's reason names its own run (it named the other families' run for every family;
    found by review)."""
    from mlarope.integrations.transformers import _measured

    slower = _measured.Measured(
        step_4096=(10.0, 10.5), step_128=(4.0, 4.2), rotary_4096=(1.0, 0.9), run="G5"
    )
    monkeypatch.setitem(_measured.MEASURED, "deepseek_v4", slower)
    assert "in run G5;" in _measured.off_by_default("deepseek_v4")
