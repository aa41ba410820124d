"""The data module's spelling before 0.3 -- one key per reader and per reader setting (``data.triples``,
``data.teacher_output``, ``data.run_depth``, ...) -- read as ``data.source``, the reader chosen by ``class_path``,
with one deprecation line that names the new spelling. Removed in 0.4.0 (``hil.compat.SHIMS``).

Both ways in take it: ``TrainingDataModule(triples=...)`` (:func:`reader_from_old_keys`) and a config file or
command line of ``hil fit`` (:func:`add_old_keys` registers the keys, hidden; :func:`respell_old_keys` turns them
into ``data.source`` before the config is checked or printed, so ``--print_config`` prints the new spelling).

An old key that names a reader (``triples``, ``id_triples``, ``beir``, ``nway_examples``, ``run``, ``pylate``,
``teacher_output``) replaces ``data.source``, whichever file set that; an old setting of a reader (``queries``,
``run_depth``, ...) applies to the reader it names, or to ``data.source`` when that is its reader. The refusals are
those of before 0.3: two readers, texts without a reader that takes them, a setting another reader owns.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import import_module
from typing import Any, Mapping

from hil.errors import UserError

_TEXTS = ("IdTriples", "NWayExamples", "TrecRun", "PyLateExamples")  # the readers that take queries and collection
# old key -> the reader it names (its class path) and the setting it fills there
SOURCE_KEYS = {
    "triples": ("hil.data.triples_file.TextTriples", "path"),
    "id_triples": ("hil.data.triples_file.IdTriples", "path"),
    "beir": ("hil.data.triples.MinedTriples", "dataset"),
    "nway_examples": ("hil.data.nway_files.NWayExamples", "path"),
    "run": ("hil.data.run_examples.TrecRun", "path"),
    "pylate": ("hil.data.pylate_files.PyLateExamples", "path"),
    "teacher_output": ("hil.data.teacher_output.TeacherOutput", "path"),
}
# old key -> the readers that take it (class names), its name there, and its default before 0.3
SETTING_KEYS: dict[str, tuple[tuple[str, ...], str, Any]] = {
    "queries": (_TEXTS, "queries", None),
    "collection": (_TEXTS, "collection", None),
    "beir_split": (("MinedTriples",), "split", "train"),
    "negatives_per_query": (("MinedTriples",), "negatives_per_query", 1),
    "bm25_depth": (("MinedTriples",), "depth", 100),
    "qrels": (("TrecRun",), "qrels", None),
    "run_depth": (("TrecRun",), "depth", None),
    "run_selection": (("TrecRun",), "selection", "top"),
    "run_positives": (("TrecRun",), "positives", "none"),
    "run_targets": (("TrecRun",), "targets", "scores"),
    "relevance_level": (("TrecRun",), "relevance_level", 1),
    "short_queries": (("TrecRun",), "short_queries", "error"),
}
# what the command line parses each old key as (its type before 0.3)
_INTEGERS = ("negatives_per_query", "bm25_depth", "relevance_level")
OLD_KEY_TYPES: dict[str, Any] = {
    **{key: str | None for key in (*SOURCE_KEYS, "queries", "collection", "qrels")},
    **{key: str for key in ("beir_split", "run_selection", "run_positives", "run_targets", "short_queries")},
    **{key: int for key in _INTEGERS}, "run_depth": int | None}


def _name(class_path: str) -> str:
    return class_path.rsplit(".", 1)[-1]


def source_from_old_keys(old: Mapping[str, Any], source: Mapping[str, Any] | None) -> tuple[dict[str, Any], str]:
    """The reader (``{"class_path", "init_args"}``) that the old keys ``old`` mean over ``source`` (the reader
    already chosen, in that form; None: none), and the deprecation line naming it. A combination that was refused
    before 0.3 is refused the same way (:class:`UserError`)."""
    unknown = sorted(set(old) - set(OLD_KEY_TYPES))
    if unknown:
        raise TypeError(f"TrainingDataModule: unexpected arguments {', '.join(unknown)}")
    chosen = [key for key in SOURCE_KEYS if old.get(key) is not None]
    if len(chosen) > 1:
        raise UserError(f"data: give exactly one of `triples`, `id_triples`, `beir`, `nway_examples`, `run`, `pylate` "
                        f"and `teacher_output` (better: one data.source); got {chosen}")
    if chosen:
        key = chosen[0]
        class_path, setting = SOURCE_KEYS[key]
        new = {"class_path": class_path, "init_args": {setting: old[key]}}
        texts = [name for name in ("queries", "collection") if old.get(name) is not None]
        if key == "teacher_output" and texts:
            raise UserError("data.teacher_output reads `queries` and `collection` from its .meta.json: give neither")
        if _name(class_path) in _TEXTS and len(texts) < 2:
            raise UserError(f"data: `{key}`, `queries` and `collection` go together (`queries` and `collection` "
                            f"hold the texts by id)")
        if key in ("triples", "beir") and texts:
            raise UserError("data: `queries` and `collection` go together with `id_triples`, `nway_examples`, "
                            "`run` or `pylate`")
    elif source is not None:
        new = {"class_path": source["class_path"], "init_args": dict(source.get("init_args") or {})}
    else:
        new = None
    for key, value in old.items():
        if key not in SETTING_KEYS:
            continue
        readers, setting, default = SETTING_KEYS[key]
        if new is not None and _name(new["class_path"]) in readers:
            new["init_args"][setting] = value
        elif value != default:
            owner = _name(new["class_path"]) if new is not None else "no reader"
            raise UserError(f"data.{key} only applies to {' / '.join(readers)}, not to {owner}: give it as "
                            f"data.source.init_args.{setting} of its reader")
    if new is None:
        raise UserError("data.source: give the training data's reader, e.g. {class_path: "
                        "hil.data.triples_file.TextTriples, init_args: {path: msmarco/triples.train.small.tsv}}")
    line = (f"data.{', data.'.join(old)} {'is' if len(old) == 1 else 'are'} deprecated (removed in 0.4.0): "
            f"write data.source: {json.dumps(new)}")
    return new, line


def reader_from_old_keys(old: Mapping[str, Any], source: Any) -> Any:
    """``TrainingDataModule``'s old keyword arguments over its ``source`` (an ``ExampleReader`` or None): the
    reader they mean, with a ``DeprecationWarning`` naming the new spelling."""
    import warnings

    new, line = source_from_old_keys(old, source.record() if source is not None else None)
    warnings.warn(f"TrainingDataModule: {line}", DeprecationWarning, stacklevel=3)
    module, _, name = new["class_path"].rpartition(".")
    return getattr(import_module(module), name)(**new["init_args"])


def add_old_keys(parser: Any, group: str = "data") -> None:
    """Register the old keys under ``group`` of a LightningCLI parser, hidden from ``--help`` and from printed
    configs (absent unless given)."""
    for key, kind in OLD_KEY_TYPES.items():
        parser.add_argument(f"--{group}.{key}", type=kind, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def respell_old_keys(config: Any, prog: str = "hil fit", group: str = "data") -> None:
    """Turn the old keys of ``group`` in a jsonargparse ``config`` into its ``source``, in place, with one deprecation
    line on stderr. Called on each ``--config`` file as it is read (``group`` at the top: the file's own keys, in
    the order the files come) and on the whole command line (``group`` under the subcommand: the files merged, with
    the command line's own keys). A file that sets a reader's setting but no reader leaves it to the whole, where
    the reader the files chose is known."""
    top = vars(config).get(group)
    spaces = [(top, True)] if hasattr(top, "as_dict") else []
    spaces += [(vars(value).get(group), False) for value in vars(config).values() if hasattr(value, "as_dict")]
    for data, one_file in spaces:
        if not hasattr(data, "as_dict"):
            continue
        given = {key: value for key, value in vars(data).items() if key in OLD_KEY_TYPES}
        source = data.get("source")
        names_reader = any(given.get(key) is not None for key in SOURCE_KEYS)
        if not given or (one_file and source is None and not names_reader):
            continue
        for key in given:
            data.pop(key)
        new, line = source_from_old_keys(given, source.as_dict() if hasattr(source, "as_dict") else source)
        space = type(data)
        data["source"] = space(class_path=new["class_path"], init_args=space(**new["init_args"]))
        sys.stderr.write(f"{prog}: warning: {line}\n")
