"""The command line: one module per subcommand, each with `add_parser(subparsers)` and `run(args) -> int`.

Bad input never shows a traceback: argument errors and `ValueError`s raised while checking input end in
one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import import_module
from types import ModuleType

from zero_core.cli.errors import UsageError
from zero_core.long_lived import freeze_what_is_loaded

COMMANDS = {"compare": "compare", "table": "table", "plan": "plan", "check-planner": "check_planner"}
"""Each command's module in this package, imported when the parser is built: importing one module of the package
(`zero_core.cli.render`, which the grader's `scores` prints with) loads no command, and with them torch."""


def command_module(command: str) -> ModuleType:
    return import_module(f"zero_core.cli.{COMMANDS[command]}")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, as argparse does but without the usage block
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(2)


DESCRIPTION = """ZeRO, measured. `compare` trains ZeRO-0..3 on N virtual GPUs and shows their memory,
traffic and losses side by side; `table` gives the paper's memory and traffic per GPU for any model
and N; `plan` finds on how many GPUs each stage fits a model, or ranks the configurations on a
machine's nodes; `check-planner` sets the planner beside DeepSpeed, Megatron-Core and the virtual
cluster, with its error."""
EXAMPLES = """examples:
  python -m zero_core compare --world-size 32
  python -m zero_core table --params 7.5B --gpus 64 --gpu-memory 32GB
  python -m zero_core plan --params 13B --gpu-memory 40GB
  python -m zero_core plan --params 70B --gpu-memory 80GB --nodes 32 --machine dgx-h100
  python -m zero_core plan --machine list     (the machine presets, their figures and sources)
  python -m zero_core check-planner
Sizes take their unit (32GB, 40GiB, 50GB/s, 5us). python -m zero_core COMMAND --help lists the
options of one command."""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m zero_core",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in COMMANDS:
        command_module(command).add_parser(subparsers)
    return parser


_NEGATIVE_VALUE = re.compile(r"^-\.?\d")


def attach_negative_values(argv: list[str]) -> list[str]:
    """`--params -13B` as `--params=-13B`: argparse takes a value that starts with '-' and is not a plain
    number for an option, and would say "expected one argument" instead of why the value is wrong."""
    joined: list[str] = []
    for arg in argv:
        if joined and joined[-1].startswith("--") and "=" not in joined[-1] and _NEGATIVE_VALUE.match(arg):
            joined[-1] = f"{joined[-1]}={arg}"
        else:
            joined.append(arg)
    return joined


def main(argv: list[str] | None = None, *, program: bool = False) -> int:
    """Run one command on `argv` (default: the process's arguments). `program`: the process is this command's
    (`python -m zero_core`), so what the parser loaded stays off the cycle collector (`zero_core.long_lived`);
    a caller that goes on with other work in its process (a test) leaves its objects alone."""
    args = build_parser().parse_args(attach_negative_values(sys.argv[1:] if argv is None else argv))
    if program:
        freeze_what_is_loaded()
    try:
        return command_module(args.command).run(args)
    except UsageError as error:
        sys.stderr.write(f"python -m zero_core {args.command}: error: {error}\n")
        return 2
