"""Tests for mlarope.yarn: exact fp32 tables, transformers parity, hand values, validation, cache.

Error model used below (u = 2**-24, the fp32 unit roundoff: a correctly rounded fp32 result is
within u * |x| of x, and within 0.5 * spacing(fl(x))):

- mlarope: every step in float64, one rounding to fp32, so each entry is within half an fp32
  ulp of the float64 value; float64 itself is off by at most ~1e-10 at angle 1.6e5. Tested.
- transformers: fp32 inv_freq (tested: a few ulps, derived), fp32 angles p * inv_freq, fp32
  cos/sin, times an fp32 attention factor. Its angle error grows with the position; its tables
  are measured (docs/yarn.md), not bounded by a test: their error varies between processes.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from mlarope.yarn import YarnConfig, clear_cache

U = 2.0**-24  # fp32 unit roundoff
U64 = 2.0**-53  # float64 unit roundoff
DS_V3_POSITIONS = 163_840


def checked_positions(n: int) -> torch.Tensor:
    """Rows compared against a reference: every row below 4096 (the original context), a
    stride-97 sample above it (97 is prime: every residue of the short-period pairs shows up)
    and the last 512 rows. Keeps the file at a few seconds on two cores."""
    rows = torch.cat(
        (torch.arange(min(n, 4096)), torch.arange(4096, n, 97), torch.arange(max(n - 512, 0), n))
    )
    return torch.unique(rows)


# --------------------------------------------------------------------------- helpers


def reference_inv_freq(
    dim: int,
    base: float,
    factor: float,
    original: int,
    beta_fast: float,
    beta_slow: float,
    truncate: bool,
) -> np.ndarray:
    """YaRN inverse frequencies from the paper's definitions, with Python floats (float64).

    Pair j has wavelength lambda_j = 2*pi*base**(2j/dim); over the original context it turns
    original / lambda_j times. Pairs turning more than beta_fast times keep their frequency,
    pairs turning fewer than beta_slow times are divided by factor, in between a linear blend
    over the pair index. The pair index where a pair turns n times solves
    original / (2*pi*base**(2j/dim)) = n.
    """
    half = dim // 2

    def pair_turning(n: float) -> float:
        # base**(2j/dim) = original / (2*pi*n)  =>  j = dim/2 * log_base(original / (2*pi*n))
        return dim / 2 * (math.log(original / (2 * math.pi * n)) / math.log(base))

    lo, hi = pair_turning(beta_fast), pair_turning(beta_slow)
    if truncate:
        lo, hi = float(math.floor(lo)), float(math.ceil(hi))
    lo, hi = max(lo, 0.0), min(hi, dim - 1.0)
    if hi == lo:
        hi += 0.001
    out = np.empty(half, dtype=np.float64)
    for j in range(half):
        theta_j = math.pow(base, -2.0 * j / dim)
        if factor == 1.0:
            out[j] = theta_j
            continue
        interp_weight = min(max((j - lo) / (hi - lo), 0.0), 1.0)
        out[j] = theta_j * (1.0 - interp_weight) + theta_j / factor * interp_weight
    return out


def fp32_spacing(x: torch.Tensor) -> torch.Tensor:
    """Distance from |x| (fp32 values) to the next fp32 number up, as float64."""
    a = x.abs().float()
    return (torch.nextafter(a, torch.full_like(a, math.inf)) - a).double()


def hf_config(rope_parameters: dict, dim: int, max_positions: int):
    transformers = pytest.importorskip("transformers")
    # A tiny MLA (so the attention module is cheap to build); only the rope parts matter.
    return transformers.DeepseekV3Config(
        rope_parameters=dict(rope_parameters),
        qk_rope_head_dim=dim,
        qk_nope_head_dim=128,
        max_position_embeddings=max_positions,
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=16,
        kv_lora_rank=16,
        v_head_dim=16,
    )


# --------------------------------------------------------------------------- exactness


@pytest.mark.parametrize(
    ("cfg", "positions"),
    [
        (YarnConfig.deepseek_v3(), DS_V3_POSITIONS),
        (YarnConfig.deepseek_v3(truncate=False, mscale=0.5), 20_000),
        (YarnConfig(dim=128, base=1e6, factor=4.0, original_max_position_embeddings=32768), 20_000),
        (YarnConfig(dim=32, base=500000.0), 20_000),
    ],
    ids=["deepseek_v3", "no_truncate_mscale", "qwen_like", "plain"],
)
def test_tables_are_float64_rounded_once(cfg: YarnConfig, positions: int) -> None:
    assert_float64_rounded_once(cfg, positions)


def assert_float64_rounded_once(cfg: YarnConfig, positions: int) -> None:
    """``cfg.cos_sin(positions)``: fp32 ``[P, R]``, ``cat(freqs, freqs)``, and each checked entry
    the fp32 rounding of the float64 value from :func:`reference_inv_freq` (the paper's
    definitions, written independently)."""
    cos, sin = cfg.cos_sin(positions)
    half = cfg.dim // 2
    assert cos.shape == sin.shape == (positions, cfg.dim)
    assert cos.dtype == sin.dtype == torch.float32
    assert cos.is_contiguous() and sin.is_contiguous()
    # Layout cat(freqs, freqs): the two halves are the same numbers.
    assert torch.equal(cos[:, :half], cos[:, half:])
    assert torch.equal(sin[:, :half], sin[:, half:])

    inv = reference_inv_freq(
        cfg.dim,
        cfg.base,
        cfg.factor,
        cfg.original_max_position_embeddings,
        cfg.beta_fast,
        cfg.beta_slow,
        cfg.truncate,
    )
    np.testing.assert_allclose(cfg.inv_freq().numpy(), inv, rtol=8 * U64, atol=0)
    att = cfg.attention_scaling
    rows = checked_positions(positions)
    cos, sin = cos[rows], sin[rows]
    p = rows.numpy().astype(np.float64)[:, None]
    theta = p * inv[None, :]
    ref_cos = torch.from_numpy(np.cos(theta) * att)
    ref_sin = torch.from_numpy(np.sin(theta) * att)
    # Correctly rounded: |fl32(x) - x| <= 0.5 * spacing(fl32(x)). Plus the float64 error of
    # the two float64 computations (ours and the reference): inv_freq within ~8 u64 relative
    # (checked above), the angle product one more rounding, so the angles agree to
    # 2**-49 * theta; cos/sin and the product by att add a few u64.
    slack = att * (theta * 2.0**-49 + 8 * U64)
    slack = torch.from_numpy(slack)
    for name, ours, ref in (("cos", cos[:, :half], ref_cos), ("sin", sin[:, :half], ref_sin)):
        err = (ours.double() - ref).abs()
        bound = 0.5 * fp32_spacing(ours) + slack
        bad = err > bound
        assert not bad.any(), (
            f"{name}: {int(bad.sum())} entries not correctly rounded, first at "
            f"{bad.nonzero()[0].tolist()}: ours {ours[bad][0].item()!r} ref {ref[bad][0].item()!r}"
        )


# --------------------------------------------------------------------------- transformers


HF_CASES = [
    # (rope_parameters without rope_theta, rope_theta, rotary dim, positions checked)
    pytest.param(
        dict(
            rope_type="yarn",
            factor=40.0,
            original_max_position_embeddings=4096,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        10000.0,
        64,
        DS_V3_POSITIONS,
        id="deepseek_v3",
    ),
    pytest.param(
        dict(type="yarn", factor=4.0, original_max_position_embeddings=32768),
        1e6,
        128,
        16384,
        id="qwen_like_no_mscale",
    ),
    pytest.param(
        dict(
            rope_type="yarn",
            factor=16.0,
            original_max_position_embeddings=2048,
            beta_fast=64,
            beta_slow=2,
            mscale=0.707,
            mscale_all_dim=1.0,
        ),
        50000.0,
        96,  # 2j/96 is inexact in fp32: exercises the exponent-rounding term
        16384,
        id="betas_mscale_ratio_dim96",
    ),
    pytest.param(
        dict(
            rope_type="yarn",
            factor=32.0,
            original_max_position_embeddings=4096,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
        ),
        150000.0,
        64,
        16384,
        id="no_truncate_gpt_oss_like",
    ),
    pytest.param(dict(rope_type="default"), 10000.0, 64, 16384, id="plain_rope"),
    pytest.param(
        dict(
            rope_type="yarn",
            factor=8.0,
            original_max_position_embeddings=1024,
            attention_factor=1.25,
        ),
        10000.0,
        64,
        16384,
        id="explicit_attention_factor",
    ),
    pytest.param(
        dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=4096, mscale=2.0),
        10000.0,
        64,
        16384,
        id="mscale_without_all_dim",
    ),
]


@pytest.mark.parametrize(("rope_parameters", "theta", "dim", "positions"), HF_CASES)
def test_matches_transformers(
    rope_parameters: dict, theta: float, dim: int, positions: int
) -> None:
    """transformers' reading of each config: the same attention factor and softmax scale, its
    fp32 ``inv_freq`` within its derived error of ours (so both compute one function), and our
    tables for it within half an fp32 ulp of float64."""
    pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    cfg = YarnConfig.from_hf(rope_parameters, rope_theta=theta, dim=dim)
    hc = hf_config({**rope_parameters, "rope_theta": theta}, dim, positions)
    rotary = hf.DeepseekV3RotaryEmbedding(hc)
    attention = hf.DeepseekV3Attention(hc, layer_idx=0)

    # Scalars: the same Python float operations, so the same floats.
    assert cfg.attention_scaling == rotary.attention_scaling
    assert cfg.softmax_scale(attention.qk_head_dim) == attention.scaling

    # inv_freq. transformers: fp32 e = 2j/dim (rel. u); P = base**e (<= 1 ulp = 2u, plus
    # ln(base) * e * u from e's rounding); X = 1/P (+u); I = 1/(factor*P) (+2u); ramp weight
    # w = (j - low)/(high - low) (fp32 low: u*|low|/(high-low), division u, clamp exact), then
    # 1 - w twice (u each); inv = fl(I*w) + fl(X*(1-w)) (u each product, u the sum). With
    # I*w + X*(1-w) = inv and |X - I| <= X:
    #   |inv_hf - inv| <= inv * (ln(base) + 6) * u + X * (|low|/(high-low) + 5) * u
    # (no X term for plain RoPE, where I == X).
    inv64 = cfg.inv_freq()
    inv_hf = rotary.inv_freq.double()
    x64 = cfg.base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    low, high = cfg.correction_range()
    weight_err = 0.0 if cfg.factor == 1.0 else (abs(low) / max(high - low, 1e-3) + 5) * U
    inv_bound = inv64 * (math.log(cfg.base) + 6) * U + x64 * weight_err
    d_inv = (inv_hf - inv64).abs()
    assert (d_inv <= inv_bound).all(), (d_inv / inv_bound).max()

    # cos/sin: ours against float64, for the same configurations. transformers' own tables are
    # not bounded here: their fp32 angles fl(p * inv_hf) carry p * |inv_hf - inv| (up to ~5.5e-3
    # at DeepSeek-V3's last row, docs/yarn.md's measured table), and beyond that model their
    # error varied from process to process (up to 484 times the element bound
    # att * (p * |inv_hf - inv| + u * theta + 5u) in 3 of 25 processes), so a bound on them is a
    # flaky test of transformers, not of mlarope. test_fp32_angle_error_is_what_we_avoid
    # checks the one side of it that cannot flake: that their error is there.
    assert_float64_rounded_once(cfg, positions)


def test_fp32_angle_error_is_what_we_avoid() -> None:
    """transformers' fp32 angles are measurably off where ours are exact (documents why)."""
    pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    cfg = YarnConfig.deepseek_v3()
    params = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    rotary = hf.DeepseekV3RotaryEmbedding(hf_config(params, 64, DS_V3_POSITIONS))
    p = DS_V3_POSITIONS - 1
    cos_hf, _ = rotary(torch.zeros(1), torch.tensor([[p]]))
    exact = torch.cos(p * cfg.inv_freq())  # float64; attention factor 1
    # 1e-3 is ~17,000 fp32 ulps of 1: far beyond the half ulp the exactness test allows.
    assert (cos_hf[0, 0, :32].double() - exact).abs().max() > 1e-3


