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
RUN = "G4 (2026-12-01, NVIDIA H200, torch 2.11.0, transformers 5.24.0; docs/transformers.md)"


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
# process): family -> its training steps in ms and its rotary calls at sequence 4096.
NOISE = "the first full run (G2) measured {:.3f}x: within the run-to-run spread of the step"
MEASURED: dict[str, Measured] = {
    "axk1": Measured(step_4096=(8.98, 8.72), step_128=(4.34, 4.11), rotary_4096=(1.048, 0.741)),
    "axk2": Measured(step_4096=(12.47, 12.48), step_128=(5.80, 5.75), rotary_4096=(1.911, 1.391)),
    "bailing_hybrid": Measured(
        step_4096=(4.76, 4.57), step_128=(3.70, 3.39), rotary_4096=(1.118, 0.713)
    ),
    "deepseek_v2": Measured(
        step_4096=(5.40, 5.40), step_128=(4.39, 4.51), rotary_4096=(0.863, 0.679)
    ),
    "deepseek_v3": Measured(
        step_4096=(16.52, 15.68), step_128=(4.15, 3.94), rotary_4096=(1.059, 0.552)
    ),
    "deepseek_v4": Measured(  # the same command with --families deepseek_v4
        step_4096=(71.60, 67.54), step_128=(9.53, 7.98), rotary_4096=(5.572, 1.351), run="G5"
    ),
    "deepseek_v32": Measured(
        step_4096=(45.84, 45.02),
        step_128=(5.41, 5.25),
        rotary_4096=(1.612, 1.075),
        note="its DSA indexer's attention dominates the step",
    ),
    "dots3_note": Measured(
        step_4096=(46.12, 45.16), step_128=(8.06, 7.48), rotary_4096=(2.815, 1.803)
    ),
    "glm4_moe_lite": Measured(
        step_4096=(4.76, 4.63), step_128=(5.17, 4.91), rotary_4096=(1.240, 0.496)
    ),
    "glm_moe_dsa": Measured(
        step_4096=(35.94, 35.18), step_128=(7.15, 6.44), rotary_4096=(2.145, 1.343)
    ),
    "hy_v4": Measured(
        step_4096=(33.75, 33.71),
        step_128=(7.42, 7.79),
        rotary_4096=(1.816, 1.364),
        note="eager attention (the family has no sdpa) and its indexer dominate the step",
    ),
    "hy_v4_vl": Measured(
        step_4096=(63.85, 62.76),
        step_128=(8.57, 7.34),
        rotary_4096=(2.342, 1.221),
        note="eager attention (the family has no sdpa) and its indexer dominate the step",
    ),
    "longcat_flash": Measured(
        step_4096=(8.87, 8.57), step_128=(5.05, 4.64), rotary_4096=(1.382, 0.703)
    ),
    "minicpm3": Measured(
        step_4096=(4.28, 4.35),
        step_128=(4.89, 4.69),
        rotary_4096=(0.891, 0.719),
        note=NOISE.format(0.976),
    ),
    "mistral4": Measured(step_4096=(4.71, 4.33), step_128=(4.12, 3.96), rotary_4096=(1.093, 0.787)),
    "mistral_large4": Measured(
        step_4096=(22.17, 22.30),
        step_128=(7.33, 6.81),
        rotary_4096=(2.834, 2.965),
        note=(
            "its rope parameter alpha is trainable: in training its tables require grad, and "
            "its attention runs transformers' own function, patched or not"
        ),
    ),
    "sarvam_mla": Measured(
        step_4096=(8.31, 7.91), step_128=(3.62, 3.31), rotary_4096=(1.365, 0.966)
    ),
    "youtu": Measured(
        step_4096=(4.70, 4.63),
        step_128=(4.50, 4.20),
        rotary_4096=(1.116, 0.713),
        note=NOISE.format(0.962),
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
