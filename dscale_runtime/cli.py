"""Shared command-line plumbing: a dataclass's CLI whose defaults come from one section of a YAML file.

`configs/<target>.yaml` holds one section per job (`collect:`, `train:`); a job's CLI takes that section
as its defaults and every field of its config dataclass as an override.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml


def section_parser(prog: str, description: str | None, config_cls, section: str, config_path: str | None):
    """A jsonargparse parser for `config_cls` with defaults from `section` of the YAML at `config_path`."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(prog=prog, description=description, default_env=False)
    parser.add_class_arguments(config_cls)
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
    """Read a few options (name, default) before the full parser exists (they choose its defaults)."""
    pre = argparse.ArgumentParser(add_help=False)
    for name, default in options:
        pre.add_argument(name, default=default)
    return pre.parse_known_args(argv)[0]
