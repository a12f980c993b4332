"""The Triton releases the kernels support, and what they need to run under each one's interpreter.

Supported: triton 3.6 (what the GPU lane compiles with) to 3.9 (the newest tested), each with
the numpy pip installs next to it (2.3 and 2.4 tested with 3.6, 2.4 with the others). Older
releases lack the launcher internals ``_launch`` uses: importing this module (the kernels
package does so first) raises an ImportError that names the supported versions instead.

Nothing here changes compiled code: ``loop_bound`` is the identity when compiling (the call
is inlined; the PTX for sm_90a is byte-identical), and only the interpreter takes the other
definition.
"""

from __future__ import annotations

import re

import triton

MIN_TRITON = (3, 6)
TESTED_TRITON = "3.6, 3.7, 3.8 and 3.9"


def triton_version_tuple(version: str) -> tuple[int, int]:
    """``"3.6.0"`` -> ``(3, 6)``; local or pre-release suffixes (``"3.7.0+git1a2b"``) ignored."""
    parts = re.match(r"(\d+)\.(\d+)", version)
    if parts is None:
        raise ValueError(f"cannot read a Triton version from {version!r}")
    return int(parts.group(1)), int(parts.group(2))


def check_triton_version(version: str | None = None) -> None:
    """Raise ImportError, naming the supported versions, when triton is older than 3.6."""
    version = getattr(triton, "__version__", "0.0") if version is None else version
    if triton_version_tuple(version) < MIN_TRITON:
        raise ImportError(
            f"mlarope's Triton kernels need triton >= {'.'.join(map(str, MIN_TRITON))} (tested: "
            f"{TESTED_TRITON}); this environment has triton {version}. Upgrade it with "
            f"pip install 'triton>={'.'.join(map(str, MIN_TRITON))}'. The PyTorch backend "
            "(CPU tensors without TRITON_INTERPRET=1) does not need Triton."
        )


# Before anything below touches Triton's internals (``knobs`` is recent).
check_triton_version()

# Triton decides at decoration time, from the same knob, whether @triton.jit compiles or
# interprets; this module follows that decision.
INTERPRETED = bool(triton.knobs.runtime.interpret)

if INTERPRETED:

    def loop_bound(x):
        """A kernel's run-time integer as a Python int, for a ``range`` bound.

        Interpreted kernels get their scalar arguments as 1-element numpy arrays. Triton 3.6's
        interpreter turns a ``range`` bound into a Python int with ``int(array)``, which
        numpy 2.4 rejects for arrays of one dimension ("only 0-dimensional arrays can be
        converted to Python scalars"); later interpreters squeeze the array first. Here the
        element is read directly, the same under every release and numpy.
        """
        handle = getattr(x, "handle", None)
        if handle is None:  # already a Python int or a constexpr
            return x
        return int(handle.data.reshape(-1)[0])

else:

    @triton.jit
    def loop_bound(x):
        """Compiled: the identity (the call is inlined away)."""
        return x
