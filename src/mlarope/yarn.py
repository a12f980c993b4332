"""YaRN / RoPE tables for MLA: config parsing, exact fp32 cos/sin tables, softmax scale.

:class:`YarnConfig` holds the parameters of YaRN context extension (``factor == 1`` is plain
RoPE) and builds the rotary tables the kernels read:

- ``cos, sin: [P, R]`` fp32, ``R = dim``, layout ``cat(freqs, freqs)`` (``c[j] == c[half + j]``),
  YaRN's attention factor folded in;
- every step computed in float64 (the YaRN ramp blend of the inverse frequencies, the angles
  ``p * inv_freq``, cos/sin, the attention factor) and rounded to fp32 once, so each entry is
  the fp32 rounding of the float64 value. transformers and Megatron-Core compute the angles in
  fp32, which is off by about 3e-4 at position 8,192 and 5.5e-3 at 163,839 (DeepSeek-V3).

The parameters mean what they mean in transformers' ``_compute_yarn_parameters`` and
DeepSeek-V3 attention; ``docs/yarn.md`` lists where Megatron-Core differs and which
constructor reproduces which.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import threading
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mlarope._checks import check_bool, check_int

__all__ = ["YarnConfig", "clear_cache"]

# Keys of a transformers ``rope_scaling`` / ``rope_parameters`` dict that from_hf understands.
_HF_KEYS = frozenset(
    {
        "type",
        "rope_type",
        "rope_theta",
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
        "attention_factor",
        "partial_rotary_factor",
    }
)
_HF_ROPE_TYPES = ("yarn", "default")
# Bounds of the integer arguments that size tensors, far beyond any model (rotary widths of
# 32-128 channels, contexts of a few hundred thousand positions): a clear ValueError instead of
# an OverflowError from torch.
MAX_DIM = 2**16
MAX_POSITIONS = 2**31 - 1


def _check_real(
    name: str,
    value: object,
    *,
    greater_than: float | None = None,
    at_least: float | None = None,
) -> float:
    """A finite real number (not a bool), returned as a Python float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if greater_than is not None and not v > greater_than:
        raise ValueError(f"{name} must be > {greater_than}, got {value!r}")
    if at_least is not None and not v >= at_least:
        raise ValueError(f"{name} must be >= {at_least}, got {value!r}")
    return v


def _check_optional_real(
    name: str,
    value: object,
    *,
    greater_than: float | None = None,
    at_least: float | None = None,
) -> float | None:
    """``None``, or what :func:`_check_real` accepts."""
    if value is None:
        return None
    return _check_real(name, value, greater_than=greater_than, at_least=at_least)


def _get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * ln(scale) + 1`` (1 when ``scale <= 1``), in transformers' order."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _resolve_device(device: object) -> torch.device:
    """``None`` -> torch's default device; a device without an index -> the current one."""
    if device is None:
        dev = torch.get_default_device()
    elif isinstance(device, (str, torch.device)) or (
        isinstance(device, int) and not isinstance(device, bool)
    ):
        try:
            dev = torch.device(device)
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"device must name a torch device, got {device!r}") from e
    else:
        raise TypeError(
            f"device must be a torch.device, str, int or None, got {device!r} "
            f"({type(device).__name__})"
        )
    if dev.type != "cpu" and dev.index is None:
        # "cuda" means the current CUDA device; key the cache by the concrete one.
        try:
            dev = torch.empty(0, device=dev).device
        except (RuntimeError, AssertionError) as e:  # e.g. no CUDA in this build / machine
            raise ValueError(f"device {device!r} is not available here: {e}") from e
    return dev