# --------------------------------------------------------------------------- hand values


def test_deepseek_v3_hand_values() -> None:
    cfg = YarnConfig.deepseek_v3()
    assert cfg.max_position_embeddings == 163840
    # d(beta) = dim * ln(orig / (beta * 2 * pi)) / (2 * ln(base)), dim 64, orig 4096, base 1e4:
    #   2 * ln(10000) = 18.420680743952367
    #   beta_fast = 32: 4096 / (64 pi) = 20.371832715762604, ln = 3.0141531975102716,
    #                   64 * 3.0141531975102716 / 18.420680743952367 = 10.472240810318025
    #   beta_slow = 1:  4096 / (2 pi) = 651.8986469044033, ln = 6.4798891003099985,
    #                   64 * 6.4798891003099985 / 18.420680743952367 = 22.513440636877274
    raw = YarnConfig.deepseek_v3(truncate=False).correction_range()
    assert raw == pytest.approx((10.472240810318025, 22.513440636877274), rel=1e-14)
    assert cfg.correction_range() == (10.0, 23.0)  # floor(10.47...), ceil(22.51...)
    # mscale_all_dim correction m = 0.1 * 1 * ln(40) + 1 = 0.1 * 3.6888794541139363 + 1
    m = 1.3688879454113936
    # mscale == mscale_all_dim: the factor folded into cos/sin is m / m = 1 (transformers).
    assert cfg.attention_scaling == 1.0
    # softmax scale 192**-0.5 * m**2 = 0.07216878364870322 * 1.8738542070926265
    assert cfg.softmax_scale(192) == pytest.approx(0.1352337788608801, rel=1e-15)
    assert cfg.softmax_scale(192) == pytest.approx(192**-0.5 * m * m, rel=1e-15)
    # YaRN without mscale_all_dim folds m into cos/sin instead: m(40) = 1.3688879454113936.
    assert YarnConfig.deepseek_v3(mscale=None, mscale_all_dim=None).attention_scaling == (
        pytest.approx(m, rel=1e-15)
    )
    # The ramp: pairs 0..10 keep base**(-2j/64), pairs 23..31 are divided by 40.
    inv = cfg.inv_freq()
    j = torch.arange(32, dtype=torch.float64)
    plain = 10000.0 ** (-2 * j / 64)
    torch.testing.assert_close(inv[:11], plain[:11], rtol=4 * U64, atol=0)
    torch.testing.assert_close(inv[23:], plain[23:] / 40, rtol=4 * U64, atol=0)
    # Pair 16 is 6/13 of the way: inv = plain * (7/13 + 6/13 / 40).
    assert inv[16].item() == pytest.approx(plain[16].item() * (7 / 13 + 6 / 13 / 40), rel=1e-14)


