"""A launch path for our Triton kernels that skips Triton's per-call argument binding.

``kernel[grid](*args)`` costs about 40 µs of host time per call on the H200 machine for our
24-32 argument kernels (docs/benchmarks.md, host profile): Triton binds the arguments, builds
a specialization of every argument, turns its options into a string for the cache key, builds
launch metadata for the hooks, and only then calls the compiled launcher. For a decode step
that launch is most of the call.

:class:`DirectLauncher` keeps, per kernel, the compiled kernel of every specialization it has
launched, under a key that determines Triton's own cache key (equal keys, equal Triton keys):

- constexpr arguments, and ints Triton specializes: their values (finer than Triton's ``== 1``
  / ``% 16`` / integer-width classes, so a key never maps to a kernel compiled for other
  assumptions);
- ints Triton does not specialize (``do_not_specialize``): their range class, which is all
  Triton keeps of them (i32, i64 or u64);
- tensors: Triton's own specialization function (``native_specialize_impl``, what its
  generated binder calls: dtype and 16-byte alignment), with the binder's flags;
- the current device and ``num_warps`` (the only launch option we pass).

A key seen before launches the cached kernel's compiled launcher directly. A new key goes
through ``kernel[grid](...)`` (Triton compiles or finds the kernel) and stores what it returns.
Whenever Triton would do more than launch, the call takes Triton's own path: launch hooks set
(profilers), ``TRITON_DEBUG``, instrumentation, pre-run hooks, and any non-CUDA tensor (the
interpreter in the CPU lane).
"""

from __future__ import annotations

import torch
from triton import knobs
from triton._C.libtriton import native_specialize_impl

from .._launch_cache import LAUNCH_CACHE, MAX_ENTRIES
from .._recording import (  # noqa: F401 (recording's names, where the launcher was their home)
    Recorded,
    _recording,
    note_scratch,
    recording,
    start_recording,
    stop_recording,
)


class _Kernel:
    """A compiled kernel's launch entry. Where the kernel needs no scratch memory (ours do
    not), Triton's C launcher is called without its Python wrapper (``CudaLauncher.__call__``,
    which only allocates scratch memory and forwards); hooks are never passed (see
    ``_through_triton``)."""

    __slots__ = ("compiled", "cooperative", "function", "metadata", "pdl", "raw")

    def __init__(self, compiled) -> None:
        launcher = compiled.run  # loads the kernel's module on first use
        self.compiled = compiled
        self.function = compiled.function
        self.metadata = compiled.packed_metadata
        scratch = getattr(launcher, "global_scratch_size", 1) or getattr(
            launcher, "profile_scratch_size", 1
        )
        self.raw = None if scratch else getattr(launcher, "launch", None)
        self.cooperative = getattr(launcher, "launch_cooperative_grid", False)
        self.pdl = getattr(launcher, "launch_pdl", False)

    def launch(self, g0: int, g1: int, g2: int, device: int, args) -> None:
        stream = torch._C._cuda_getCurrentRawStream(device)
        raw = self.raw
        if raw is None:
            self.compiled.run(
                g0, g1, g2, stream, self.function, self.metadata, None, None, None, *args
            )
        else:
            raw(
                g0, g1, g2, stream, self.function, self.cooperative, self.pdl, None, None,
                self.metadata, None, None, None, *args,
            )  # fmt: skip


class Launch:
    """One kernel launch that can be made again with other arguments of the same
    specialization: ``launch(args)`` (tensors in the same slots, same dtypes and alignment)."""

    __slots__ = ("device", "grid", "kernel", "launcher", "num_warps")

    def __init__(self, launcher: DirectLauncher, grid, num_warps: int, kernel, device: int):
        self.launcher = launcher
        self.grid = _grid3(grid)
        self.num_warps = num_warps
        self.kernel = kernel  # a _Kernel; None: launched through Triton (interpreter, hooks)
        self.device = device

    def __call__(self, args) -> None:
        kernel = self.kernel
        if kernel is None or _through_triton(self.launcher.fn):
            self.launcher.fn[self.grid](*args, num_warps=self.num_warps)
            return
        g0, g1, g2 = self.grid
        kernel.launch(g0, g1, g2, self.device, args)


