"""Every MLA family of the installed transformers is one the integration knows: a test that fails
by the family's name when a transformers release adds an MLA model that discovery misses.

The check is independent of discovery's method (which reads modeling and configuration sources
with ``ast``): here every model type of transformers' auto configuration mapping is built with
its default configuration, and a configuration whose fields (its own or a sub-configuration's,
as in ``to_dict()``) hold a latent rank, ``kv_lora_rank`` or ``q_lora_rank``, is MLA. Each such
model type must be a name ``apply_mlarope`` takes: patched, or reported with its reason
(``family_report``). A configuration that cannot be built with its defaults is listed by the
second test, so the check never narrows without a word.
"""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("transformers")

import transformers

from mlarope.integrations import transformers as mt
from mlarope.integrations.transformers import _patch

MLA_FIELDS = ("kv_lora_rank", "q_lora_rank")
# Configurations that raise with their defaults in transformers 5.25 (their own validation),
# none of them MLA: a new one fails test_default_configurations_build.
UNBUILDABLE = {"gemma4_assistant", "nougat"}


def _has_latent_rank(fields: dict, depth: int = 0) -> bool:
    if any(fields.get(name) for name in MLA_FIELDS):
        return True
    return depth < 3 and any(
        isinstance(v, dict) and _has_latent_rank(v, depth + 1) for v in fields.values()
    )


def _scan() -> tuple[list[str], dict[str, str]]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    mla, unbuildable = [], {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()
        try:
            for model_type in sorted(CONFIG_MAPPING_NAMES):
                try:
                    fields = CONFIG_MAPPING[model_type]().to_dict()
                except Exception as e:  # the configuration's own validation of its defaults
                    unbuildable[model_type] = f"{type(e).__name__}: {str(e)[:120]}"
                    continue
                if _has_latent_rank(fields):
                    mla.append(model_type)
        finally:
            transformers.logging.set_verbosity(verbosity)
    return mla, unbuildable


MLA_MODEL_TYPES, UNBUILT = _scan()


def test_the_scan_finds_the_known_mla_configurations():
    """The scan itself works: DeepSeek-V3 and V2 are MLA, Llama is not."""
    assert {"deepseek_v3", "deepseek_v2"} <= set(MLA_MODEL_TYPES)
    assert "llama" not in MLA_MODEL_TYPES


def test_default_configurations_build():
    assert set(UNBUILT) <= UNBUILDABLE, (
        f"transformers {transformers.__version__}: default configurations that cannot be built, "
        f"so the MLA scan cannot see them: {UNBUILT}"
    )


@pytest.mark.parametrize("model_type", MLA_MODEL_TYPES)
def test_every_mla_model_type_is_a_family(model_type):
    known = _patch.names()
    assert model_type in known, (
        f"transformers {transformers.__version__} has the MLA model type {model_type!r} (its "
        f"configuration holds a latent rank), which mlarope's discovery misses: it is neither "
        f"patched nor reported"
    )
    row = {r.name: r for r in mt.family_report()}.get(_patch.family(model_type).name)
    assert row is not None and row.status in ("patched", "nothing to patch", "not patched")
    if row.status != "patched":
        assert row.reason, f"{model_type}: {row.status} without a reason"
