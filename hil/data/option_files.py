"""YAML option files for the commands with argparse parsers (``hil beir``, ``hil paper``, ``hil analyze``,
``hil teacher``, ``hil share``), in the Lightning convention that ``hil fit`` / ``hil evaluate`` follow.

    hil beir --model colbert=runs/colbert/export --datasets scifact --print_config > beir.yaml
    hil beir --config beir.yaml --datasets scifact,nfcorpus       # options after --config win

An option file is a YAML mapping from option names (``datasets``, ``index-root`` or ``index_root``) to values:
a scalar for an option that takes one value, a list for a repeatable option (``model: [a=..., b=...]``), true or
false for a flag. ``--config`` may be given several times; files are read in order, then the command line, so a
later file or an option given on the command line wins (a repeatable option accumulates). ``--print_config`` prints
the options as they resolved, as an option file, and exits: what it prints, given back with ``--config``, is the
same run. A key the command does not know, or a value of the wrong shape, is one line naming the file and the
key (exit 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

import yaml

from hil.data.errors import UserError

CONFIG_OPTION, PRINT_OPTION = "--config", "--print_config"


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Option actions by destination (help, and options without a long name, left out)."""
    return {action.dest: action for action in parser._actions
            if action.option_strings and action.dest != "help"
            and any(option.startswith("--") for option in action.option_strings)}


def _long_option(action: argparse.Action) -> str:
    return next(option for option in action.option_strings if option.startswith("--"))


def option_tokens(path: str | Path, parser: argparse.ArgumentParser) -> list[str]:
    """The command-line tokens an option file stands for (file and key named in every error)."""
    try:
        values = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise UserError(f"{CONFIG_OPTION} {path}: cannot be read ({error.strerror or error})") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise UserError(f"{CONFIG_OPTION} {path}{where}: not valid YAML") from None
    if values is None:
        return []
    if not isinstance(values, dict):
        raise UserError(f"{CONFIG_OPTION} {path}: a mapping of option names to values expected, got "
                        f"{type(values).__name__}")
    actions = _actions(parser)
    by_name = {option[2:].replace("-", "_"): action for action in actions.values()
               for option in action.option_strings if option.startswith("--")}  # every long name of an option
    tokens: list[str] = []
    for key, value in values.items():
        action = actions.get(str(key).replace("-", "_")) or by_name.get(str(key).replace("-", "_"))
        if action is None:
            raise UserError(f"{CONFIG_OPTION} {path}: unknown key {key!r} (options: "
                            f"{', '.join(sorted(_long_option(a)[2:] for a in actions.values()))})")
        option = _long_option(action)
        if action.nargs == 0:  # a flag: store_true / store_false
            if not isinstance(value, bool):
                raise UserError(f"{CONFIG_OPTION} {path}: key {key!r} is a flag: true or false (got {value!r})")
            if value != action.default:
                tokens.append(option)
        elif isinstance(action, argparse._AppendAction):
            for item in value if isinstance(value, list) else [value]:
                tokens += [option, _scalar(path, key, item)]
        elif value is not None:
            tokens += [option, _scalar(path, key, value)]
    return tokens


def _scalar(path: str | Path, key: Any, value: Any) -> str:
    if isinstance(value, (dict, list)):
        raise UserError(f"{CONFIG_OPTION} {path}: key {key!r} takes one value (got {type(value).__name__})")
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def resolved_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The parsed options as an option file writes them (option names with dashes; flags as booleans)."""
    actions = _actions(parser)
    return {_long_option(action)[2:]: getattr(args, dest) for dest, action in actions.items()
            if dest not in ("config", "print_config") and hasattr(args, dest)}


def parse_with_option_files(parser: argparse.ArgumentParser,
                            argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``parser.parse_args`` with ``--config FILE`` (repeatable) and ``--print_config`` (module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(isinstance(action, _ConfigMarker) for action in parser._actions):
        parser.add_argument(CONFIG_OPTION, action=_ConfigMarker, default=[], metavar="FILE",
                            help="a YAML file of options (repeatable; options after it win): see --print_config")
        parser.add_argument(PRINT_OPTION, action="store_true",
                            help="print the options as resolved, as a YAML file for --config, and exit")
    tokens: list[str] = []
    rest: list[str] = []
    position = 0
    while position < len(argv):
        token = argv[position]
        if token == CONFIG_OPTION or token.startswith(CONFIG_OPTION + "="):
            if "=" in token:
                path = token.split("=", 1)[1]
            elif position + 1 < len(argv):
                position += 1
                path = argv[position]
            else:
                raise UserError(f"{CONFIG_OPTION} needs a file")
            tokens += option_tokens(path, parser)
        else:
            rest.append(token)
        position += 1
    args = parser.parse_args(tokens + rest)
    if getattr(args, "print_config", False):
        sys.stdout.write(yaml.safe_dump(resolved_options(args, parser), sort_keys=False))
        raise SystemExit(0)
    return args


class _ConfigMarker(argparse.Action):
    """``--config`` as the help lists it; the files themselves are read before parsing."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        pass
