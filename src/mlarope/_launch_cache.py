"""The one cache of launch decisions, and its one reset.

"The same metadata makes the same launch" is decided at two depths, and both answers are kept
here, under one eviction rule and one :func:`clear_launch_cache`:

- ``plans`` (``_plans``): an eager call's metadata -> the launch it recorded, replayed by later
  calls with the same metadata (the decode path's host time);
- ``kernels`` (``kernels._launch.DirectLauncher``): a kernel's specialization key -> its
  compiled kernel, launched without Triton's per-call argument binding.

The launch heuristics (``kernels.q.choose_q_config`` and its kin) are cheap arithmetic and keep
no cache of their own. A leaf module: nothing here imports the rest of the package or Triton.
"""

from __future__ import annotations

# Entries a table keeps before it starts over: far more distinct shapes and flags than a
# process uses (a model has a few per layer type), and a bound on memory if it does not.
MAX_ENTRIES = 4096


class LaunchCache:
    """Two bounded tables of launch decisions with one reset: ``plans`` (call key -> guarded
    entries) and ``kernels`` (launcher -> specialization key -> compiled kernel)."""

    __slots__ = ("kernels", "plans")

    def __init__(self) -> None:
        self.plans: dict[tuple, list] = {}
        self.kernels: dict[object, dict[tuple, object]] = {}

    def plan_entries(self, key: tuple) -> list:
        """The guarded entries of ``key``, a new list if none (the table starts over when
        full)."""
        entries = self.plans.get(key)
        if entries is None:
            if len(self.plans) >= MAX_ENTRIES:
                self.plans.clear()
            entries = self.plans[key] = []
        return entries

    def kernels_of(self, launcher: object) -> dict[tuple, object]:
        """``launcher``'s compiled kernels by specialization key (the launcher keeps a
        reference to this dict for its hot path; :meth:`clear` empties it in place)."""
        table = self.kernels.get(launcher)
        if table is None:
            table = self.kernels[launcher] = {}
        return table

    def clear(self) -> None:
        self.plans.clear()
        for table in self.kernels.values():
            table.clear()


LAUNCH_CACHE = LaunchCache()


def clear_launch_cache() -> None:
    """Forget every recorded plan and directly launched kernel (Triton's own compilation cache
    is untouched: the next call binds its arguments once more and records again)."""
    LAUNCH_CACHE.clear()