def test_plain_rope_factor_one() -> None:
    cfg = YarnConfig(dim=64, base=10000.0)
    assert cfg.attention_scaling == 1.0
    assert cfg.softmax_scale(192) == 192**-0.5
    cos, sin = cfg.cos_sin(3)
    assert torch.equal(cos[0], torch.ones(64)) and torch.equal(sin[0], torch.zeros(64))
    # Position 1, pair 0 turns by exactly 1 radian.
    assert cos[1, 0].item() == torch.tensor(math.cos(1.0)).float().item()
    assert YarnConfig.from_hf(None, rope_theta=10000.0, dim=64) == cfg


# m(s, k) = 0.1 * k * ln(s) + 1, ln(40) = 3.6888794541139363: m(40, 1) = 1.3688879454113936,
# m(40, 2) = 1.7377758908227872, m(40, 0) = 1. Megatron-Core takes the ratio whenever neither
# mscale is None, transformers only when both are non-zero (docs/yarn.md's table).
@pytest.mark.parametrize(
    ("mscale", "mscale_all_dim", "transformers_att", "megatron_att"),
    [
        (1.0, 1.0, 1.0, 1.0),  # DeepSeek-V3: m/m
        (None, None, 1.3688879454113936, 1.3688879454113936),  # m(40)
        (1.0, 0.0, 1.3688879454113936, 1.3688879454113936),  # Megatron's default: m(40)/1
        (2.0, 0.0, 1.3688879454113936, 1.7377758908227872),  # m(40) vs m(40, 2)/1
        (0.0, 1.0, 1.3688879454113936, 0.730519984014812),  # m(40) vs 1/m(40)
    ],
)
def test_attention_factor_rules(
    mscale: float | None, mscale_all_dim: float | None, transformers_att: float, megatron_att: float
) -> None:
    hf = YarnConfig.from_hf(
        {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
         "mscale": mscale, "mscale_all_dim": mscale_all_dim},
        rope_theta=10000.0,
        dim=64,
    )  # fmt: skip
    mg = YarnConfig.from_megatron(
        kv_channels=64, scaling_factor=40.0, mscale=mscale, mscale_all_dim=mscale_all_dim
    )
    assert hf.attention_scaling == pytest.approx(transformers_att, rel=1e-15)
    assert mg.attention_scaling == pytest.approx(megatron_att, rel=1e-15)
    # The softmax scale is the same rule in both: m(40, mscale_all_dim)**2 / sqrt(192).
    assert mg.softmax_scale(192) == hf.softmax_scale(192)


