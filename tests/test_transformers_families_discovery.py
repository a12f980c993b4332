"""The integration's discovery of the MLA families and its report: every family patched or
reported with its reason, the families of transformers 5.24 found, no rotary call missed,
``kernels.kernelize`` not reaching the rotary functions, and discovery reading the code (calls
handed the rotary embedding, the module's own rotary embeddings, composites) not the names.
"""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("transformers")

import transformers

from mlarope.integrations.transformers import _patch
from tests import families_harness
from tests.families_harness import PATCHED, REPORT, tiny_model, token_ids

# The harness's fixtures, found by pytest under these names: one intra-op thread for the tiny
# models, and every family unpatched after each test.
one_thread = families_harness.one_thread
unpatched_after = families_harness.unpatched_after


def test_every_family_is_patched_or_has_a_reason():
    """Every modeling module whose code is MLA, and every MLA config, is in the report, and each
    row is patched (every rotary function with its exact mapping) or says why not."""
    found = _patch.discovery()
    assert set(found.modules) <= set(REPORT), "an MLA modeling module is missing from the report"
    for model_type, package in found.config_only.items():
        assert REPORT[model_type].runs_on == package
    for model_type, composite in found.composites.items():
        row = REPORT[model_type]
        assert row.runs_on == composite.package and composite.sub_config in row.through
        assert row.status == REPORT[composite.package].status
    for model_type in found.config_classes:
        assert any(model_type in row.model_types for row in REPORT.values()), model_type
    for name, row in REPORT.items():
        assert row.status in ("patched", "not patched", "nothing to patch"), name
        if row.status == "patched":
            assert row.functions and all(f.exact for f in row.functions), name
            assert row.reason == "", name
        else:
            assert row.reason.startswith(f"{row.status}: ") and len(row.reason) > 20, name
        if row.status == "nothing to patch":
            assert not row.functions, name
        assert row.summary().startswith(f"{name}: {row.status}: "), name


def test_the_families_of_transformers_5_24_are_found():
    """What discovery finds in transformers 5.24 and 5.25 (5.25 adds no MLA family; later
    releases: at least these)."""
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.24"):
        pytest.skip(f"transformers {transformers.__version__}: fewer families than 5.24")
    patched = {
        "axk1", "axk2", "bailing_hybrid", "deepseek_v2", "deepseek_v3", "deepseek_v32",
        "deepseek_v4", "dots3_note", "glm4_moe_lite", "glm_moe_dsa", "hy_v4", "hy_v4_vl",
        "kimi_k25", "longcat_flash", "minicpm3", "mistral4", "mistral_large4", "sarvam_mla",
        "youtu",
    }  # fmt: skip
    assert patched <= set(PATCHED)
    for name in ("glm5_next", "kimi_linear"):
        assert REPORT[name].status == "nothing to patch"
    assert REPORT["sarvam_mla"].runs_on == "deepseek_v3"
    hy_v4 = (f,) = REPORT["hy_v4"].functions
    hy_v4_vl = (g,) = REPORT["hy_v4_vl"].functions
    if Version(transformers.__version__) < Version("5.25"):
        # names do not tell: 5.24's hy_v4_vl's apply_rotary_pos_emb is interleaved in and out,
        # hy_v4's half-split
        assert g.name == "apply_rotary_pos_emb"
        assert g.short.startswith("interleaved -> interleaved")
        assert f.name == "apply_rotary_pos_emb" and f.short.startswith("half-split -> half-split")
    else:  # 5.25: both call the DeepSeek-V3-style interleave function instead
        for (h,) in (hy_v4, hy_v4_vl):
            assert h.name == "apply_rotary_pos_emb_interleave"
            assert h.short.startswith("interleaved -> half-split, first-half tables")
    assert "k may be None" in REPORT["mistral_large4"].functions[0].short
    indexer = {f.name: f.callers for f in REPORT["deepseek_v32"].functions}
    assert indexer["apply_rotary_pos_emb"] == ("DeepseekV32Indexer (unsqueeze_dim=2)",)
    # DeepSeek-V4: one function of one tensor, called by the attention (q, kv, the output's
    # inverse), both compressors and the indexer (on their own rotary embedding's tables)
    v4 = REPORT["deepseek_v4"]
    assert v4.attention == ("DeepseekV4Attention",)  # its indexer reads q_lora_rank too
    (f,) = v4.functions
    assert f.name == "apply_rotary_pos_emb" and set(f.callers) == {
        "DeepseekV4Attention", "DeepseekV4CSACompressor", "DeepseekV4HCACompressor",
        "DeepseekV4Indexer",
    }  # fmt: skip
    assert f.short == (
        "interleaved -> interleaved, half-width tables, result x.dtype, one tensor: its "
        "trailing rope channels"
    )
    # Composite model types: served by the family of their text config; the others of the
    # DeepSeek line carry no MLA (deepseek_ocr2's text model is multi-head attention,
    # deepseek_vl and deepseek_vl_hybrid's text config is llama's)
    kimi = REPORT["kimi_k25"]
    assert (kimi.runs_on, kimi.module, kimi.status) == (
        "deepseek_v3",
        REPORT["deepseek_v3"].module,
        "patched",
    )
    assert kimi.through == "its text_config (deepseek_v3 by default)"
    assert "kimi_k25" in REPORT["deepseek_v3"].model_types
    assert not {"deepseek_ocr2", "deepseek_vl", "deepseek_vl_hybrid"} & set(REPORT)


