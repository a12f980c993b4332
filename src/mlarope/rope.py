"""Rotary tables for every RoPE scaling type transformers knows, exact to fp32 rounding.

:class:`RopeConfig` is one table builder for the rope types of transformers' ``rope_type``:
``default``, ``linear``, ``dynamic`` (NTK), ``yarn``, ``longrope``, ``llama3`` and
``proportional`` (transformers' ``ROPE_INIT_FUNCTIONS`` and each model's default). Each type
defines the inverse frequencies ``inv_freq: [R / 2]`` and an attention factor; the tables are
then, as for :class:`mlarope.YarnConfig` (which is the YaRN case and is used for it):

- ``cos[p, j] = cos[p, R/2 + j] = fl32(att * cos(p * inv_freq[j]))``, likewise ``sin``: the
  layout ``cat(freqs, freqs)`` of transformers and Megatron-Core, ``cos, sin: [P, R]`` fp32;
- every step in float64 (``inv_freq``, the angles, cos/sin, the factor), rounded to fp32 once.

transformers computes ``inv_freq`` and the angles in fp32, so its tables differ from these by
its own fp32 error, which grows with the position (``docs/yarn.md``).

Two types depend on the sequence being rotated, not only on the config: ``dynamic`` scales the
base with the sequence length ``L`` (past ``max_position_embeddings``), and ``longrope`` uses
its long factors when ``L > original_max_position_embeddings``. :meth:`RopeConfig.cos_sin`
takes ``seq_len`` (default: the table length) for them; transformers uses the largest position
of the batch plus one (and ``dynamic`` keeps the largest length seen until a short batch resets
it, see ``docs/yarn.md``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._checks import check_int
from .yarn import (
    MAX_DIM,
    MAX_POSITIONS,
    YarnConfig,
    _check_real,
    _resolve_device,
    cached_tables,
    tables_from_inv_freq,
)

__all__ = ["ROPE_TYPES", "RopeConfig"]

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")
# The keys of a rope_parameters dict that YarnConfig.from_hf reads (others, such as mistral4's
# llama_4_scaling_beta, are for the attention, not the tables).
_YARN_KEYS = frozenset(
    {
        "rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings",
        "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate", "attention_factor",
        "partial_rotary_factor",
    }
)  # fmt: skip


def _factors(name: str, value: object, pairs: int) -> tuple[float, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        if isinstance(value, torch.Tensor):
            value = value.tolist()
        else:
            raise TypeError(f"{name} must be a sequence of {pairs} numbers, got {value!r}")
    if len(value) != pairs:
        raise ValueError(f"{name} must have dim / 2 = {pairs} entries, got {len(value)}")
    return tuple(_check_real(f"{name}[{i}]", v, greater_than=0.0) for i, v in enumerate(value))


@dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """The parameters of one rotary scaling type and the tables they define.

    Fields (keyword-only; validated on construction, ``ValueError``/``TypeError`` naming the
    field and value):

    - ``rope_type``: one of :data:`ROPE_TYPES`.
    - ``dim``: the table width ``R`` (even): ``qk_rope_head_dim`` in MLA models.
    - ``base``: ``rope_theta`` (> 1).
    - ``factor``: the scaling factor (> 0): ``linear`` and ``proportional`` divide the
      frequencies by it, ``llama3`` the low ones, ``dynamic`` scales the base with it,
      ``longrope`` derives its default attention factor from it. Ignored by ``default``.
    - ``attention_factor``: ``longrope`` only: the factor folded into cos/sin (default
      ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))``, 1 for ``factor <= 1``).
    - ``max_position_embeddings``: ``dynamic``: the length past which the base grows.
    - ``original_max_position_embeddings``: ``longrope``, ``llama3``: the pre-training context.
    - ``low_freq_factor``, ``high_freq_factor``: ``llama3``.
    - ``short_factor``, ``long_factor``: ``longrope``: ``R / 2`` per-pair divisors each.
    - ``rotated_pairs``: ``proportional``: the pairs that rotate (the others have frequency 0,
      so cos 1 and sin 0); their exponents are ``2j / R`` with ``R`` the whole width.
    - ``yarn``: ``yarn``: the :class:`YarnConfig` (its ``dim`` is ``dim``).
    """

    rope_type: str = "default"
    dim: int
    base: float = 10000.0
    factor: float = 1.0
    attention_factor: float | None = None
    max_position_embeddings: int | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    rotated_pairs: int | None = None
    yarn: YarnConfig | None = None

    def __post_init__(self) -> None:
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        kind = self.rope_type
        if kind not in ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {ROPE_TYPES}, got {kind!r}")
        dim = check_int("dim", self.dim, minimum=2, maximum=MAX_DIM)
        if dim % 2:
            raise ValueError(f"dim must be even (pairs of rotary channels), got {dim}")
        put("base", _check_real("base", self.base, greater_than=1.0))
        put("factor", _check_real("factor", self.factor, greater_than=0.0))

        def require(*names: str) -> None:
            for name in names:
                if getattr(self, name) is None:
                    raise ValueError(f"rope_type={kind!r} needs {name}")

        def forbid(*names: str) -> None:
            for name in names:
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} is for another rope type than {kind!r}")

        owners = {
            "yarn": ("yarn",),
            "longrope": ("attention_factor", "short_factor", "long_factor"),
            "llama3": ("low_freq_factor", "high_freq_factor"),
            "proportional": ("rotated_pairs",),
        }
        for owner, names in owners.items():
            if kind != owner:
                forbid(*names)
        if kind == "dynamic":
            require("max_position_embeddings")
            if self.factor < 1.0:
                raise ValueError(f"factor must be >= 1 for rope_type='dynamic', got {self.factor}")
        if self.max_position_embeddings is not None:
            check_int("max_position_embeddings", self.max_position_embeddings, minimum=1)
        if kind in ("longrope", "llama3"):
            require("original_max_position_embeddings")
        if self.original_max_position_embeddings is not None:
            check_int(
                "original_max_position_embeddings",
                self.original_max_position_embeddings,
                minimum=2 if kind == "longrope" else 1,  # longrope divides by its log
            )
        if kind == "longrope":
            require("short_factor", "long_factor")
            put("short_factor", _factors("short_factor", self.short_factor, dim // 2))
            put("long_factor", _factors("long_factor", self.long_factor, dim // 2))
            if self.attention_factor is not None:
                put(
                    "attention_factor",
                    _check_real("attention_factor", self.attention_factor, greater_than=0.0),
                )
        if kind == "llama3":
            require("low_freq_factor", "high_freq_factor")
            low = _check_real("low_freq_factor", self.low_freq_factor, greater_than=0.0)
            high = _check_real("high_freq_factor", self.high_freq_factor, greater_than=0.0)
            if not high > low:
                raise ValueError(
                    f"high_freq_factor must be > low_freq_factor, got {high!r} and {low!r}"
                )
            put("low_freq_factor", low)
            put("high_freq_factor", high)
        if kind == "proportional":
            require("rotated_pairs")
            check_int("rotated_pairs", self.rotated_pairs, minimum=0, maximum=dim // 2)
        if kind == "yarn":
            require("yarn")
            if not isinstance(self.yarn, YarnConfig):
                raise TypeError(f"yarn must be a YarnConfig, got {type(self.yarn).__name__}")
            if self.yarn.dim != dim:
                raise ValueError(f"yarn.dim ({self.yarn.dim}) must equal dim ({dim})")

    # ------------------------------------------------------------------ from transformers

    @classmethod
    def from_hf(cls, config: Any, *, layer_type: str | None = None) -> RopeConfig:
        """The tables a transformers model config defines (``rope_parameters``, or the older
        ``rope_scaling`` with ``rope_theta``), as transformers reads them.

        ``dim`` is ``int(head_dim * partial_rotary_factor)`` with ``head_dim =
        config.head_dim or hidden_size // num_attention_heads`` (in MLA configs ``head_dim`` is
        ``qk_rope_head_dim``, or the partial factor makes it so); ``proportional`` keeps the
        whole ``head_dim`` and rotates ``int(partial_rotary_factor * head_dim // 2)`` pairs.
        ``layer_type``: for a config whose ``rope_parameters`` are nested by layer type or
        rope type (dots3_note, Gemma 3; DeepSeek-V4's ``"main"`` and ``"compress"``), the key
        whose tables to build, with per-layer widths in ``config.per_layer_config`` when it has
        them; required there, and refused (None only) for a config with one set for every
        layer. DeepSeek-V4: ``"main"`` is its sliding-window layers' plain RoPE (``rope_theta``),
        ``"compress"`` its compressed layers' and their compressors' and indexers'
        (``compress_rope_theta``, the checkpoint's YaRN parameters with attention factor 1.0,
        which its config sets); its model hands them out as half-width tables (one entry per
        pair), the first half of these.

        Not in the config, so not here: mistral_large4's learnable ``alpha`` (its trained
        frequencies are ``inv_freq * exp(alpha)``), hy_v4_vl's multimodal positions (with text
        positions its table is this one).
        """
        params, base, head_dim, max_pos = _read_hf(config, layer_type)
        _refuse_model_specific(config, params)
        kind = params.get("rope_type", params.get("type")) or "default"
        if kind not in ROPE_TYPES:
            raise ValueError(
                f"config's rope_type {kind!r} is not one of {ROPE_TYPES} (rope_parameters "
                f"{params!r})"
            )
        partial = _check_real(
            "rope_parameters['partial_rotary_factor']",
            params.get("partial_rotary_factor", 1.0),
            greater_than=0.0,
        )
        dim = int(head_dim * partial)
        common: dict[str, Any] = {"rope_type": kind, "dim": dim, "base": base}
        try:
            if kind == "default":
                return cls(**common)
            if kind == "yarn":
                yarn_params = {k: v for k, v in params.items() if k in _YARN_KEYS}
                if layer_type is not None:
                    # transformers reads `truncate` from the top-level dict even when the
                    # parameters are nested by layer type
                    top = getattr(config, "rope_parameters", None) or {}
                    yarn_params["truncate"] = top.get("truncate", True)
                yarn = YarnConfig.from_hf(
                    yarn_params, rope_theta=base, dim=head_dim, max_position_embeddings=max_pos
                )
                return cls(**common, yarn=yarn)
            if kind == "proportional":
                return cls(
                    rope_type=kind,
                    dim=head_dim,
                    base=base,
                    factor=params.get("factor", 1.0),
                    rotated_pairs=int(partial * head_dim // 2),
                )
            factor = params.get("factor")
            original = params.get("original_max_position_embeddings")
            if kind == "linear":
                return cls(**common, factor=factor)
            if kind == "dynamic":
                return cls(**common, factor=factor, max_position_embeddings=max_pos)
            if kind == "llama3":
                return cls(
                    **common,
                    factor=factor,
                    original_max_position_embeddings=original,
                    low_freq_factor=params.get("low_freq_factor"),
                    high_freq_factor=params.get("high_freq_factor"),
                )
            # longrope: a missing factor is max / original, as transformers does
            if factor is None and max_pos is not None and original:
                factor = max_pos / original
            return cls(
                **common,
                factor=1.0 if factor is None else factor,
                attention_factor=params.get("attention_factor"),
                original_max_position_embeddings=original,
                short_factor=params.get("short_factor"),
                long_factor=params.get("long_factor"),
            )
        except (TypeError, ValueError) as e:
            raise type(e)(f"RopeConfig.from_hf(rope_parameters={params!r}): {e}") from e

    # ------------------------------------------------------------------ derived values

    @property
    def attention_scaling(self) -> float:
        """The factor folded into cos/sin (transformers' ``attention_scaling``)."""
        if self.yarn is not None:
            return self.yarn.attention_scaling
        if self.rope_type != "longrope":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.factor <= 1.0:
            return 1.0
        return math.sqrt(
            1 + math.log(self.factor) / math.log(self.original_max_position_embeddings)
        )

    @property
    def depends_on_seq_len(self) -> bool:
        """``dynamic`` and ``longrope``: the tables depend on the length being rotated."""
        return self.rope_type in ("dynamic", "longrope")

    def inv_freq(self, seq_len: int | None = None) -> torch.Tensor:
        """Inverse frequencies, float64 on the CPU: ``inv_freq: [dim // 2]``.

        With ``x_j = base ** (2j / dim)``, ``j = 0 .. dim/2 - 1`` (all in float64):

        - ``default``: ``1 / x_j``; ``linear``: ``1 / (factor * x_j)``;
        - ``dynamic``: ``1 / x'_j`` with the base ``base * (factor * L / M - (factor - 1)) **
          (dim / (dim - 2))``, ``L = max(seq_len, M)``, ``M = max_position_embeddings`` (so
          ``default`` up to ``M``);
        - ``longrope``: ``1 / (e_j * x_j)`` with ``e = long_factor`` if ``seq_len >
          original_max_position_embeddings`` else ``short_factor``;
        - ``llama3``: wavelength ``w_j = 2 pi x_j``; ``1 / x_j`` where ``w_j < C / high``,
          ``1 / (factor x_j)`` where ``w_j > C / low``, in between ``(1 - s) / (factor x_j) + s
          / x_j`` with ``s = (C / w_j - low) / (high - low)``; ``C`` the original context;
        - ``proportional``: ``1 / (factor * x_j)`` for ``j < rotated_pairs``, else 0;
        - ``yarn``: :meth:`YarnConfig.inv_freq`.

        ``seq_len`` matters for ``dynamic`` and ``longrope`` only (None: no scaling for
        ``dynamic``, the short factors for ``longrope``, as transformers at initialisation).
        """
        if seq_len is not None:
            seq_len = check_int("seq_len", seq_len, minimum=1, maximum=MAX_POSITIONS)
        if self.yarn is not None:
            return self.yarn.inv_freq()
        exponent = torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim
        base = self.base
        if self.rope_type == "dynamic":
            limit = self.max_position_embeddings
            length = limit if seq_len is None else max(seq_len, limit)
            base = base * ((self.factor * length / limit) - (self.factor - 1)) ** (
                self.dim / (self.dim - 2)
            )
        x = torch.pow(torch.tensor(base, dtype=torch.float64), exponent)
        if self.rope_type in ("default", "dynamic"):
            return 1.0 / x
        if self.rope_type == "linear":
            return 1.0 / (self.factor * x)
        if self.rope_type == "proportional":
            inv = 1.0 / (self.factor * x)
            inv[self.rotated_pairs :] = 0.0
            return inv
        if self.rope_type == "longrope":
            long = seq_len is not None and seq_len > self.original_max_position_embeddings
            ext = torch.tensor(self.long_factor if long else self.short_factor, dtype=torch.float64)
            return 1.0 / (ext * x)
        # llama3
        inv = 1.0 / x
        context = float(self.original_max_position_embeddings)
        low, high = self.low_freq_factor, self.high_freq_factor
        wavelen = 2 * math.pi * x
        smooth = (context / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv / self.factor + smooth * inv
        out = torch.where(wavelen > context / low, inv / self.factor, inv)
        medium = (wavelen >= context / high) & (wavelen <= context / low)
        return torch.where(medium, blended, out)

    # ------------------------------------------------------------------ tables

    def cos_sin(
        self,
        max_positions: int,
        device: torch.device | str | int | None = None,
        *,
        seq_len: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables for positions ``0 .. max_positions - 1``.

        Returns:
            ``cos, sin: [P, R]`` fp32, contiguous: ``fl32(att * cos(p * inv_freq[j]))`` in both
            halves (likewise sin), computed in float64 and rounded once.

        ``seq_len`` (``dynamic``, ``longrope``): the length of the sequence the table serves,
        transformers' ``max(position_ids) + 1``; default ``max_positions``. Other types ignore
        it. Cached per ``(config, max_positions, device, seq_len)`` with the tables of
        :class:`YarnConfig` (:func:`mlarope.yarn.clear_cache`); do not modify the returned
        tensors in place (``.clone()`` first).
        """
        p = check_int("max_positions", max_positions, minimum=1, maximum=MAX_POSITIONS)
        dev = _resolve_device(device)
        length = None
        if self.depends_on_seq_len:
            length = (
                p
                if seq_len is None
                else check_int("seq_len", seq_len, minimum=1, maximum=MAX_POSITIONS)
            )
        elif seq_len is not None:
            check_int("seq_len", seq_len, minimum=1, maximum=MAX_POSITIONS)
        return cached_tables(
            (self, p, dev, length),
            lambda: tables_from_inv_freq(self.inv_freq(length), self.attention_scaling, p, dev),
            f"{self!r} (max_positions={p}, device={dev}, seq_len={length})",
        )


# Keys that some models' own rotary code reads on top of transformers' rope type, changing the
# table: a table without them would silently be another one.
_MODEL_SPECIFIC_KEYS = {
    "alpha": "HunYuan's rotary code makes the base rope_theta * alpha ** (d / (d - 2))",
    "short_mscale": "Phi-3.5-MoE's rotary code takes it for the attention factor",
    "long_mscale": "Phi-3.5-MoE's rotary code takes it for the attention factor",
}
# Model types whose rotary code reorders the pairs' frequencies (by its mrope_section), text
# positions too.
_REORDERED_FREQUENCIES = ("ernie4_5_vl",)


def _refuse_model_specific(config: Any, params: Mapping) -> None:
    for key, why in _MODEL_SPECIFIC_KEYS.items():
        if params.get(key) is not None:
            raise ValueError(
                f"rope_parameters[{key!r}] = {params[key]!r}: {why}, beside transformers' rope "
                f"type, and RopeConfig does not build that table"
            )
    model_type = str(getattr(config, "model_type", ""))
    if model_type.startswith(_REORDERED_FREQUENCIES):
        raise ValueError(
            f"{model_type}'s rotary code reorders the pairs' frequencies by its mrope_section, "
            f"text positions too: RopeConfig does not build that table"
        )


def _read_hf(config: Any, layer_type: str | None) -> tuple[dict, float, int, int | None]:
    """``(rope parameters, base, head_dim, max_position_embeddings)`` of a transformers config."""
    if isinstance(config, Mapping) or not hasattr(config, "hidden_size"):
        raise TypeError(
            f"config must be a transformers model config (with hidden_size and rope_parameters "
            f"or rope_scaling), got {type(config).__name__}"
        )
    params = getattr(config, "rope_parameters", None)
    if params is None:  # transformers before 5: rope_scaling plus rope_theta
        params = getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, Mapping):
        raise TypeError(f"config's rope parameters must be a dict, got {params!r}")
    widths = config
    # The keys of a dict nested by layer type (or rope type) hold dicts; a flat dict's values
    # are numbers, strings and lists (a flat leftover such as V4's top-level rope_type aside).
    nested = sorted(str(k) for k, v in params.items() if isinstance(v, Mapping))
    if layer_type is None:
        if nested:
            raise ValueError(
                f"config.rope_parameters are nested by layer type ({nested}): pass layer_type, "
                f"one of them"
            )
    elif not isinstance(layer_type, str):
        raise TypeError(
            f"layer_type must be a str (a key of config.rope_parameters) or None, got "
            f"{type(layer_type).__name__} {layer_type!r}"
        )
    elif not nested:
        raise ValueError(
            f"layer_type must be None for this config: its rope_parameters are one set for "
            f"every layer, not nested by layer type (keys {sorted(map(str, params))}), got "
            f"layer_type={layer_type!r}"
        )
    elif layer_type not in nested:
        raise ValueError(
            f"layer_type {layer_type!r} is not a key of config.rope_parameters ({nested})"
        )
    if layer_type is not None:
        params = params[layer_type]
        per_layer = getattr(config, "per_layer_config", None)
        try:
            widths = per_layer[layer_type] if per_layer is not None else config
        except (KeyError, TypeError, ValueError):
            widths = config
    params = _standardized(config, dict(params), nested=layer_type is not None)
    base = params.get("rope_theta", getattr(config, "rope_theta", None))
    if base is None:
        raise ValueError("config has no rope_theta (in rope_parameters or as an attribute)")
    head_dim = getattr(widths, "head_dim", None) or (
        widths.hidden_size // widths.num_attention_heads
    )
    if isinstance(head_dim, bool) or not isinstance(head_dim, numbers.Integral):
        raise TypeError(f"config's head_dim must be an int, got {head_dim!r}")
    max_pos = getattr(config, "max_position_embeddings", None)
    return params, base, int(head_dim), max_pos


def _standardized(config: Any, params: dict, *, nested: bool) -> dict:
    """``params`` (a copy) completed from the config's attributes as transformers' own
    ``standardize_rope_params`` does before any table is built, so that a config read before
    its model is built gives the model's tables: a ``partial_rotary_factor`` attribute fills a
    missing key; for llama3, yarn and longrope an ``original_max_position_embeddings``
    attribute (Phi-3's config files) overrides the dict's (in a dict nested by layer type it
    only fills a missing one from ``max_position_embeddings``)."""
    partial = getattr(config, "partial_rotary_factor", None)
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
    kind = params.get("rope_type", params.get("type")) or "default"
    if kind in ("llama3", "yarn", "longrope"):
        original = getattr(config, "original_max_position_embeddings", None)
        if not nested and original is not None:
            params["original_max_position_embeddings"] = original
        elif getattr(config, "max_position_embeddings", None) is not None:
            params.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    return params