def test_from_megatron_deepseek_v3_matches_preset() -> None:
    mg_v3 = YarnConfig.from_megatron(
        kv_channels=64, scaling_factor=40.0, mscale=1.0, mscale_all_dim=1.0
    )
    v3 = YarnConfig.deepseek_v3()
    assert mg_v3.attention_scaling == 1.0
    assert torch.equal(mg_v3.cos_sin(64)[0], v3.cos_sin(64)[0])
    assert torch.equal(mg_v3.cos_sin(64)[1], v3.cos_sin(64)[1])
    assert mg_v3.softmax_scale(192) == v3.softmax_scale(192)


def test_from_hf_reads_transformers_keys() -> None:
    ds = {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    cfg = YarnConfig.from_hf(ds, rope_theta=10000.0, dim=64, max_position_embeddings=163840)
    assert cfg == YarnConfig.deepseek_v3()
    assert YarnConfig.from_hf({**ds, "rope_theta": 10000}, dim=64, max_position_embeddings=163840)
    # Missing factor: max_position_embeddings / original, as transformers infers it.
    no_factor = {k: v for k, v in ds.items() if k != "factor"}
    inferred = YarnConfig.from_hf(no_factor, rope_theta=1e4, dim=64, max_position_embeddings=163840)
    assert inferred.factor == 40.0
    # partial_rotary_factor: rotary dim = int(head_dim * factor).
    half = YarnConfig.from_hf(
        {"rope_type": "default", "partial_rotary_factor": 0.5}, rope_theta=1e4, dim=128
    )
    assert half.dim == 64


# --------------------------------------------------------------------------- validation

V3 = dict(
    dim=64,
    base=10000.0,
    factor=40.0,
    original_max_position_embeddings=4096,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
)


@pytest.mark.parametrize(
    ("overrides", "exc", "words"),
    [
        ({"dim": 63}, ValueError, ["dim", "63", "even"]),
        ({"dim": 0}, ValueError, ["dim", "0"]),
        ({"dim": 64.0}, TypeError, ["dim", "64.0"]),
        ({"dim": True}, TypeError, ["dim", "True"]),
        ({"base": 0.0}, ValueError, ["base", "0.0"]),
        ({"base": 1.0}, ValueError, ["base", "1.0"]),
        ({"base": "1e4"}, TypeError, ["base", "'1e4'"]),
        ({"base": float("nan")}, ValueError, ["base", "nan"]),
        ({"factor": 0.5}, ValueError, ["factor", "0.5"]),
        ({"factor": float("inf")}, ValueError, ["factor", "inf"]),
        ({"original_max_position_embeddings": 0}, ValueError, ["original_max", "0"]),
        ({"original_max_position_embeddings": 4096.0}, TypeError, ["original_max", "4096.0"]),
        ({"beta_fast": 1.0, "beta_slow": 32.0}, ValueError, ["beta_fast", "beta_slow", "32.0"]),
        ({"beta_fast": 1.0}, ValueError, ["beta_fast", "beta_slow", "1.0"]),
        ({"beta_slow": 0.0}, ValueError, ["beta_slow", "0.0"]),
        ({"mscale": -1.0}, ValueError, ["mscale", "-1.0"]),
        ({"mscale_all_dim": "1"}, TypeError, ["mscale_all_dim", "'1'"]),
        ({"truncate": 1}, TypeError, ["truncate", "1"]),
        ({"attention_factor": 0.0}, ValueError, ["attention_factor", "0.0"]),
        ({"max_position_embeddings": -5}, ValueError, ["max_position_embeddings", "-5"]),
        ({"dim": 2**64}, ValueError, ["dim must be in [1, 65536]", str(2**64)]),
    ],
)
def test_config_validation(overrides: dict, exc: type[Exception], words: list[str]) -> None:
    with pytest.raises(exc) as info:
        YarnConfig(**{**V3, **overrides})
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize(
    ("call", "exc", "words"),
    [
        (lambda c: c.cos_sin(0), ValueError, ["max_positions", "0"]),
        (lambda c: c.cos_sin(-3), ValueError, ["max_positions", "-3"]),
        (lambda c: c.cos_sin(8.0), TypeError, ["max_positions", "8.0"]),
        (lambda c: c.cos_sin(True), TypeError, ["max_positions", "True"]),
        (lambda c: c.cos_sin(2**64), ValueError, ["max_positions must be in [1, 2147483647]"]),
        (lambda c: c.cos_sin(8, device="no_such_device"), ValueError, ["device", "no_such"]),
        (lambda c: c.cos_sin(8, device=1.5), TypeError, ["device", "1.5"]),
        (lambda c: c.cos_sin(8, device="cpu:x"), ValueError, ["device", "cpu:x"]),
        (lambda c: c.softmax_scale(0), ValueError, ["qk_head_dim", "0"]),
        (lambda c: c.softmax_scale(192.0), TypeError, ["qk_head_dim", "192.0"]),
    ],
)
def test_call_validation(call, exc: type[Exception], words: list[str]) -> None:
    with pytest.raises(exc) as info:
        call(YarnConfig.deepseek_v3())
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize(
    ("rope_scaling", "kwargs", "exc", "words"),
    [
        ({"rope_type": "linear", "factor": 2.0}, {}, ValueError, ["rope_type", "'linear'"]),
        ({"type": "dynamic"}, {}, ValueError, ["rope_type", "'dynamic'"]),
        ({"type": "yarn", "rope_type": "default"}, {}, ValueError, ["'yarn'", "'default'"]),
        ({"rope_type": "default", "low_freq_factor": 1}, {}, ValueError, ["low_freq_factor"]),
        ({"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 4096}, {},
         ValueError, ["factor", "0.5"]),
        ({"rope_type": "yarn", "factor": 4.0}, {}, ValueError, ["original_max_position"]),
        ({"rope_type": "yarn", "original_max_position_embeddings": 4096}, {}, ValueError,
         ["factor", "max_position_embeddings"]),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
          "truncate": None}, {}, TypeError, ["truncate", "None"]),
        ({"rope_type": "default", "partial_rotary_factor": 1.5}, {}, ValueError,
         ["partial_rotary_factor", "1.5"]),
        ({"rope_type": "default"}, {"rope_theta": None}, ValueError, ["rope_theta", "missing"]),
        ({"rope_type": "default", "rope_theta": 1e6}, {"rope_theta": 1e4}, ValueError,
         ["rope_theta", "1000000.0", "10000.0"]),
        ([("rope_type", "yarn")], {}, TypeError, ["rope_scaling", "list"]),
        ({"rope_type": "default"}, {"dim": 63}, ValueError, ["dim", "63"]),
        ({"rope_type": "default"}, {"dim": 2**64}, ValueError, ["dim must be in [1, 65536]"]),
    ],
)  # fmt: skip
def test_from_hf_validation(
    rope_scaling: object, kwargs: dict, exc: type[Exception], words: list[str]
) -> None:
    kwargs = {"rope_theta": 10000.0, "dim": 64, **kwargs}
    with pytest.raises(exc) as info:
        YarnConfig.from_hf(rope_scaling, **kwargs)  # type: ignore[arg-type]
    for word in words:
        assert word in str(info.value), (word, str(info.value))


