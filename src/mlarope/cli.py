"""``python -m mlarope``: demo, stress, bench and info.

Exit codes: 0 success; 1 a check failed (wrong elements, a missed correctness check); 2 bad
usage (argparse). Each subcommand's module provides ``add_arguments(parser)`` and ``run(args)``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "demo": ("mlarope.demo", "a DeepSeek-V3-shaped MLA attention step through mlarope, checked"),
    "stress": ("mlarope.stress", "randomized trials against the fp64 reference + racy control"),
    "bench": ("mlarope.bench", "GPU benchmark against the copy ceiling, reference and Megatron"),
    "info": ("mlarope.cli", "versions, backend and device"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``info`` takes no options."""


def run(args: argparse.Namespace) -> int:
    """``info``: print versions, the backend each device would use, and the devices present."""
    import os

    import torch
    from rich.console import Console
    from rich.table import Table

    import mlarope
    from mlarope import _plans

    table = Table(title="mlarope info", show_header=False)
    table.add_row("mlarope", mlarope.__version__)
    table.add_row("python", sys.version.split()[0])
    table.add_row("torch", torch.__version__)
    try:
        import triton

        table.add_row("triton", triton.__version__)
    except ImportError:  # pragma: no cover - triton is a dependency
        table.add_row("triton", "not installed")
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
    table.add_row("eager plan guard", _plans.guard_kind())
    Console().print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mlarope",
        description="Fused, race-free MLA rotary position embedding: tools.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return importlib.import_module(COMMANDS[args.command][0]).run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
