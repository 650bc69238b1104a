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


def _all_commands(parser: argparse.ArgumentParser, name: str) -> dict[str, argparse.ArgumentParser]:
    """Every command, nested ones too (`bench serve`), by its full name."""
    found = {}
    for sub_name, sub in _subcommands(parser).items():
        full = f"{name} {sub_name}".strip()
        found[full] = sub
        found.update(_all_commands(sub, full))
    return found


def test_every_flag_of_every_command_has_help():
    commands = _all_commands(build_parser({}), "")
    assert "bench serve" in commands
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