# --------------------------------------------------------------------------- cache


def test_cache_returns_same_tensors() -> None:
    cfg = YarnConfig(dim=64, base=10000.0, factor=8.0, original_max_position_embeddings=512)
    cos, sin = cfg.cos_sin(1000)
    again = cfg.cos_sin(1000, device="cpu")
    assert again[0] is cos and again[1] is sin
    # An equal config shares the entry; another length is another table.
    twin = YarnConfig(dim=64, base=10000, factor=8, original_max_position_embeddings=512)
    assert twin.cos_sin(1000)[0] is cos
    other = cfg.cos_sin(999)
    assert other[0] is not cos and torch.equal(other[0], cos[:999])
    clear_cache()
    fresh = cfg.cos_sin(1000)
    assert fresh[0] is not cos and torch.equal(fresh[0], cos)


def test_cache_detects_in_place_modification() -> None:
    cfg = YarnConfig(dim=32, base=10000.0)
    cos, _ = cfg.cos_sin(16)
    expected = cos.clone()
    cos.mul_(2.0)  # a caller's mistake
    with pytest.warns(RuntimeWarning, match="modified in place"):
        rebuilt, _ = cfg.cos_sin(16)
    assert rebuilt is not cos and torch.equal(rebuilt, expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cfg.cos_sin(16)[0] is rebuilt  # clean again


def test_inference_mode_tables_are_normal_tensors() -> None:
    cfg = YarnConfig(dim=32, base=10000.0, factor=2.0, original_max_position_embeddings=64)
    clear_cache()
    with torch.inference_mode():
        cos, _ = cfg.cos_sin(8)
    assert not cos.is_inference() and not cos.requires_grad
    assert cfg.cos_sin(8)[0] is cos


@pytest.mark.gpu
def test_cuda_tables_match_cpu_bitwise() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    cfg = YarnConfig.deepseek_v3()
    cos, sin = cfg.cos_sin(4096, device="cuda")
    assert cos.device.type == "cuda" and cfg.cos_sin(4096, device=cos.device)[0] is cos
    assert torch.equal(cos.cpu(), cfg.cos_sin(4096)[0])
    assert torch.equal(sin.cpu(), cfg.cos_sin(4096)[1])
