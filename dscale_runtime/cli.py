"""Shared command-line plumbing: a dataclass's CLI whose defaults come from one section of a YAML file.

`configs/<target>.yaml` holds one section per job (`collect:`, `train:`); a job's CLI takes that section
as its defaults and every field of its config dataclass as an override. jsonargparse generates the options
from the dataclass (types, field docstrings as help); they are spelled `--dashed-names` like dscale-serve's,
the field's own `--underscored_name` staying an alias (hidden from --help).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml


def dashed(option: str) -> str:
    """`--max_new_tokens` -> `--max-new-tokens`."""
    return "--" + option[2:].replace("_", "-")


def _help_formatter():
    from jsonargparse import DefaultHelpFormatter

    class DashedHelpFormatter(DefaultHelpFormatter):
        """--help lists the dashed spelling of each option only."""

        def _format_action_invocation(self, action) -> str:
            spellings = action.option_strings
            shown = [s for s in spellings if not (s.startswith("--") and "_" in s)]
            if not shown or shown == spellings:
                return super()._format_action_invocation(action)
            action.option_strings = shown
            try:
                return super()._format_action_invocation(action)
            finally:
                action.option_strings = spellings

    return DashedHelpFormatter


def add_dashed_spellings(parser) -> None:
    """Give every `--x_y` option the spelling `--x-y` too, listed first (usage and help show it)."""
    for action in parser._actions:
        for option in list(action.option_strings):
            if not option.startswith("--") or "_" not in option:
                continue
            spelling = dashed(option)
            if spelling in parser._option_string_actions:
                continue
            action.option_strings.insert(0, spelling)
            parser._option_string_actions[spelling] = action


def section_parser(prog: str, description: str | None, config_cls, section: str, config_path: str | None,
                   extra: tuple[tuple[str, dict], ...] = ()):
    """A jsonargparse parser for `config_cls` with defaults from `section` of the YAML at `config_path`.

    `extra`: further options (name, add_argument kwargs), e.g. the `--config` that chose the YAML."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(prog=prog, description=description, default_env=False,
                            formatter_class=_help_formatter())
    parser.add_class_arguments(config_cls)
    for name, kwargs in extra:
        parser.add_argument(name, **kwargs)
    add_dashed_spellings(parser)
    if config_path:
        path = Path(config_path)
        if not path.is_file():
            parser.error(f"{path}: no such config file")
        values = (yaml.safe_load(path.read_text()) or {}).get(section)
        if values is None:
            parser.error(f"{path}: no '{section}:' section")
        parser.set_defaults(**values)
    return parser


def pre_parse(argv: list[str], *options: tuple[str, str | None]) -> argparse.Namespace:
    """Read a few options (name, default) before the full parser exists (they choose its defaults); each is
    read in its dashed and its underscored spelling."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for name, default in options:
        spellings = dict.fromkeys([dashed(name), name])
        pre.add_argument(*spellings, default=default, dest=name[2:].replace("-", "_"))
    return pre.parse_known_args(argv)[0]