@dataclass(frozen=True, kw_only=True)
class YarnConfig:
    """YaRN (or plain, ``factor == 1``) RoPE parameters and the tables they define.

    Fields (keyword-only; validated on construction, ``ValueError``/``TypeError`` naming the
    field and value):

    - ``dim``: rotary dim ``R`` (even, > 0); the table width. DeepSeek-V3: ``qk_rope_head_dim``.
    - ``base``: ``rope_theta`` (> 1).
    - ``factor``: context extension factor (>= 1; 1 is plain RoPE).
    - ``original_max_position_embeddings``: pre-training context length (> 0).
    - ``beta_fast``, ``beta_slow``: rotation counts bounding the ramp (> 0, fast > slow).
    - ``mscale``, ``mscale_all_dim``: DeepSeek's attention-factor knobs (>= 0 or ``None``).
    - ``truncate``: floor/ceil the correction range to integers (transformers' ``truncate``,
      Megatron-Core's ``correction_range_round_to_int``; both default True).
    - ``attention_factor``: explicit factor folded into cos/sin (> 0), overriding the rule.
    - ``max_position_embeddings``: the model's context length, informational (``None`` if not
      known); :meth:`cos_sin` accepts any length.

    The attention factor (``attention_scaling``) follows transformers: ``attention_factor``
    if given, else ``m(factor, mscale) / m(factor, mscale_all_dim)`` if both are non-zero and
    not None, else ``m(factor, 1)``, with ``m(s, k) = 0.1 * k * ln(s) + 1`` (1 for ``s <= 1``).
    DeepSeek-V3 (``mscale == mscale_all_dim == 1``) thus folds in 1.0 and puts the whole
    ``m(40, 1)**2`` into :meth:`softmax_scale`.
    """

    dim: int
    base: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    attention_factor: float | None = None
    max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        dim = check_int("dim", self.dim, minimum=1, maximum=MAX_DIM)
        if dim % 2:
            raise ValueError(f"dim must be even (pairs of rotary channels), got {dim}")
        put("base", _check_real("base", self.base, greater_than=1.0))
        put("factor", _check_real("factor", self.factor, at_least=1.0))
        check_int(
            "original_max_position_embeddings", self.original_max_position_embeddings, minimum=1
        )
        beta_fast = _check_real("beta_fast", self.beta_fast, greater_than=0.0)
        beta_slow = _check_real("beta_slow", self.beta_slow, greater_than=0.0)
        if not beta_fast > beta_slow:
            raise ValueError(
                f"beta_fast must be > beta_slow, got beta_fast={self.beta_fast!r}, "
                f"beta_slow={self.beta_slow!r}"
            )
        put("beta_fast", beta_fast)
        put("beta_slow", beta_slow)
        put("mscale", _check_optional_real("mscale", self.mscale, at_least=0.0))
        put(
            "mscale_all_dim",
            _check_optional_real("mscale_all_dim", self.mscale_all_dim, at_least=0.0),
        )
        check_bool("truncate", self.truncate)
        put(
            "attention_factor",
            _check_optional_real("attention_factor", self.attention_factor, greater_than=0.0),
        )
        if self.max_position_embeddings is not None:
            check_int("max_position_embeddings", self.max_position_embeddings, minimum=1)

    # ------------------------------------------------------------------ constructors

    @classmethod
    def deepseek_v3(cls, **overrides: Any) -> YarnConfig:
        """DeepSeek-V3's rope: ``dim=64, base=1e4, factor=40, original=4096, beta 32/1,
        mscale = mscale_all_dim = 1``, context 163,840. ``overrides`` replace fields."""
        cfg = cls(
            dim=64,
            base=10000.0,
            factor=40.0,
            original_max_position_embeddings=4096,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
            truncate=True,
            max_position_embeddings=163840,
        )
        return dataclasses.replace(cfg, **overrides) if overrides else cfg

    @classmethod
    def from_hf(
        cls,
        rope_scaling: Mapping[str, Any] | None,
        *,
        rope_theta: float | None = None,
        dim: int,
        max_position_embeddings: int | None = None,
    ) -> YarnConfig:
        """The config transformers builds from a model config's ``rope_scaling`` dict.

        Args:
            rope_scaling: ``config.rope_scaling`` / ``config.rope_parameters`` (a dict with
                ``rope_type`` or ``type`` ``'yarn'`` or ``'default'``; ``None`` or ``'default'``
                is plain RoPE). Keys: ``factor``, ``original_max_position_embeddings``,
                ``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim``, ``truncate``,
                ``attention_factor``, ``rope_theta``, ``partial_rotary_factor``; any other key
                raises, so a typo or another rope type is never silently ignored.
            rope_theta: the base; may instead be the dict's ``rope_theta`` (if both are given
                they must agree).
            dim: the head dim transformers reads, ``config.head_dim``; the rotary dim is
                ``int(dim * partial_rotary_factor)``. DeepSeek-V2/V3 have no partial factor and
                a ``head_dim`` of ``qk_rope_head_dim``; DeepSeek-V4's ``head_dim`` is the whole
                head (512) with a partial factor of 0.125, so pass ``config.head_dim`` there
                (its ``qk_rope_head_dim`` would give a rotary dim of 8).
            max_position_embeddings: ``config.max_position_embeddings``; as in transformers it
                stands in for a missing ``original_max_position_embeddings`` and gives
                ``factor = max_position_embeddings / original`` when ``factor`` is missing.

        Mirrors transformers' defaults: a missing or zero ``beta_fast``/``beta_slow`` is 32/1,
        a missing ``truncate`` is True; for ``'default'`` the YaRN keys are ignored.
        """
        if rope_scaling is None:
            params: dict[str, Any] = {}
        elif isinstance(rope_scaling, Mapping):
            params = dict(rope_scaling)
        else:
            raise TypeError(
                f"rope_scaling must be a dict or None, got {rope_scaling!r} "
                f"({type(rope_scaling).__name__})"
            )
        unknown = sorted(str(k) for k in set(params) - _HF_KEYS)
        if unknown:
            raise ValueError(
                f"rope_scaling has unsupported keys {unknown} (in {params!r}); "
                f"supported: {sorted(_HF_KEYS)}"
            )
        rope_type, legacy_type = params.get("rope_type"), params.get("type")
        if rope_type is not None and legacy_type is not None and rope_type != legacy_type:
            raise ValueError(
                f"rope_scaling['rope_type']={rope_type!r} and rope_scaling['type']="
                f"{legacy_type!r} disagree"
            )
        rope_type = rope_type if rope_type is not None else legacy_type
        rope_type = "default" if rope_type is None else rope_type
        if rope_type not in _HF_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling['rope_type'] must be one of {_HF_ROPE_TYPES} or None, "
                f"got {rope_type!r}"
            )

        theta_kw = _check_optional_real("rope_theta", rope_theta)
        theta_dict = _check_optional_real("rope_scaling['rope_theta']", params.get("rope_theta"))
        if theta_kw is None and theta_dict is None:
            raise ValueError(
                "rope_theta is missing: pass rope_theta=... or put 'rope_theta' in rope_scaling"
            )
        if theta_kw is not None and theta_dict is not None and theta_kw != theta_dict:
            raise ValueError(
                f"rope_theta={rope_theta!r} disagrees with rope_scaling['rope_theta']="
                f"{params['rope_theta']!r}"
            )
        base = theta_kw if theta_kw is not None else theta_dict

        head_dim = check_int("dim", dim, minimum=1, maximum=MAX_DIM)
        partial = _check_real(
            "rope_scaling['partial_rotary_factor']",
            params.get("partial_rotary_factor", 1.0),
            greater_than=0.0,
        )
        if partial > 1.0:
            raise ValueError(f"rope_scaling['partial_rotary_factor'] must be <= 1, got {partial!r}")
        rotary_dim = int(head_dim * partial)

        try:
            if rope_type == "default":
                return cls(
                    dim=rotary_dim, base=base, max_position_embeddings=max_position_embeddings
                )
            original = params.get("original_max_position_embeddings")
            if original is None:
                original = max_position_embeddings
            if original is None:
                raise ValueError(
                    "original_max_position_embeddings is missing: put it in rope_scaling or "
                    "pass max_position_embeddings=..."
                )
            factor = params.get("factor")
            if factor is None:
                if max_position_embeddings is None:
                    raise ValueError(
                        "factor is missing: put it in rope_scaling or pass "
                        "max_position_embeddings=... (factor = max / original)"
                    )
                check_int("max_position_embeddings", max_position_embeddings, minimum=1)
                check_int("original_max_position_embeddings", original, minimum=1)
                factor = max_position_embeddings / original
            return cls(
                dim=rotary_dim,
                base=base,
                factor=factor,
                original_max_position_embeddings=original,
                beta_fast=params.get("beta_fast") or 32.0,
                beta_slow=params.get("beta_slow") or 1.0,
                mscale=params.get("mscale"),
                mscale_all_dim=params.get("mscale_all_dim"),
                truncate=params.get("truncate", True),
                attention_factor=params.get("attention_factor"),
                max_position_embeddings=max_position_embeddings,
            )
        except (TypeError, ValueError) as e:
            raise type(e)(f"YarnConfig.from_hf(rope_scaling={params!r}): {e}") from e

    @classmethod
    def from_megatron(
        cls,
        *,
        kv_channels: int,
        rotary_base: float = 10000.0,
        scaling_factor: float = 1.0,
        original_max_position_embeddings: int = 4096,
        beta_fast: float = 32.0,
        beta_slow: float = 1.0,
        mscale: float | None = 1.0,
        mscale_all_dim: float | None = 0.0,
        correction_range_round_to_int: bool = True,
        max_position_embeddings: int | None = None,
    ) -> YarnConfig:
        """The config Megatron-Core's ``YarnRotaryEmbedding`` builds from these arguments.

        Argument names and defaults are Megatron-Core's (``kv_channels`` is the rotary dim,
        ``qk_pos_emb_head_dim`` in MLA). The difference from :meth:`from_hf` is the attention
        factor: Megatron-Core uses ``m(s, mscale) / m(s, mscale_all_dim)`` whenever neither is
        ``None`` (transformers only when both are non-zero), so a zero ``mscale`` or
        ``mscale_all_dim`` gives a different factor. It is stored as an explicit
        ``attention_factor``. See docs/yarn.md.
        """
        cfg = cls(
            dim=kv_channels,
            base=rotary_base,
            factor=scaling_factor,
            original_max_position_embeddings=original_max_position_embeddings,
            beta_fast=beta_fast,
            beta_slow=beta_slow,
            mscale=mscale,
            mscale_all_dim=mscale_all_dim,
            truncate=correction_range_round_to_int,
            max_position_embeddings=max_position_embeddings,
        )
        if cfg.mscale is None or cfg.mscale_all_dim is None:
            attention = _get_mscale(cfg.factor)
        else:
            attention = float(
                _get_mscale(cfg.factor, cfg.mscale) / _get_mscale(cfg.factor, cfg.mscale_all_dim)
            )
        return dataclasses.replace(cfg, attention_factor=attention)

    # ------------------------------------------------------------------ derived values

    @property
    def attention_scaling(self) -> float:
        """The factor folded into cos/sin (transformers' ``attention_scaling``)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return float(
                _get_mscale(self.factor, self.mscale)
                / _get_mscale(self.factor, self.mscale_all_dim)
            )
        return _get_mscale(self.factor)

    def correction_range(self) -> tuple[float, float]:
        """``(low, high)``: pair indices where the YaRN ramp starts and ends.

        ``d(beta) = dim * ln(original / (2 * pi * beta)) / (2 * ln(base))`` with
        ``low = d(beta_fast)``, ``high = d(beta_slow)``; floored/ceiled if ``truncate``;
        clamped to ``[0, dim - 1]`` (as transformers and Megatron-Core clamp).
        """

        def corr_dim(rotations: float) -> float:
            return (
                self.dim
                * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))
            ) / (2 * math.log(self.base))

        low, high = corr_dim(self.beta_fast), corr_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return float(max(low, 0)), float(min(high, self.dim - 1))

    def inv_freq(self) -> torch.Tensor:
        """Inverse frequencies, float64 on the CPU: ``inv_freq: [dim // 2]``.

        ``inv_freq[j] = r_j / (factor * base**(2j/dim)) + (1 - r_j) / base**(2j/dim)`` with the
        ramp ``r_j = clamp((j - low) / (high - low), 0, 1)`` (``high += 0.001`` if equal), all in
        float64; plain ``1 / base**(2j/dim)`` when ``factor == 1``.
        """
        half = self.dim // 2
        exponent = torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim
        pos_freq = torch.pow(torch.tensor(self.base, dtype=torch.float64), exponent)
        extrapolation = 1.0 / pos_freq
        if self.factor == 1.0:
            return extrapolation
        interpolation = 1.0 / (self.factor * pos_freq)
        low, high = self.correction_range()
        if low == high:
            high += 0.001  # the singularity guard of transformers and Megatron-Core
        ramp = ((torch.arange(half, dtype=torch.float64) - low) / (high - low)).clamp(0.0, 1.0)
        return interpolation * ramp + extrapolation * (1.0 - ramp)

    def softmax_scale(self, qk_head_dim: int) -> float:
        """Attention softmax scale: ``qk_head_dim**-0.5 * m**2``, ``m = m(factor, mscale_all_dim)``.

        The DeepSeek-V3 correction exactly as transformers' ``DeepseekV3Attention`` computes it
        (same operations, same order, so the same float): applied only when ``mscale_all_dim``
        is non-zero; 1 for ``factor == 1``. ``qk_head_dim`` is nope + rope (192 for V3).
        """
        d = check_int("qk_head_dim", qk_head_dim, minimum=1)
        scale = d ** (-0.5)
        if self.mscale_all_dim:
            m = _get_mscale(self.factor, self.mscale_all_dim)
            scale = scale * m * m
        return scale

    # ------------------------------------------------------------------ tables

    def cos_sin(
        self, max_positions: int, device: torch.device | str | int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables for positions ``0 .. max_positions - 1``.

        Returns:
            ``cos, sin: [P, R]`` fp32, contiguous, ``P = max_positions``, ``R = dim``;
            ``cos[p, j] = cos[p, half + j] = fl32(att * cos(p * inv_freq[j]))`` (likewise sin),
            computed in float64 and rounded once.

        ``device``: where the tables live (``None``: torch's default device). The result is
        cached per ``(config, max_positions, device)`` (a small LRU shared by equal configs),
        and the cached tensors themselves are returned: do not modify them in place
        (``.clone()`` first if you need to). An in-place change is detected on the next call
        (through the tensor's version counter), which then warns and rebuilds the table.
        """
        p = check_int("max_positions", max_positions, minimum=1, maximum=MAX_POSITIONS)
        dev = _resolve_device(device)
        return cached_tables(
            (self, p, dev),
            lambda: tables_from_inv_freq(self.inv_freq(), self.attention_scaling, p, dev),
            f"{self!r} (max_positions={p}, device={dev})",
        )


def tables_from_inv_freq(
    inv_freq: torch.Tensor, attention_scaling: float, max_positions: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin: [P, 2 * half]`` fp32 from float64 ``inv_freq: [half]``: the angles
    ``p * inv_freq`` in float64, cos/sin times the attention factor in float64, one rounding
    to fp32, layout ``cat(freqs, freqs)``. Computed on the CPU whatever the target device, so
    every device gets the same bits."""
    positions = torch.arange(max_positions, dtype=torch.float64)
    angles = positions[:, None] * inv_freq.to(torch.float64)[None, :]  # one float64 rounding
    cos_half = (torch.cos(angles) * attention_scaling).to(torch.float32)  # the one fp32 rounding
    sin_half = (torch.sin(angles) * attention_scaling).to(torch.float32)
    cos = torch.cat((cos_half, cos_half), dim=-1).to(device)
    sin = torch.cat((sin_half, sin_half), dim=-1).to(device)
    return cos, sin


def cached_tables(key: tuple, build, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables of ``key`` from the shared cache, built by ``build()`` on a miss (the cache
    of every config class: :func:`clear_cache` empties it). A cached table modified in place
    since (its version counter moved) warns and is rebuilt."""
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None:
            cos, sin, cos_version, sin_version = hit
            if cos._version == cos_version and sin._version == sin_version:
                _cache.move_to_end(key)
                return cos, sin
            warnings.warn(
                f"a cached cos/sin table of {what} was modified in place by a caller; "
                "rebuilding it. Clone the tables before modifying them.",
                RuntimeWarning,
                stacklevel=3,
            )
            del _cache[key]
        with torch.no_grad(), torch.inference_mode(False):
            cos, sin = build()
        _cache[key] = (cos, sin, cos._version, sin._version)
        while len(_cache) > _CACHE_MAX_ENTRIES:
            _cache.popitem(last=False)
        return cos, sin


_CACHE_MAX_ENTRIES = 8
_cache: OrderedDict[tuple, tuple[Any, ...]] = OrderedDict()
_cache_lock = threading.Lock()


def clear_cache() -> None:
    """Drop every cached cos/sin table (tensors already handed out stay valid)."""
    with _cache_lock:
        _cache.clear()
