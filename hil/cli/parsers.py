"""The one option system of every ``hil`` command: jsonargparse, whose errors are one line.

Every command line of the package -- ``hil fit`` (LightningCLI, :class:`TrainingParser`) and every other
subcommand, ``evaluate.py`` and the tools (:class:`CommandParser`) -- parses with jsonargparse, so they share:

- one key style: ``--index_root`` (as ``hil fit``'s ``--trainer.max_steps``); the dashed spelling
  (``--index-root``) is accepted too, so that the commands of earlier releases keep working;
- ``--config FILE`` (repeatable, options after it win; a recipe of the package by name: ``--config eval/plaid``)
  and ``--print_config``, which prints the options as resolved, as a file for ``--config``: given back, the same run;
- errors as one line, ``<prog>: error: <message> (options: <prog> --help)``, exit status 2; a key of a ``--config``
  file is named with its file and line (``beir.yaml:3: Option 'modle' is not accepted``). ``HIL_DEBUG=1`` keeps
  jsonargparse's own report.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser, DefaultHelpFormatter

from hil.errors import DEBUG_ENV, one_line
from hil.paths import resolve_config

CONFIG_OPTION = "--config"


def resolve_config_arguments(args: Sequence[str]) -> list[str]:
    """``--config colbert_hil`` (or ``eval/plaid``, ``presets/smoke``): the package's recipe of that name
    (:func:`hil.paths.resolve_config`), so the YAML files work after ``pip install`` from any folder. Paths that
    exist, and anything else, are passed on unchanged."""
    resolved = list(args)
    for i, arg in enumerate(resolved):
        if arg == CONFIG_OPTION and i + 1 < len(resolved):
            resolved[i + 1] = resolve_config(resolved[i + 1])
        elif arg.startswith(CONFIG_OPTION + "="):
            resolved[i] = f"{CONFIG_OPTION}=" + resolve_config(arg.removeprefix(CONFIG_OPTION + "="))
    return resolved


def config_files(argv: Sequence[str]) -> list[str]:
    """The ``--config`` files of a command line, in order."""
    files = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == CONFIG_OPTION]
    return files + [arg.split("=", 1)[1] for arg in argv if arg.startswith(CONFIG_OPTION + "=")]


def located(message: str, argv: Sequence[str]) -> str:
    """``message`` prefixed with the ``--config`` file and line that hold the key it names (``Option 'x'``,
    ``Parser key "a.x"``), when one does; else as it is."""
    named = re.search(r"[Oo]ption '([^']+)'", message) or re.search(r'[Kk]ey "([^"]+)"', message)
    files = config_files(argv)
    if named is None or not files:
        return message
    key = named.group(1).split(".")[-1]
    for file in reversed(files):  # later files win: the last one naming the key is the one read
        try:
            lines = Path(file).read_text(encoding="utf-8").splitlines()
        except OSError:
            continue
        for number, line in enumerate(lines, 1):
            if re.match(rf"\s*(- )?{re.escape(key)}\s*:", line) or re.search(rf"[{{,]\s*{re.escape(key)}\s*:", line):
                return f"{file}:{number}: {message}"
    return message


def yaml_problem(file: str) -> str | None:
    """``<file>:<line>: not valid YAML (<what>)`` when ``file`` is a readable file that YAML cannot parse; else None
    (a missing file is jsonargparse's to report)."""
    try:
        text = Path(file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    try:
        yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        return f"{file}{where}: not valid YAML ({getattr(error, 'problem', None) or 'unreadable'})"
    return None


class OneLineErrors:
    """What both parser classes add to jsonargparse's: package recipes for ``--config``, and one-line errors that
    name the ``--config`` file and line of a refused key (the module docstring)."""

    argv: list[str] = []  # the command line last parsed, recipes resolved (``located`` reads its --config files)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # argparse would read ``--trainer.max_step 3`` as ``--trainer.max_steps 3`` (a prefix of one option), which a
        # --config file refuses: an option is spelled out on the command line as in a file.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Sequence[str] | None = None, *rest: Any, **kwargs: Any) -> Any:
        self.argv = resolve_config_arguments(sys.argv[1:] if args is None else args)
        for file in config_files(self.argv):  # jsonargparse names neither the file nor the line of a YAML error
            if (problem := yaml_problem(file)) is not None:
                self.error(problem)
        return super().parse_args(self.argv, *rest, **kwargs)  # type: ignore[misc]

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if os.environ.get(DEBUG_ENV) or not self.exit_on_error:  # type: ignore[attr-defined]
            super().error(message, ex)  # type: ignore[misc]
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")  # type: ignore[attr-defined]
        refused = located(" ".join(one_line(message).split()), self.argv)
        sys.stderr.write(f"{prog}: error: {refused} (options: {prog} --help)\n")
        self.exit(2)  # type: ignore[attr-defined]


def plain_text(text: str | None) -> str | None:
    """A docstring as a terminal shows it: reST's markup taken out (````x```` -> ``x``, ``:class:`~a.b.C``` ->
    ``C``, ``:func:`a.f``` -> ``a.f``, a literal block's ``::`` -> ``:``)."""
    if not text:
        return text
    text = re.sub(r":[a-z]+:`~[\w.]*\.(\w+)`", r"\1", text)  # :class:`~hil.x.Y` -> Y (the short form asked for)
    text = re.sub(r":[a-z]+:`([^`]+)`", r"\1", text)
    text = re.sub(r"``([^`]+)``", r"\1", text)
    return re.sub(r"::$", ":", text, flags=re.MULTILINE)


class HelpFormatter(DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """jsonargparse's help, with the description and epilog (a command's docstring) laid out as written, and every
    text -- docstrings of the settings classes included -- as plain text (:func:`plain_text`)."""

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain_text(text) or "")

    def start_section(self, heading: str | None) -> None:
        super().start_section(plain_text(heading))

    def _expand_help(self, action: argparse.Action) -> str:
        return plain_text(super()._expand_help(action)) or ""


class CommandParser(OneLineErrors, ArgumentParser):
    """The parser of every command but ``hil fit``: jsonargparse with ``--config`` / ``--print_config`` built in, and
    every long option under its underscore name with the dashed spelling accepted beside it."""

    flags: list[str] = []  # the dests of store_true / store_false options

    def __init__(self, *args: Any, config_option: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        if config_option:
            super().add_argument(CONFIG_OPTION, action=ActionConfigFile,
                                 help="a YAML file of options (repeatable; options after it win), or a recipe's "
                                      "name; see --print_config")

    def add_argument(self, *names: str, **kwargs: Any) -> Any:
        """``--index-root`` (or ``--index_root``) is added as ``--index_root``, the key in ``--config`` files, with
        ``--index-root`` accepted beside it."""
        spelled: list[str] = []
        for name in names:
            if name.startswith("--") and "." not in name:  # a class's nested keys keep jsonargparse's own names
                key = name[2:]
                both = dict.fromkeys(("--" + key.replace("-", "_"), "--" + key.replace("_", "-")))
                spelled += [n for n in both if n not in spelled]
            elif name not in spelled:
                spelled.append(name)
        action = super().add_argument(*spelled, **kwargs)
        if kwargs.get("action") in ("store_true", "store_false"):
            self.flags = [*self.flags, action.dest]
        return action

    def parse_args(self, args: Sequence[str] | None = None, *rest: Any, **kwargs: Any) -> Any:
        """As jsonargparse's, and a flag set from a file must be true or false (argparse's ``store_true`` takes any
        value a YAML file gives it)."""
        parsed = super().parse_args(args, *rest, **kwargs)
        for flag in self.flags:
            if not isinstance(value := parsed.get(flag), bool):
                self.error(f"Option '{flag}' is a flag: true or false (got {value!r})")
        return parsed


@dataclass(frozen=True)
class Renamed:
    """An old spelling of a settings parser's option (``--out``), kept for a release (a row of
    :data:`hil.compat.SHIMS`): read as ``new`` with a deprecation line; ``split``: its value was a comma-separated
    list, now the repeated option (``--models a=x,b=y`` -> ``--model a=x --model b=y``)."""

    new: str
    split: bool = False
    removed_in: str = "0.4.0"


TRUTH_VALUES = ("true", "false", "True", "False")


class SettingsParser(CommandParser):
    """The parser of a command whose options are the fields of one settings dataclass (``add_class_arguments``,
    each field's text from the class docstring's ``Args:``), as ``hil evaluate`` parses ``Experiment``: a ``bool``
    field is also a bare flag (``--quiet`` is ``--quiet true``), a list field is repeatable (``--model a --model
    b``, accumulating over ``--config`` files as ``--model+``), the leading words of the command line fill the
    ``positional`` fields in order, and each old spelling of ``renamed`` still works with a deprecation line.
    :meth:`settings` makes the dataclass, whose errors name keys in backquotes, shown as options."""

    def __init__(self, settings: type, *args: Any, renamed: dict[str, Renamed] | None = None,
                 positional: Sequence[str] = (), **kwargs: Any) -> None:
        import dataclasses
        import typing

        super().__init__(*args, **kwargs)
        self.settings_class = settings
        self.add_class_arguments(settings, nested_key=None, fail_untyped=False)
        hints = typing.get_type_hints(settings)
        names = [field.name for field in dataclasses.fields(settings)]
        self.bare_flags = {name for name in names if hints[name] is bool}
        self.repeatable = {name for name in names if typing.get_origin(hints[name]) is list}
        self.renamed = {old.lstrip("-").replace("-", "_"): spelling for old, spelling in (renamed or {}).items()}
        self.positional = tuple(positional)

    def respelled(self, argv: Sequence[str]) -> list[str]:
        """``argv`` in the parser's own spelling (the class docstring): a word that is no option's value fills the
        next ``positional`` field; a list option takes the words after it, each appended (``--metrics a b``, as
        argparse's ``nargs="*"`` did)."""
        argv, out, positional, i = list(argv), [], list(self.positional), 0
        while i < len(argv):
            arg = argv[i]
            name, equals, value = arg.partition("=")
            key = name[2:].replace("-", "_") if name.startswith("--") else None
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            spelling = self.renamed.get(key) if key else None
            if not arg.startswith("-"):
                out += [f"--{positional.pop(0)}", arg] if positional else [arg]
            elif spelling is not None:
                once = " once per value" if spelling.split else ""
                sys.stderr.write(f"{self.prog}: warning: {name} is deprecated (removed in {spelling.removed_in}): use "
                                 f"--{spelling.new}{once}\n")
                if not equals and nxt is not None:
                    value, i = nxt, i + 1
                values = [part for part in value.split(",") if part] if spelling.split else [value]
                argv[i + 1:i + 1] = [item for part in values for item in (f"--{spelling.new}", part)]
            elif key in self.bare_flags and not equals and (nxt is None or nxt not in TRUTH_VALUES):
                out.append(f"--{key}=true")
            elif key in self.repeatable and not (value if equals else (nxt or "")).startswith("["):
                out += [f"--{key}+={value}"] if equals else []
                while i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                    out += [f"--{key}+", argv[i + 1]]
                    i += 1
            elif key is not None and not equals and key not in ("help", "print_config") and nxt is not None:
                out += [arg, nxt]  # an option and its value (never a positional word)
                i += 1
            else:
                out.append(arg)
            i += 1
        return out

    def parse_args(self, args: Sequence[str] | None = None, *rest: Any, **kwargs: Any) -> Any:
        return super().parse_args(self.respelled(sys.argv[1:] if args is None else args), *rest, **kwargs)

    def settings(self, parsed: Any) -> Any:
        """The settings dataclass of a parsed command line; a refused setting's key is named as the option."""
        values = namespace_dict(parsed)
        return as_options(lambda: self.settings_class(**values))


def as_options(work: Callable[[], Any]) -> Any:
    """``work()``, with the keys a :class:`~hil.errors.UserError` names in backquotes (```nway```: the settings'
    spelling, below the command line) shown as the options they are (``--nway``)."""
    from hil.errors import UserError

    try:
        return work()
    except UserError as error:
        error.args = (re.sub(r"`(\w+)`", r"--\1", str(error)), *error.args[1:])
        raise


def module_doc(module: str) -> tuple[str, str]:
    """The docstring of ``module`` as a parser's (description, epilog): its first paragraph and the rest, read from
    the source without importing it (a command's ``--help`` loads nothing of what the command runs)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec(module)
    source = Path(spec.origin).read_text(encoding="utf-8") if spec is not None and spec.origin else ""
    summary, _, details = (ast.get_docstring(ast.parse(source)) or "").partition("\n\n")
    return summary, details


def namespace_dict(namespace: Any) -> dict[str, Any]:
    """A parsed command line as a plain dict, without ``--config`` (the files are not a setting: what they set is)."""
    values = namespace.as_dict() if hasattr(namespace, "as_dict") else dict(vars(namespace))
    values.pop("config", None)
    values.pop("__path__", None)
    return values


def returns_status(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """A command's ``main(argv)`` that returns the parser's own exit status (0 after ``--help`` or
    ``--print_config``, 2 after a refused option, its one line already printed) instead of raising ``SystemExit``:
    every ``main`` returns its status, called from Python as from a console script."""

    @functools.wraps(main)
    def status(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except SystemExit as stop:
            return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 2)

    return status
