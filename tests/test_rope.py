"""mlarope.RopeConfig: the tables of every rope type transformers knows, exact to fp32 rounding.

Error model (u = 2**-24, the fp32 unit roundoff):

- mlarope: inv_freq, the angles, cos/sin and the attention factor in float64, one rounding to
  fp32: each entry within half an fp32 ulp of the float64 value (plus the float64 computation's
  own error, ~2**-49 of the angle).
- transformers: inv_freq in fp32 (a few u relative, derived per type below), the angle
  ``fl(p * inv_hf)`` in fp32, fp32 cos/sin, times the attention factor. So
  ``|cos_hf - cos| <= att * (p * |inv_hf - inv| + u * theta + 5u)`` (as tests/test_yarn.py
  derives for YaRN): the angle error grows with the position; it is transformers' error, and
  mlarope's tables are within it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mlarope import RopeConfig, YarnConfig
from mlarope.yarn import clear_cache

U = 2.0**-24
U64 = 2.0**-53
R = 64
MAX_POS = 1024  # dynamic's max_position_embeddings; original context of longrope / llama3
P = 8192  # the rows compared with transformers


def rows(n: int) -> torch.Tensor:
    """Every row below 1100, a stride-97 sample above, the last 64."""
    sample = torch.arange(1100, max(n, 1100), 97)
    return torch.unique(torch.cat((torch.arange(min(n, 1100)), sample, torch.arange(n - 64, n))))


SHORT = [1.0 + 0.05 * j for j in range(R // 2)]
LONG = [1.5 + 0.4 * j for j in range(R // 2)]
TYPES = {
    "default": {},
    "linear": {"factor": 4.0},
    "dynamic": {"factor": 4.0},
    "yarn": {
        "factor": 8.0, "original_max_position_embeddings": MAX_POS, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.707,
    },
    "longrope": {
        "factor": 8.0, "original_max_position_embeddings": MAX_POS, "short_factor": SHORT,
        "long_factor": LONG,
    },
    "llama3": {
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": MAX_POS,
    },
    "proportional": {"partial_rotary_factor": 0.5, "factor": 2.0},
}  # fmt: skip
# The lengths each type is compared at: below and past the length where dynamic scaling starts
# and longrope switches to its long factors (one length for the others).
LENGTHS = {"dynamic": (600, P), "longrope": (MAX_POS, P)}


def hf_config(kind: str, theta: float = 10000.0):
    transformers = pytest.importorskip("transformers")
    return transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
        q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=R,
        v_head_dim=16, max_position_embeddings=MAX_POS,
        rope_parameters={"rope_type": kind, "rope_theta": theta, **TYPES[kind]},
    )  # fmt: skip


def reference_inv_freq(kind: str, base: float, seq_len: int) -> np.ndarray:
    """Each type from its definition, with Python floats (float64), independently of mlarope."""
    p = TYPES[kind]
    half = R // 2
    x = np.array([base ** (2 * j / R) for j in range(half)])
    if kind == "default":
        return 1 / x
    if kind == "linear":
        return 1 / (p["factor"] * x)
    if kind == "dynamic":
        length = max(seq_len, MAX_POS)
        scaled = base * (p["factor"] * length / MAX_POS - (p["factor"] - 1)) ** (R / (R - 2))
        return np.array([1 / scaled ** (2 * j / R) for j in range(half)])
    if kind == "longrope":
        ext = p["long_factor"] if seq_len > MAX_POS else p["short_factor"]
        return 1 / (np.array(ext) * x)
    if kind == "llama3":
        out = []
        for xj in x:
            wavelength = 2 * math.pi * xj
            if wavelength < MAX_POS / p["high_freq_factor"]:
                out.append(1 / xj)
            elif wavelength > MAX_POS / p["low_freq_factor"]:
                out.append(1 / (p["factor"] * xj))
            else:
                s = (MAX_POS / wavelength - p["low_freq_factor"]) / (
                    p["high_freq_factor"] - p["low_freq_factor"]
                )
                out.append((1 - s) / (p["factor"] * xj) + s / xj)
        return np.array(out)
    if kind == "proportional":
        rotated = int(p["partial_rotary_factor"] * R // 2)
        return np.array([1 / (p["factor"] * x[j]) if j < rotated else 0.0 for j in range(half)])
    raise AssertionError(kind)


def fp32_spacing(x: torch.Tensor) -> torch.Tensor:
    a = x.abs().float()
    return (torch.nextafter(a, torch.full_like(a, math.inf)) - a).double()


# --------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("kind", [k for k in TYPES if k != "yarn"])
def test_tables_are_float64_rounded_once(kind):
    cfg = RopeConfig.from_hf(hf_config(kind))
    assert cfg.rope_type == kind and cfg.dim == R
    for seq_len in LENGTHS.get(kind, (P,)):
        cos, sin = cfg.cos_sin(P, seq_len=seq_len)
        assert cos.shape == sin.shape == (P, R) and cos.dtype == torch.float32
        assert torch.equal(cos[:, : R // 2], cos[:, R // 2 :])
        inv = reference_inv_freq(kind, 10000.0, seq_len)
        np.testing.assert_allclose(cfg.inv_freq(seq_len).numpy(), inv, rtol=16 * U64, atol=0)
        att = cfg.attention_scaling
        r = rows(P)
        theta = r.numpy().astype(np.float64)[:, None] * inv[None, :]
        # correctly rounded: within half an fp32 ulp, plus both float64 computations' error
        slack = torch.from_numpy(att * (theta * 2.0**-49 + 16 * U64))
        for name, ours, exact in (
            ("cos", cos[r, : R // 2], np.cos(theta) * att),
            ("sin", sin[r, : R // 2], np.sin(theta) * att),
        ):
            err = (ours.double() - torch.from_numpy(exact)).abs()
            bad = err > 0.5 * fp32_spacing(ours) + slack
            assert not bad.any(), f"{kind} {name}: {int(bad.sum())} entries not correctly rounded"


def test_yarn_is_yarn_config():
    cfg = RopeConfig.from_hf(hf_config("yarn"))
    assert cfg.yarn == YarnConfig.from_hf(
        {"rope_type": "yarn", **TYPES["yarn"]}, rope_theta=10000.0, dim=R,
        max_position_embeddings=MAX_POS,
    )  # fmt: skip
    clear_cache()
    ours, theirs = cfg.cos_sin(P), cfg.yarn.cos_sin(P)
    assert ours[0] is not theirs[0]  # two cache entries, the same bits
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    assert cfg.attention_scaling == cfg.yarn.attention_scaling != 1.0


# --------------------------------------------------------------------------- transformers


def inv_bound_units(kind: str, cfg: RopeConfig, seq_len: int) -> np.ndarray:
    """transformers' fp32 inv_freq error, relative to inv, in units of u, per pair.

    Every type starts from ``1 / fl(base ** fl(2j / R))``: the exponent is exact here (R a power
    of two), fp32 ``pow`` within an ulp (2u) of its fp32 arguments, the base rounded to fp32
    (u relative, times the exponent <= 1), the reciprocal u: ``(ln(base) + 6) u`` with room, as
    for YaRN. linear / proportional divide by the factor (+u); longrope multiplies by its fp32
    factors (+2u); dynamic's base is computed in fp32 from the length (about 4u relative:
    +ln(base')... bounded by +6u). llama3 blends in the middle band with a weight ``s`` computed
    from ``C / wavelength`` (at most ``high``), each operation u: ``|ds| <= high (e0 + 3u) /
    (high - low) + 2u``, times ``inv (1 - 1/factor)``, plus the blend's own roundings."""
    base = cfg.base
    if kind == "dynamic":
        limit = max(seq_len, MAX_POS)
        factor = TYPES["dynamic"]["factor"]
        base = base * (factor * limit / MAX_POS - (factor - 1)) ** (R / (R - 2))
    e0 = math.log(base) + 6
    extra = {"default": 0, "linear": 1, "proportional": 1, "longrope": 2, "dynamic": 6}
    if kind != "llama3":
        return np.full(R // 2, e0 + extra[kind])
    p = TYPES["llama3"]
    low, high, factor = p["low_freq_factor"], p["high_freq_factor"], p["factor"]
    ds = high * (e0 + 3) / (high - low) + 2
    return np.full(R // 2, e0 + 4 + (1 - 1 / factor) * ds)


@pytest.mark.parametrize("kind", list(TYPES))
def test_matches_transformers(kind):
    """transformers' own rotary embedding, at each length in LENGTHS (a fresh module per
    length, so its dynamic state starts at initialisation), within transformers' fp32 error."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    config = hf_config(kind)
    cfg = RopeConfig.from_hf(config)
    for seq_len in LENGTHS.get(kind, (P,)):
        rotary = hf.DeepseekV3RotaryEmbedding(config)
        assert cfg.attention_scaling == rotary.attention_scaling
        cos_hf, sin_hf = rotary(torch.zeros(1), torch.arange(seq_len)[None])
        inv_hf = rotary.inv_freq.double()
        inv = cfg.inv_freq(seq_len)
        if kind == "yarn":
            low, high = cfg.yarn.correction_range()
            x64 = cfg.base ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)
            weight = (abs(low) / max(high - low, 1e-3) + 5) * U
            inv_bound = inv * (math.log(cfg.base) + 6) * U + x64 * weight
        else:
            inv_bound = inv * torch.from_numpy(inv_bound_units(kind, cfg, seq_len)) * U
        d_inv = (inv_hf - inv).abs()
        assert (d_inv <= inv_bound).all(), f"{kind}: inv_freq {(d_inv / inv_bound).max()}"

        cos, sin = cfg.cos_sin(seq_len, seq_len=seq_len)
        r = rows(seq_len)
        pf = r.double()[:, None]
        tol = cfg.attention_scaling * (pf * d_inv + U * pf * inv + 5 * U)
        tol = torch.cat((tol, tol), dim=-1)
        for name, theirs, ours in (("cos", cos_hf[0, r], cos[r]), ("sin", sin_hf[0, r], sin[r])):
            err = (theirs.double() - ours.double()).abs()
            assert (err <= tol).all(), f"{kind} {seq_len} {name}: {(err / tol).max().item()}"


@pytest.mark.parametrize("attribute", ["original_max_position_embeddings", "partial_rotary_factor"])
def test_from_hf_reads_the_config_before_the_model_is_built(attribute):
    """A config attribute that transformers moves into the rope parameters when the model is
    built (a top-level ``original_max_position_embeddings``, which overrides the dict's for
    yarn, as Phi-3's config files have it; a ``partial_rotary_factor``): ``from_hf`` on the
    fresh config already gives the table the built model uses, and reading the config again
    after the build gives the same (the config was read from its dict only, 1.08 relative
    off in inv_freq, and a table twice as wide)."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    config = hf_config("yarn")
    if attribute == "original_max_position_embeddings":
        config.original_max_position_embeddings = 2 * MAX_POS
    else:
        config.partial_rotary_factor = 0.5
    before = RopeConfig.from_hf(config)
    rotary = hf.DeepseekV3RotaryEmbedding(config)  # standardizes config.rope_parameters
    after = RopeConfig.from_hf(config)
    assert before == after
    inv_hf = rotary.inv_freq.double()
    assert inv_hf.shape == before.inv_freq().shape
    rel = ((inv_hf - before.inv_freq()).abs() / before.inv_freq()).max()
    assert rel < 1e-6, rel


def test_dynamic_follows_transformers_state():
    """transformers' dynamic rotary keeps the largest length it has seen (past max positions)
    until a batch below max positions resets it: its table is ``cos_sin(..., seq_len=L)`` with
    L that largest length. Checked on the same module through grow / smaller / reset."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    config = hf_config("dynamic")
    cfg = RopeConfig.from_hf(config)
    rotary = hf.DeepseekV3RotaryEmbedding(config)
    for length, expected in ((3000, 3000), (2000, 3000), (4000, 4000), (500, 500)):
        rotary(torch.zeros(1), torch.arange(length)[None])
        want = cfg.inv_freq(expected)
        d = (rotary.inv_freq.double() - want).abs()
        assert (d <= want * inv_bound_units("dynamic", cfg, expected)[0] * U).all(), length
        if expected != length:
            assert (rotary.inv_freq.double() - cfg.inv_freq(length)).abs().max() > 1e-4


def test_from_hf_on_the_mla_families():
    """Every MLA config of the installed transformers (its defaults): the table width is its
    rope width (mistral4's partial factor, longcat's own head_dim, dots3_note per layer type)."""
    pytest.importorskip("transformers")
    import transformers

    from mlarope.integrations.transformers import _patch

    for model_type, name in sorted(_patch.discovery().config_classes.items()):
        config = getattr(transformers, name)()
        if getattr(config, "rope_parameters", None) is None or not config.qk_rope_head_dim:
            continue  # MLA without rotary embedding (glm5_next, kimi_linear)
        # nested by layer type (dots3_note) or by rope type (deepseek_v4: main, compress)
        nested = sorted(k for k, v in config.rope_parameters.items() if isinstance(v, dict))
        for layer_type in nested or (None,):
            cfg = RopeConfig.from_hf(config, layer_type=layer_type)
            widths = config
            if layer_type is not None and layer_type in (
                getattr(config, "layer_types", None) or ()
            ):
                widths = config.per_layer_config[layer_type]  # per-layer widths (dots3_note)
            assert cfg.dim == widths.qk_rope_head_dim, (model_type, layer_type)
            cos, _ = cfg.cos_sin(8)
            assert cos.shape == (8, cfg.dim)


def test_plain_constructor_and_defaults():
    cfg = RopeConfig(dim=32)
    assert cfg.rope_type == "default" and cfg.attention_scaling == 1.0
    assert (
        not cfg.depends_on_seq_len
        and RopeConfig(
            rope_type="dynamic", dim=32, factor=2.0, max_position_embeddings=64
        ).depends_on_seq_len
    )
    cos, sin = cfg.cos_sin(4)
    assert torch.equal(cos[0], torch.ones(32)) and torch.equal(sin[0], torch.zeros(32))
    assert cos[1, 0].item() == torch.tensor(math.cos(1.0)).float().item()
    assert cfg.cos_sin(4, seq_len=99)[0] is cos  # seq_len does not matter for default
    lr = RopeConfig(
        rope_type="longrope", dim=4, factor=8.0, original_max_position_embeddings=16,
        short_factor=(1.0, 2.0), long_factor=(4.0, 8.0),
    )  # fmt: skip
    assert lr.attention_scaling == pytest.approx(math.sqrt(1 + math.log(8) / math.log(16)))
    assert lr.inv_freq(16).tolist() == [1.0, 0.5 / 100.0]
    assert lr.inv_freq(17).tolist() == [0.25, 0.125 / 100.0]
    short, long = lr.cos_sin(16, seq_len=16), lr.cos_sin(16, seq_len=17)
    assert not torch.equal(short[0], long[0])
    assert lr.cos_sin(17)[0][:16].equal(long[0])  # seq_len defaults to the table length


@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        ({"rope_type": "ntk", "dim": 8}, ValueError, ["rope_type", "'ntk'"]),
        ({"dim": 7}, ValueError, ["dim must be even", "7"]),
        ({"dim": 8, "base": 1.0}, ValueError, ["base", "1.0"]),
        ({"dim": 8, "factor": 0.0}, ValueError, ["factor", "0.0"]),
        ({"rope_type": "dynamic", "dim": 8}, ValueError, ["needs max_position_embeddings"]),
        ({"rope_type": "dynamic", "dim": 8, "factor": 0.5, "max_position_embeddings": 4},
         ValueError, ["factor must be >= 1"]),
        ({"rope_type": "llama3", "dim": 8, "original_max_position_embeddings": 8,
          "low_freq_factor": 4.0, "high_freq_factor": 1.0}, ValueError, ["high_freq_factor"]),
        ({"rope_type": "longrope", "dim": 8, "original_max_position_embeddings": 8,
          "short_factor": [1.0] * 3, "long_factor": [1.0] * 4}, ValueError,
         ["short_factor", "4", "3"]),
        ({"rope_type": "longrope", "dim": 4, "original_max_position_embeddings": 8,
          "short_factor": "ab", "long_factor": [1.0] * 2}, TypeError, ["short_factor"]),
        ({"rope_type": "proportional", "dim": 8, "rotated_pairs": 5}, ValueError,
         ["rotated_pairs", "5"]),
        ({"rope_type": "yarn", "dim": 8, "yarn": YarnConfig(dim=16)}, ValueError,
         ["yarn.dim (16)", "dim (8)"]),
        ({"rope_type": "linear", "dim": 8, "low_freq_factor": 1.0}, ValueError,
         ["low_freq_factor", "'linear'"]),
    ],
)  # fmt: skip
def test_validation(kwargs, exc, words):
    with pytest.raises(exc) as info:
        RopeConfig(**kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


# --------------------------------------------------------------------------- DeepSeek-V4

# The compressed layers' YaRN, as DeepSeek-V4's config describes it (factor 16 on
# compress_rope_theta 160000); its config sets attention_factor 1.0 where YaRN's rule would
# give m(16) = 1.277.
V4_YARN = {
    "type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
    "beta_slow": 1,
}  # fmt: skip


def v4_config(**rope_scaling):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV4Config"):
        pytest.skip("no DeepSeek-V4 in this transformers")
    return transformers.DeepseekV4Config(num_hidden_layers=2, rope_scaling=rope_scaling or None)


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {},
        V4_YARN,
        # with mscale: still attention factor 1.0; truncate=False in the nested dict, which
        # transformers does not read (it reads the top-level dict's, absent: True)
        {**V4_YARN, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False},
    ],
    ids=["default", "yarn", "yarn_mscale_truncate"],
)
@pytest.mark.parametrize("layer_type", ["main", "compress"])
def test_deepseek_v4_rope_sets_match_transformers(layer_type, rope_scaling):
    """DeepSeek-V4's two rope sets: "main" (rope_theta, plain) and "compress" (its own theta,
    the YaRN parameters, attention factor 1.0), against transformers' DeepseekV4RotaryEmbedding
    (half-width tables, one entry per pair: the first half of mlarope's) within transformers'
    fp32 error, derived as in test_matches_transformers; the exact rounding of mlarope's own
    tables is the rope type's (tested above)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    config = v4_config(**rope_scaling)
    cfg = RopeConfig.from_hf(config, layer_type=layer_type)
    rotary = hf.DeepseekV4RotaryEmbedding(config)
    half = R // 2
    assert cfg.dim == config.qk_rope_head_dim == R
    yarn = layer_type == "compress" and bool(rope_scaling)
    assert cfg.rope_type == ("yarn" if yarn else "default")
    assert cfg.base == (
        config.compress_rope_theta if layer_type == "compress" else config.rope_theta
    )
    att = getattr(rotary, f"{layer_type}_attention_scaling")
    assert cfg.attention_scaling == att == 1.0
    if yarn:
        assert cfg.yarn.factor == 16 and cfg.yarn.truncate  # transformers' reading
    inv_hf = getattr(rotary, f"{layer_type}_inv_freq").double()
    inv = cfg.inv_freq()
    if yarn:
        low, high = cfg.yarn.correction_range()
        x64 = cfg.base ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)
        weight = (abs(low) / max(high - low, 1e-3) + 5) * U
        inv_bound = inv * (math.log(cfg.base) + 6) * U + x64 * weight
    else:
        inv_bound = inv * (math.log(cfg.base) + 6) * U
    d_inv = (inv_hf - inv).abs()
    assert (d_inv <= inv_bound).all(), f"{layer_type}: inv_freq {(d_inv / inv_bound).max()}"

    cos_hf, sin_hf = rotary(torch.zeros(1), torch.arange(P)[None], layer_type=layer_type)
    assert cos_hf.shape == (1, P, half)
    cos, sin = cfg.cos_sin(P)
    assert torch.equal(cos[:, :half], cos[:, half:])  # cat(cos, cos) of the half-width table
    r = rows(P)
    pf = r.double()[:, None]
    tol = att * (pf * d_inv + U * pf * inv + 5 * U)
    for name, theirs, ours in (("cos", cos_hf[0, r], cos[r]), ("sin", sin_hf[0, r], sin[r])):
        err = (theirs.double() - ours[:, :half].double()).abs()
        assert (err <= tol).all(), f"{layer_type} {name}: {(err / tol).max().item()}"


def test_deepseek_v4_sets_differ():
    """The two sets are two tables (another base; YaRN's blend), and a V4 config read without a
    layer_type is refused rather than read as one of them (it gave "main"'s table)."""
    config = v4_config(**V4_YARN)
    main = RopeConfig.from_hf(config, layer_type="main")
    compress = RopeConfig.from_hf(config, layer_type="compress")
    assert main != compress and not torch.equal(main.cos_sin(64)[1], compress.cos_sin(64)[1])
    with pytest.raises(ValueError, match=r"nested by layer type \(\['compress', 'main'\]\)"):
        RopeConfig.from_hf(config)


@pytest.mark.parametrize(
    ("config", "layer_type", "exc", "words"),
    [
        ("v4", "sliding_attention", ValueError,
         ["layer_type 'sliding_attention' is not a key", "['compress', 'main']"]),
        ("v4", 1, TypeError, ["layer_type must be a str", "int 1"]),
        ("v4", None, ValueError, ["nested by layer type", "pass layer_type"]),
        ("flat", "main", ValueError,
         ["layer_type must be None for this config", "layer_type='main'"]),
        ("flat", b"main", TypeError, ["layer_type must be a str", "bytes b'main'"]),
        ("gemma3", None, ValueError, ["['full_attention', 'sliding_attention']"]),
    ],
)  # fmt: skip
def test_from_hf_layer_type_validation(config, layer_type, exc, words):
    """``layer_type`` names a key of nested rope parameters, and only there; each error names
    the value (a nested config read without one said "no rope_theta", or read the wrong set)."""
    transformers = pytest.importorskip("transformers")
    if config == "v4":
        config = v4_config(**V4_YARN)
    elif config == "flat":
        config = hf_config("default")
    else:
        config = transformers.Gemma3TextConfig()
    with pytest.raises(exc) as info:
        RopeConfig.from_hf(config, layer_type=layer_type)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_from_hf_validation():
    with pytest.raises(TypeError, match="transformers model config"):
        RopeConfig.from_hf({"rope_type": "default"})
    config = hf_config("default")
    config.rope_parameters = {"rope_type": "mrope", "rope_theta": 1e4}
    with pytest.raises(ValueError, match="rope_type 'mrope' is not one of"):
        RopeConfig.from_hf(config)
    with pytest.raises(ValueError, match=r"layer_type must be None for this config.*'sliding'"):
        RopeConfig.from_hf(hf_config("default"), layer_type="sliding")
    cfg = RopeConfig(dim=8)
    with pytest.raises(ValueError, match="seq_len"):
        cfg.cos_sin(4, seq_len=0)
    with pytest.raises(ValueError, match="max_positions"):
        cfg.cos_sin(0)


@pytest.mark.parametrize(
    ("kind", "extra", "key"),
    [
        ("dynamic", {"alpha": 1000.0}, "alpha"),  # HunYuan's fixed NTK-alpha base
        ("longrope", {"short_mscale": 1.24, "long_mscale": 1.24}, "short_mscale"),  # Phimoe
        ("longrope", {"long_mscale": 1.24}, "long_mscale"),
    ],
)
def test_from_hf_refuses_what_model_code_reads_beside_the_type(kind, extra, key):
    """Keys some models' own rotary code reads on top of the rope type (HunYuan's ``alpha``
    replaces the base, Phi-3.5-MoE's ``short_mscale``/``long_mscale`` the attention factor):
    a table without them would be silently other than the model's, so they are refused (they
    were dropped; found by review)."""
    config = hf_config(kind)
    config.rope_parameters = {**config.rope_parameters, **extra}
    with pytest.raises(ValueError, match=rf"rope_parameters\['{key}'\]"):
        RopeConfig.from_hf(config)
    config.rope_parameters = {**config.rope_parameters, **dict.fromkeys(extra)}  # None: absent
    RopeConfig.from_hf(config)


def test_from_hf_refuses_ernie_vl_reordered_frequencies():
    """Ernie 4.5 VL's rotary code reorders the pairs' frequencies by its ``mrope_section`` even
    for text positions: not a table mlarope has (it gave the plain one; found by review)."""
    transformers = pytest.importorskip("transformers")
    config_class = getattr(transformers, "Ernie4_5_VLMoeConfig", None)
    if config_class is None:
        pytest.skip("this transformers has no Ernie 4.5 VL")
    config = config_class()
    text = getattr(config, "text_config", config)
    with pytest.raises(ValueError, match="reorders"):
        RopeConfig.from_hf(text)