@pytest.mark.parametrize("family", sorted(REPORT))
def test_no_rotary_call_is_missed(family, device, monkeypatch):
    """A cross-check of the discovery by name, in forwards of the tiny model: the module-level
    functions of the family's module whose names say rotary and that the model calls are the
    ones the report lists (none for a family with nothing to patch)."""
    row = REPORT[family]
    module = importlib.import_module(row.module)
    listed = {f.name for f in row.functions}
    called = set()
    for name in dir(module):
        fn = getattr(module, name)
        if "rotary" in name and callable(fn) and not isinstance(fn, type):

            def spy(*args, _fn=fn, _name=name, **kwargs):
                called.add(_name)
                return _fn(*args, **kwargs)

            monkeypatch.setattr(module, name, spy)
    model = tiny_model(row, torch.float32, device)
    # DeepSeek-V3-style attention calls one of two functions, as config.rope_interleave says
    # (the text model's config, in a composite)
    configs = [
        m.config for m in model.modules() if hasattr(getattr(m, "config", None), "rope_interleave")
    ]
    settings = (True, False) if configs else (None,)
    for interleave in settings:
        for config in configs:
            config.rope_interleave = interleave
        with torch.no_grad():
            model(input_ids=token_ids(8, device))
    assert called == listed


@pytest.mark.parametrize("family", sorted(REPORT))
def test_kernelize_does_not_reach_the_rotary_functions(family, device):
    """docs/transformers.md, "transformers' kernels": ``kernels.kernelize`` replaces a
    module-level function only through the private copies ``use_kernelized_func`` gives the
    instances of a class (``_kernel_funcs``), and no MLA attention of transformers 5.25 has
    one for its rotary functions, so a kernel mapping for ``rotary_pos_emb`` (mlarope's or
    another) never reaches an MLA model. When a release adds one, this fails by the family's
    name: mlarope can then also be offered as that mapping's provider."""
    row = REPORT[family]
    rotary = {f.name for f in row.functions}
    model = tiny_model(row, torch.float32, device)
    reached = {
        f"{type(m).__name__}: {name}"
        for m in model.modules()
        for name in getattr(m, "_kernel_funcs", {})
        if name in rotary
    }
    assert not reached, (
        f"transformers {transformers.__version__}: kernels.kernelize now reaches {family}'s "
        f"rotary functions ({sorted(reached)}); see docs/transformers.md"
    )


def test_discovery_reads_the_code_not_the_names():
    """The rotary calls are the ones handed the rotary embedding, whatever the names, through
    assignments, in the attention and the classes it builds; other calls are not."""
    source = """
def rope_a(q, k, cos, sin): ...
def rope_b(q, k, cos, sin, unsqueeze_dim=1): ...
def apply_rotary_pos_emb(q, k, cos, sin): ...
def repeat_kv(x, n): ...

class Scorer:
    def forward(self, x, position_embeddings):
        c, s = position_embeddings
        pair = (c, s)
        return rope_b(x, x, *pair, unsqueeze_dim=2)

class MyAttention:
    def __init__(self, config):
        self.kv_lora_rank = config.kv_lora_rank
        self.scorer = Scorer()
    def forward(self, hidden, position_embeddings, mask):
        cos, sin = position_embeddings
        q = repeat_kv(hidden, 2)
        q, k = rope_a(q, hidden, cos, sin)
        return q

class Vision:
    def forward(self, x, position_embeddings):
        return apply_rotary_pos_emb(x, x, *position_embeddings)
"""
    from mlarope.integrations.transformers import _discovery

    found = _discovery.scan_modeling_source(source, "toy", "toy.modeling_toy")
    assert found.attention == ("MyAttention",)
    assert found.builds == ("Scorer",)
    assert found.functions == ("rope_a", "rope_b")
    assert found.calls[1].keywords == (("unsqueeze_dim", 2),)
    assert _discovery.scan_modeling_source("class A: pass", "x", "x.m") is None


