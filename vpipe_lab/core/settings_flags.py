"""The command-line flags of a job's settings, derived from ``Settings``' fields: ``add_flags`` puts a door's flags on
its parser (``%vpipe start``, ``vpipe-lab run``, ``vpipe-lab worker``), ``from_args`` reads them back."""

from __future__ import annotations

import argparse
from typing import Any

from vpipe_lab.core.report import parse_bytes
from vpipe_lab.core.settings import Settings, default, door_defaults, door_fields, meta_of


class Offered(tuple[str, ...]):
    """Choices argparse lists (in --help and for tab completion) but lets through: ``Settings.validated`` refuses a
    wrong one with the same words at every door, where argparse's own refusal would differ from the API's."""

    def __contains__(self, item: object) -> bool:
        return True


def byte_size(text: str) -> int:
    """An argparse type for a memory size ("8GiB", "512MiB", bytes): ``core.report.parse_bytes`` with argparse's
    error, so every command line reports a bad size alike."""
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_TYPES: dict[str, Any] = {"int": int, "int | None": int, "float": float, "float | None": float, "str": str,
                          "str | None": str, "Any": str}


def flag(name: str) -> str:
    """The long option of setting ``name``."""
    return "--" + name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, door: str) -> None:
    """Every setting ``door`` takes, as flags named after the fields, with their help and that door's defaults."""
    for f in door_fields(door):
        meta, value = meta_of(f), default(f, door)
        shown = "" if value is None or isinstance(value, bool) else f" (default: {value})"
        helptext = (meta.help + shown).replace("%", "%%")  # argparse formats help with %
        names = [flag(f.name), *meta.flags]
        kind = str(f.type)
        if kind == "bool" or kind.startswith("bool | dict"):  # a switch: on where it is off by default, and back
            if value:
                parser.add_argument(f"--no-{f.name.replace('_', '-')}", dest=f.name, action="store_false",
                                    default=value, help=f"do not {helptext[0].lower()}{helptext[1:]}")
            else:
                parser.add_argument(*names, dest=f.name, action="store_true", default=value, help=helptext)
        elif kind == "bool | int":  # on, off, or on from a size
            parser.add_argument(*names, dest=f.name, type=int, default=value, metavar="N", help=helptext)
            parser.add_argument(f"--no-{f.name.replace('_', '-')}", dest=f.name, action="store_false",
                                help=f"turn {f.name} off")
        else:
            parse = meta.parse or (byte_size if f.name == "memory_budget" else _TYPES.get(kind))
            if parse is None:
                raise TypeError(f"setting {f.name} has type {kind}, which has no command-line form: give its "
                                "Meta a parse function")
            choices = Offered(meta.choices()) if meta.choices else None
            parser.add_argument(*names, dest=f.name, type=parse, default=value, choices=choices, help=helptext,
                                metavar="{" + ",".join(choices) + "}" if choices else None)


def from_args(args: argparse.Namespace, door: str, **derived: Any) -> Settings:
    """The settings a parsed command line gives at ``door`` (not yet validated), with ``derived`` ones (what that
    door takes from elsewhere, such as a torchrun worker's stage count) set beside them."""
    given = {f.name: getattr(args, f.name) for f in door_fields(door)}
    return Settings(**{**door_defaults(door), **given, **derived})
