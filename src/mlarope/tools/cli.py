"""``python -m mlarope`` and the ``mlarope`` command: demo, stress, bench and info.

Exit codes: 0 success; 1 a check failed (wrong elements, a missed correctness check); 2 bad
usage (argparse), or the command cannot run here (``bench`` without a CUDA device, ``stress``
with neither a CUDA device nor Triton's interpreter, a missing or too old Triton). Each
subcommand's module provides ``add_arguments(parser)`` and ``run(args)``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch

import mlarope
from mlarope import _launch_plans

from ._console import Console, Table

COMMANDS = {
    "demo": (
        "mlarope.tools.demo",
        "a DeepSeek-V3-shaped MLA attention step through mlarope, checked",
    ),
    "stress": (
        "mlarope.tools.stress",
        "randomized trials against the fp64 reference + racy control",
    ),
    "bench": (
        "mlarope.tools.bench",
        "GPU benchmark against the copy ceiling, reference and Megatron",
    ),
    "info": (
        "mlarope.tools.cli",
        "versions, backend and device; the MLA families of the installed transformers",
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``info`` takes no options."""


def run(args: argparse.Namespace) -> int:
    """``info``: print versions, the backend each device would use, the devices present, and
    which MLA families of the installed transformers mlarope patches (and why not)."""
    table = Table(title="mlarope info", show_header=False)
    table.add_column("item")
    table.add_column("value")
    table.add_row("mlarope", mlarope.__version__)
    table.add_row("python", sys.version.split()[0])
    table.add_row("torch", torch.__version__)
    table.add_row("triton", _triton_status())
    table.add_row("numpy", _version_of("numpy"))
    interpreter = os.environ.get("TRITON_INTERPRET", "0") == "1"
    table.add_row(
        "TRITON_INTERPRET", "1 (CPU tensors run the Triton kernels)" if interpreter else "0"
    )
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            table.add_row(f"cuda:{i}", f"{torch.cuda.get_device_name(i)} -> Triton kernels")
    else:
        table.add_row("cuda", "not available")
    table.add_row("cpu", "Triton kernels (interpreter)" if interpreter else "PyTorch reference")
    table.add_row("eager plan guard", _launch_plans.guard_kind())
    console = Console()
    console.print(table)
    console.print(_transformers_families(Table))
    return 0


def _transformers_families(table_class):
    """The MLA families of the installed transformers: patched by mlarope, or not and why."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        return "transformers: not installed (mlarope.integrations.transformers needs it)"
    from mlarope.integrations.transformers import family_report

    table = table_class(title=f"transformers {_dist_version('transformers')}: MLA families")
    for header in ("family", "mlarope", "rotary functions, or why not"):
        table.add_column(header)
    for row in family_report(cache=True):
        status = row.status + (" (off by default)" if row.off_by_default else "")
        detail = row.detail() + (f"; {row.off_by_default}" if row.off_by_default else "")
        table.add_row(row.name, status, detail)
    return table


def _dist_version(dist: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _version_of(module: str) -> str:
    try:
        return importlib.import_module(module).__version__
    except ImportError:
        return "not installed"


def _triton_status() -> str:
    """Triton's version, or why the kernels cannot use it."""
    try:
        import triton
    except ImportError:
        return "not installed (CPU tensors run the PyTorch reference)"
    try:
        import mlarope.kernels  # noqa: F401 (checks the version)
    except ImportError as exc:
        return f"{triton.__version__}: {exc}"
    return triton.__version__


def build_parser() -> argparse.ArgumentParser:
    # The console script (``mlarope``) or ``python -m mlarope``, as the user typed it.
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    parser = argparse.ArgumentParser(
        prog="mlarope" if script == "mlarope" else "python -m mlarope",
        description="Fused, race-free MLA rotary position embedding: tools.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        try:
            importlib.import_module(module).add_arguments(command)
        except ImportError as exc:
            # A command whose module cannot be imported here (no Triton, or one too old for the
            # kernels) says why when run; the other commands, ``info`` first, still work.
            command.set_defaults(import_error=str(exc))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command is None and not unknown:
        # No command: what the tools are and how to run them, as --help says (exit 0).
        parser.print_help()
        return 0
    error = getattr(args, "import_error", None)
    if error is not None:
        print(f"mlarope {args.command}: cannot run here: {error}", file=sys.stderr)
        return 2
    if unknown or args.command is None:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return importlib.import_module(COMMANDS[args.command][0]).run(args)
    except BrokenPipeError:
        # The reader left (``mlarope info | head``): stop quietly, as a pipeline expects; the
        # rest of the output, and Python's flush at exit, go nowhere.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