def test_discovery_follows_the_modules_own_rotary_embedding():
    """DeepSeek-V4's shape: an attention that reads q_lora_rank only, compressors built through
    a module-level table of classes, each owning the module's rotary embedding (the class whose
    output the model hands its layers as position_embeddings) and rotating its entries by a call
    of it; a class that reads q_lora_rank but is built by the attention is not an attention; a
    rotary module the model does not hand on (a vision tower's) taints nothing."""
    source = """
def rope_one(x, cos, sin, unsqueeze_dim=1): ...
def vision_rope(x, cos, sin): ...

class Rotary:
    def forward(self, x, position_ids, layer_type=None): ...

class VisionRotary:
    def forward(self, x): ...

class Indexer:
    def __init__(self, config):
        self.q_b_proj = Linear(config.q_lora_rank, 8)
        self.rotary_emb = Rotary(config)
        self.vision = VisionRotary()
    def forward(self, hidden, position_ids):
        cos_q, sin_q = self.rotary_emb(hidden, position_ids=position_ids)
        q = rope_one(hidden, cos_q, sin_q)
        return q, vision_rope(hidden, *self.vision(hidden))

class Compressor:
    def __init__(self, config):
        self.rotary_emb = Rotary(config)
        self.indexer = Indexer(config)
    def forward(self, hidden, positions):
        return rope_one(hidden, *self.rotary_emb(hidden, positions, layer_type="compress"))

COMPRESSORS = {"sliding": None, "compressed": Compressor}

class MyAttention:
    def __init__(self, config):
        self.q_a_proj = Linear(8, config.q_lora_rank)
        self.compressor = COMPRESSORS[config.layer_type](config)
    def forward(self, hidden, position_embeddings):
        cos, sin = position_embeddings["main"]
        o = rope_one(hidden, cos, sin)
        return rope_one(o, cos, -sin)

class MyModel:
    def __init__(self, config):
        self.rotary_emb = Rotary(config)
        self.vision_rotary = VisionRotary()
    def forward(self, x, position_ids):
        position_embeddings = {"main": self.rotary_emb(x, position_ids, layer_type="main")}
        return self.layer(x, position_embeddings=position_embeddings)
"""
    from mlarope.integrations.transformers import _discovery

    found = _discovery.scan_modeling_source(source, "toy", "toy.modeling_toy")
    assert found.attention == ("MyAttention",)
    assert {"Compressor", "Indexer", "Rotary"} <= set(found.builds)
    assert found.functions == ("rope_one",)
    assert {c.caller for c in found.calls} == {"MyAttention", "Compressor", "Indexer"}


def _write(root, package, files):
    folder = root / "models" / package
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).write_text(text)


def test_composites_are_found_from_their_sub_configs_and_code(tmp_path):
    """A composite config whose sub-config is an MLA model type by default (by model type, or
    by config class) is served by that family when its model builds the sub-model from it; a
    composite whose model does not (another use of the field), or whose sub-config is not MLA,
    is not listed."""
    from mlarope.integrations.transformers import _discovery

    builds = (
        "class M:\n"
        "    def __init__(self, config):\n"
        "        self.lm = AutoModel.from_config(config.text_config)\n"
    )
    spec = (
        "class {}Config:\n"
        '    sub_configs_defaults = {{"text_config": SubConfigSpec(config_class=AutoConfig, '
        'model_type="{}"), "vision_config": VisionConfig}}\n'
    )
    _write(
        tmp_path,
        "multi",
        {"configuration_multi.py": spec.format("Multi", "mla"), "modeling_multi.py": builds},
    )
    _write(
        tmp_path,
        "other",
        {
            "configuration_other.py": spec.format("Other", "mla"),
            "modeling_other.py": "class M:\n    text_config = None\n",
        },
    )
    _write(
        tmp_path,
        "plain",
        {"configuration_plain.py": spec.format("Plain", "llama"), "modeling_plain.py": builds},
    )
    by_class = 'class ByclassConfig:\n    sub_configs = {"text_config": MlaConfig}\n'
    _write(
        tmp_path, "byclass", {"configuration_byclass.py": by_class, "modeling_byclass.py": builds}
    )
    config_types = {
        "multi": "MultiConfig", "other": "OtherConfig", "plain": "PlainConfig",
        "byclass": "ByclassConfig", "mla": "MlaConfig", "llama": "LlamaConfig",
    }  # fmt: skip
    found = _discovery._composites(tmp_path, config_types, {"mla": "mla_pkg"}, lambda t: t)
    assert found == {
        "multi": _discovery.Composite("multi", "MultiConfig", "text_config", "mla", "mla_pkg"),
        "byclass": _discovery.Composite(
            "byclass", "ByclassConfig", "text_config", "mla", "mla_pkg"
        ),
    }
