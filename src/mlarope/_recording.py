"""Which launches this thread is recording: the state a launch plan is made from.

``kernels._launch.DirectLauncher`` notes each launch here while a recording is active, the
``cu_seqlens`` search notes the scratch buffer it writes (:func:`note_scratch`), and
``_plans`` (a first call), ``autograd`` (a replayed call's first backward) and
``serving.api`` start and stop recordings. A leaf: it imports nothing of the package and not
triton, so that the layers above the launcher start a recording without entering it.
"""

from __future__ import annotations

import contextlib
import threading

import torch


class _Recording(threading.local):
    # The launches of this thread while ``recording()`` is active (for mlarope._plans), each
    # with its arguments; None otherwise. Per thread, so that one thread's launch is never
    # taken for another's.
    launches: Recorded | None = None


_recording = _Recording()


class Recorded(list):
    """The launches a :func:`recording` block made, ``(launch, args)`` in order, and in
    ``scratch`` the buffers its launches made and wrote before a later launch read them (the
    ``cu_seqlens`` search's positions: :func:`note_scratch`)."""

    __slots__ = ("scratch",)

    def __init__(self) -> None:
        super().__init__()
        self.scratch: list[torch.Tensor] = []


def note_scratch(buffer: torch.Tensor) -> None:
    """Declare ``buffer`` (new, contiguous) a scratch buffer that the next launch writes whole:
    a plan replaying the launches allocates one of its shape and dtype instead."""
    recorded = _recording.launches
    if recorded is not None:
        recorded.scratch.append(buffer)


def start_recording() -> tuple[Recorded, Recorded | None]:
    """Collect, in order, every launch this thread makes through a ``DirectLauncher`` from now
    until :func:`stop_recording` with the second value returned (what was collecting
    before): ``(launch, args)``, with the scratch buffers they wrote (:class:`Recorded`)."""
    launches = Recorded()
    previous, _recording.launches = _recording.launches, launches
    return launches, previous


def stop_recording(previous: Recorded | None) -> None:
    _recording.launches = previous


@contextlib.contextmanager
def recording():
    """:func:`start_recording` for the block: ``with recording() as launches: ...``."""
    launches, previous = start_recording()
    try:
        yield launches
    finally:
        stop_recording(previous)
