"""The command line: `splitserve <command>`'s parser and entry point (`entry.py`), the commands
that run one service (`serve.py`: gateway, prefill, decode) and those that move workers between
roles (`roles.py`: role, planner). What the commands start lives in `splitserve.launch` and
`splitserve.roles`, imported when a command runs, so that `--help` loads neither.
"""

from splitserve.cli.entry import build_parser, main

__all__ = ["build_parser", "main"]
