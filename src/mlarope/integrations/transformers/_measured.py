"""Which families the patch is worth it for, by measurement: the families ``apply_mlarope_to_all``
leaves unpatched by default, each with the figures that put it there.

The rule (docs/transformers.md, "Worth it"): one attention layer at the family's own
config on the H200 (``benchmarks/transformers_layers.py``), its training step through mlarope at
most 0.98x unpatched at sequence 4096 and at most 1.00x at sequence 128. A family that misses
either in the recorded run is off by default; ``apply_mlarope(name)`` or ``(model)`` still
patches it on request. A family the run did not measure (one a newer transformers adds) is on.
"""

from __future__ import annotations

from dataclasses import dataclass

TARGETS = {4096: 0.98, 128: 1.00}  # training step, mlarope / unpatched, by sequence length
RUN = "J2 (2026-12-04, NVIDIA H200, torch 2.11.0, transformers 5.25.0; docs/transformers.md)"


@dataclass(frozen=True)
class Measured:
    """One family's recorded training steps (ms) and what its rotary calls alone cost."""

    step_4096: tuple[float, float]  # (unpatched, mlarope)
    step_128: tuple[float, float]
    rotary_4096: tuple[float, float]  # the layer's rotary calls, forward + backward, ms
    note: str = ""  # why, where the figures alone do not say it
    run: str = RUN.split(" ")[0]  # the run that measured it (docs/gpu_lane.md)

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


# Filled from the recorded run RUN (benchmarks/transformers_layers.py, all families in one
# process): family -> its training steps in ms and its rotary calls at sequence 4096 (kimi_k25
# runs deepseek_v3's code through its text config and is decided by deepseek_v3's figures).
EARLIER = (
    "run {} measured {:.3f}x at sequence 4096: the step's run-to-run spread straddles the target"
)
MEASURED: dict[str, Measured] = {
    "axk1": Measured(
        step_4096=(8.82, 8.50),
        step_128=(4.39, 4.20),
        rotary_4096=(0.921, 0.533),
    ),
    "axk2": Measured(
        step_4096=(12.62, 12.46),
        step_128=(5.83, 5.69),
        rotary_4096=(1.675, 0.847),
    ),
    "bailing_hybrid": Measured(
        step_4096=(4.54, 4.31),
        step_128=(3.44, 3.30),
        rotary_4096=(0.994, 0.575),
    ),
    "deepseek_v2": Measured(
        step_4096=(4.84, 4.76),
        step_128=(3.41, 3.42),
        rotary_4096=(0.531, 0.372),
    ),
    "deepseek_v3": Measured(
        step_4096=(16.49, 15.75),
        step_128=(3.79, 3.67),
        rotary_4096=(1.059, 0.641),
    ),
    "deepseek_v32": Measured(
        step_4096=(45.97, 45.09),
        step_128=(5.77, 5.32),
        rotary_4096=(1.839, 1.291),
        note="its DSA indexer's attention dominates the step",
    ),
    "deepseek_v4": Measured(
        step_4096=(72.32, 68.71),
        step_128=(8.08, 7.05),
        rotary_4096=(5.603, 1.402),
    ),
    "dots3_note": Measured(
        step_4096=(45.54, 44.74),
        step_128=(5.72, 5.34),
        rotary_4096=(2.183, 1.348),
        note=EARLIER.format("G4", 0.979),
    ),
    "glm4_moe_lite": Measured(
        step_4096=(4.32, 4.17),
        step_128=(3.27, 3.11),
        rotary_4096=(0.893, 0.464),
    ),
    "glm_moe_dsa": Measured(
        step_4096=(35.66, 35.19),
        step_128=(5.53, 5.70),
        rotary_4096=(1.702, 1.184),
        note="its DSA indexer's attention dominates the step",
    ),
    "hy_v4": Measured(
        step_4096=(33.45, 33.23),
        step_128=(5.65, 5.54),
        rotary_4096=(1.782, 1.161),
        note="eager attention (the family has no sdpa) and its indexer dominate the step",
    ),
    "hy_v4_vl": Measured(
        step_4096=(63.16, 62.51),
        step_128=(5.04, 4.84),
        rotary_4096=(1.692, 1.019),
        note="eager attention (the family has no sdpa) and its indexer dominate the step",
    ),
    "longcat_flash": Measured(
        step_4096=(8.61, 8.41),
        step_128=(3.98, 3.79),
        rotary_4096=(0.794, 0.375),
    ),
    "minicpm3": Measured(
        step_4096=(4.08, 3.99),
        step_128=(3.94, 3.75),
        rotary_4096=(0.862, 0.678),
    ),
    "mistral4": Measured(
        step_4096=(3.90, 3.77),
        step_128=(3.25, 3.19),
        rotary_4096=(1.043, 0.719),
    ),
    "mistral_large4": Measured(
        step_4096=(21.37, 22.12),
        step_128=(4.97, 5.00),
        rotary_4096=(1.945, 1.976),
        note=(
            "its rope parameter alpha is trainable: in training its tables require grad, and "
            "its attention runs transformers' own function, patched or not"
        ),
    ),
    "sarvam_mla": Measured(
        step_4096=(8.18, 7.73),
        step_128=(3.56, 3.42),
        rotary_4096=(0.910, 0.398),
    ),
    "youtu": Measured(
        step_4096=(4.14, 3.93),
        step_128=(4.05, 3.80),
        rotary_4096=(0.951, 0.686),
    ),
}


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
    saves = f"can save at most {bound:.1%}" if bound > 0 else "saves nothing"
    text = (
        f"off by default: its training step through mlarope measured {', '.join(misses)} in "
        f"run {measured.run}; its rotary calls take {unpatched * 1e3:.0f} -> "
        f"{ours * 1e3:.0f} us of a {measured.step_4096[0]:.1f} ms step at sequence 4096, so the "
        f"patch {saves}"
    )
    return text + (f" ({measured.note})" if measured.note else "")