class DirectLauncher:
    """``launcher(grid, num_warps, *args)``: launch ``fn`` with ``args`` in its signature order
    (constexprs included), on the current device and stream, as ``fn[grid](*args,
    num_warps=num_warps)`` would."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self._name = getattr(fn, "__name__", repr(fn))
        self._kernels: dict[tuple, _Kernel] = LAUNCH_CACHE.kernels_of(self)
        self._backend = None
        # Under TRITON_INTERPRET=1 ``fn`` is Triton's interpreter, which has no compiled
        # kernels: every call takes ``fn[grid](...)``.
        self._interpreted = not hasattr(fn, "params")
        if self._interpreted:
            self._n_args = len(fn.arg_names)
            return
        self._n_args = len(fn.params)
        self._key = _make_key_function(fn)

    def __call__(self, grid: tuple[int, ...], num_warps: int, *args) -> None:
        if len(args) != self._n_args:
            raise TypeError(f"{self._name} takes {self._n_args} arguments, got {len(args)}")
        if self._interpreted or not args[0].is_cuda or _through_triton(self.fn):
            self.fn[grid](*args, num_warps=num_warps)
            recorded = _recording.launches
            if recorded is not None:
                recorded.append((Launch(self, grid, num_warps, None, -1), args))
            return
        device = torch._C._cuda_getDevice()
        backend = self._backend
        kernel = None
        if backend is not None:
            kernel = self._kernels.get(self._key(backend, device, num_warps, *args))
        if kernel is None:
            kernel = self._launch_through_triton(device, grid, num_warps, args)
            if kernel is None:  # a jit_cache_hook took the launch over: nothing to keep
                recorded = _recording.launches
                if recorded is not None:  # nor may a plan be made of the other launches
                    recorded.append((None, args))
                return
        else:
            kernel.launch(*_grid3(grid), device, args)
        recorded = _recording.launches
        if recorded is not None:
            recorded.append((Launch(self, grid, num_warps, kernel, device), args))

    def _launch_through_triton(self, device, grid, num_warps, args) -> _Kernel | None:
        compiled = self.fn[grid](*args, num_warps=num_warps)
        if compiled is None:
            return None
        if self._backend is None:
            # The backend object Triton's binder passes to native_specialize_impl.
            self._backend = self.fn.device_caches[device][3]
        key = self._key(self._backend, device, num_warps, *args)
        if hasattr(compiled, "result"):  # asynchronous compilation returns a future
            compiled = compiled.result()
        if len(self._kernels) >= MAX_ENTRIES:
            self._kernels.clear()
        kernel = self._kernels[key] = _Kernel(compiled)
        return kernel


def _make_key_function(fn):
    """``key(backend, device, num_warps, *args)``: the cache key of a launch (module docstring).

    Generated per kernel, as Triton generates its binder: one expression per argument, no loop
    (a Python loop over 32 arguments cost more than Triton's whole binder).
    """
    parts = []
    for i, p in enumerate(fn.params):
        a = f"a{i}"
        if p.is_constexpr:
            parts.append(a)
        elif p.annotation_type:
            # The binder types annotated arguments itself; our kernels have none.
            raise TypeError(f"{fn.__name__}: annotated argument {p.name} is not supported")
        elif p.do_not_specialize:
            # Triton types an unspecialized int by its range only: i32, i64 or u64.
            parts.append(
                f"((-0x80000000 <= {a} <= 0x7FFFFFFF, {a} < 0x8000000000000000) "
                f"if {a}.__class__ is int else spec(backend, {a}, {p.is_const}, False, "
                f"{not p.do_not_specialize_on_alignment}))"
            )
        else:
            parts.append(
                f"({a} if {a}.__class__ is int else spec(backend, {a}, {p.is_const}, True, "
                f"{not p.do_not_specialize_on_alignment}))"
            )
    names = ", ".join(f"a{i}" for i in range(len(fn.params)))
    source = (
        f"def key(backend, device, num_warps, {names}):\n"
        f"    return (device, num_warps, {', '.join(parts)})\n"
    )
    namespace = {"spec": native_specialize_impl}
    exec(source, namespace)  # built from the kernel's own parameter list
    return namespace["key"]


def _through_triton(fn) -> bool:
    """True when Triton's launch would do more than launch (launch or pre-run hooks, debug
    mode, instrumentation): then ``fn[grid](...)`` must make it."""
    runtime = knobs.runtime
    return bool(
        fn.pre_run_hooks
        or _hooks_set(runtime.launch_enter_hook)
        or _hooks_set(runtime.launch_exit_hook)
        or runtime.debug
        or knobs.compilation.instrumentation_mode
    )


def _grid3(grid: tuple[int, ...]) -> tuple[int, int, int]:
    return (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)


def _hooks_set(hook) -> bool:
    """Triton 3.6 keeps launch hooks in a ``HookChain`` (empty: ``.calls == []``); a hook
    assigned directly is a callable."""
    return bool(getattr(hook, "calls", hook))
