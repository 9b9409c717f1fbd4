"""The help every `verl-p2p` command prints: each option's text ends with its default, written as a user types it.

argparse's `ArgumentDefaultsHelpFormatter` shows Python values (`None`, `False`, `('a', 'b')`); this one shows a
flag as on/off and a list as a comma list, and leaves a text that already says `(default: ...)` alone (the place
for a default that depends on other options, or for what `None` stands for).
"""

from __future__ import annotations

import argparse
from typing import Any


def plain(value: Any) -> str:
    """A default as it would be typed on the command line."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple, set, frozenset)):
        return ",".join(plain(v) for v in value)
    return str(value)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`(default: X)` after every option's help, X in `plain` form; a flag (no value) shows on/off."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.required or action.default is argparse.SUPPRESS or "(default" in text:
            return text
        shown = plain(bool(action.default) if action.nargs == 0 else action.default)
        return f"{text} (default: {shown.replace('%', '%%')})".lstrip()


def parser(prog: str, description: str | None) -> argparse.ArgumentParser:
    """An `ArgumentParser` for one `verl-p2p` command, with this help."""
    return argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter)
