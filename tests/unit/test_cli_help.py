"""Every flag and argument of every `splitserve` command says what it is in `--help` (flags
hidden on purpose, `argparse.SUPPRESS`, excepted)."""

from __future__ import annotations

import argparse

from splitserve.cli import build_parser


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def test_every_flag_of_every_command_has_help():
    commands = _subcommands(build_parser({}))
    assert {"up", "gateway", "prefill", "decode", "generate", "offline"} <= set(commands)
    missing = [
        f"splitserve {name} {'/'.join(action.option_strings) or action.dest}"
        for name, sub in commands.items()
        for action in sub._actions
        if not isinstance(action, argparse._HelpAction)
        and not (action.help and action.help.strip())
    ]
    assert not missing, missing


def test_the_gateway_documents_the_tool_call_parser():
    help_text = _subcommands(build_parser({}))["gateway"].format_help()
    assert "--tool-call-parser" in help_text and "hermes" in help_text
