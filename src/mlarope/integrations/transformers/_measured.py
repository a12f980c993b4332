"""Which families the patch is worth it for, by measurement: the families ``apply_mlarope_to_all``
leaves unpatched by default, each with the figures that put it there.

The rule (issue #23, docs/transformers.md, "Worth it"): one attention layer at the family's own
config on the H200 (``benchmarks/transformers_layers.py``), its training step through mlarope at
most 0.98x unpatched at sequence 4096 and at most 1.00x at sequence 128. A family that misses
either in the recorded run is off by default; ``apply_mlarope(name)`` or ``(model)`` still
patches it on request. A family the run did not measure (one a newer transformers adds) is on.
"""

from __future__ import annotations

from dataclasses import dataclass

TARGETS = {4096: 0.98, 128: 1.00}  # training step, mlarope / unpatched, by sequence length
RUN = "L4 (2026-12-01, NVIDIA H200, torch 2.11.0, transformers 5.24.0; docs/transformers.md)"


@dataclass(frozen=True)
class Measured:
    """One family's recorded training steps (ms) and what its rotary calls alone cost."""

    step_4096: tuple[float, float]  # (unpatched, mlarope)
    step_128: tuple[float, float]
    rotary_4096: tuple[float, float]  # the layer's rotary calls, forward + backward, ms
    note: str = ""  # why, where the figures alone do not say it

    def ratios(self) -> dict[int, float]:
        return {
            4096: self.step_4096[1] / self.step_4096[0],
            128: self.step_128[1] / self.step_128[0],
        }

    def misses(self) -> list[str]:
        return [
            f"{ratio:.3f}x at sequence {seq} (target <= {TARGETS[seq]:.2f}x)"
            for seq, ratio in self.ratios().items()
            if ratio > TARGETS[seq]
        ]


# Filled from the recorded run RUN: family -> its figures.
MEASURED: dict[str, Measured] = {}


def off_by_default(family: str) -> str:
    """Why ``family`` is off by default ("" when it is on)."""
    measured = MEASURED.get(family)
    if measured is None:
        return ""
    misses = measured.misses()
    if not misses:
        return ""
    unpatched, ours = measured.rotary_4096
    bound = (unpatched - ours) / measured.step_4096[0]
    text = (
        f"off by default: its training step through mlarope measured {', '.join(misses)} in "
        f"run {RUN.split(' ')[0]}; its rotary calls take {unpatched * 1e3:.0f} -> "
        f"{ours * 1e3:.0f} us of a {measured.step_4096[0]:.1f} ms step at sequence 4096, so the "
        f"patch can save at most {bound:.1%}"
    )
    return text + (f" ({measured.note})" if measured.note else "")
