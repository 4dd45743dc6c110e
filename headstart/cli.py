"""The `headstart` command: the composition root of the subcommands in headstart/commands/.

This is the one place that brings every part together (heads, runtime, train). At the top it imports only
what the parser needs, so `headstart --help` loads no torch; each subcommand imports its own needs. A user
error gets one line and exit 2, never a traceback; so does a subcommand whose install extra is missing.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

from headstart import __version__
from headstart.commands import bench, checkpoints, data, decode, serving
from headstart.commands.common import Parser, UserError, with_flags
from headstart.extras import COMMANDS, MissingExtraError, require

GROUPS = (decode, bench, data, serving, checkpoints)  # each registers its subcommands (`add_parsers`)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="headstart", description="Exact self-speculative decoding.")
    parser.add_argument("--version", action="version", version=f"headstart {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for group in GROUPS:
        group.add_parsers(sub)
    return parser


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> str:
    return f"headstart: warning: {message}\n"


def main(argv: Sequence[str] | None = None) -> int:
    warnings.formatwarning = _one_line_warning  # what a user reads is the message, not the line that warned
    argv = list(argv) if argv is not None else sys.argv[1:]
    try:
        args = build_parser().parse_args(argv)
        if args.command in COMMANDS:
            require(COMMANDS[args.command], f"headstart {args.command}")
        return args.run(args, argv)
    except (UserError, ValueError, MissingExtraError) as e:
        print(f"headstart: error: {with_flags(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("headstart: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
