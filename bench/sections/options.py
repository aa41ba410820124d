"""Typed options of the benchmark: every flag of ``bench/run.py`` is a field of one dataclass, declared by
:func:`option` with its flag and help, and the parser is generated from those fields (``bench/sections/config.py``).

A section module owns its options (``Config``); the options every section reads are :class:`CommonConfig`, those
of the parent process alone :class:`RunConfig`. A child process gets the whole configuration as JSON and rebuilds
the same dataclasses (:func:`from_dict`), so a section reads ``config.encode.docs``, never a string key.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

BENCH = Path(__file__).resolve().parents[1]  # the bench/ folder
SECTIONS = ("peak", "encode", "index", "search", "train", "growth", "peer", "peer-search", "memory",
            "batched")  # run order
# Run only when named in --sections: peer-search builds PyLate's own indexes over the whole corpus in another Python.
DEFAULT_SECTIONS = tuple(section for section in SECTIONS if section != "peer-search")


def option(flag: str, default: Any, help: str | None = None, *, type: Callable[[str], Any] | None = None,
           choices: tuple[str, ...] | None = None, switch: bool = False, metavar: str | None = None) -> Any:
    """A dataclass field read from ``flag``: its ``type`` defaults to the default's (str, int, float); a
    ``switch`` is a flag without a value (``store_true``)."""
    metadata = {"flag": flag, "help": help, "type": type, "choices": choices, "switch": switch, "metavar": metavar}
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def comma_list(text: str) -> tuple[str, ...]:
    """``"a,b,,c"`` -> ``("a", "b", "c")``; the empty string is the empty tuple (a section skipped)."""
    return tuple(part for part in text.split(",") if part)


def comma_ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in comma_list(text))


def add_options(parser: argparse.ArgumentParser, prefix: str, config_class: type) -> None:
    """One argument per field of ``config_class``, its value stored under ``<prefix>.<field>``, in a group of the
    help text named after ``prefix`` and described by the class's docstring."""
    group = parser.add_argument_group(prefix, (config_class.__doc__ or "").strip().split("\n\n")[0] or None)
    for spec in fields(config_class):
        meta = spec.metadata
        default = spec.default if spec.default is not MISSING else spec.default_factory()  # type: ignore[misc]
        dest = f"{prefix}.{spec.name}"
        if meta["switch"]:
            group.add_argument(meta["flag"], dest=dest, action="store_true", help=meta["help"])
            continue
        kind = meta["type"] or (type(default) if isinstance(default, (str, int, float)) else str)
        metavar = meta["metavar"] or (None if meta["choices"] else meta["flag"].lstrip("-").replace("-", "_").upper())
        group.add_argument(meta["flag"], dest=dest, type=kind, default=default, choices=meta["choices"],
                           help=meta["help"], metavar=metavar)


def from_namespace(args: argparse.Namespace, prefix: str, config_class: type) -> Any:
    """The ``config_class`` instance the parsed ``args`` give for ``prefix``."""
    return config_class(**{spec.name: getattr(args, f"{prefix}.{spec.name}") for spec in fields(config_class)})


def from_dict(config_class: type, values: dict[str, Any]) -> Any:
    """A dataclass back from its JSON form (lists become the tuples the fields hold)."""
    return config_class(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


@dataclass(frozen=True)
class CommonConfig:
    """What every section reads: the data, the model and the machine's share."""

    dataset: str = option("--dataset", "scifact")
    split: str = option("--split", "test")
    model: str = option("--model", "sentence-transformers/all-MiniLM-L6-v2")
    export: str | None = option("--export", None, "a trained export/ckpt: searched as well (its nDCG@10)")
    threads: int = option("--threads", 2)
    seed: int = option("--seed", 12345)
    doc_maxlen: int = option("--doc-maxlen", 180)
    batch_size: int = option("--batch-size", 32)
    chunk_docs: int = option("--chunk-docs", 2048, "documents encoded per chunk when indexing")
    docs: int | None = option("--docs", None, "corpus slice (judged docs + sampled others)", type=int)
    queries: int | None = option("--queries", None, "query slice for the corpus subset", type=int)
    calibration_docs: int = option("--calibration-docs", 32, "int8: documents to calibrate on")
    k: int = option("--k", 100, "documents returned per query")
    omp_wait_policy: str = option("--omp-wait-policy", "PASSIVE", "OMP_WAIT_POLICY of the children (PASSIVE "
                                  "suits a shared machine; default: unset, OpenMP's spin-then-sleep, the fastest "
                                  "search on an idle one)", choices=("PASSIVE", "ACTIVE", "default"))
    work: str = option("--work", str(BENCH / "work"), "index folder (reused between runs)")


@dataclass(frozen=True)
class RunConfig:
    """What the parent process alone reads: which sections, where the results go, how p-values are adjusted."""

    name: str | None = option("--name", None, "results name (default: <dataset>-<model>[-quick])")
    output: str | None = option("--output", None, "JSON path (default bench/results/<name>.json)")
    quick: bool = option("--quick", False, "a < 3 min run: few documents and queries", switch=True)
    sections: tuple[str, ...] = option("--sections", DEFAULT_SECTIONS, f"comma-separated subset of {SECTIONS} "
                                       "(default: all but peer-search)", type=comma_list)
    section_timeout: float | None = option("--section-timeout", None, "seconds per child (default none)",
                                           type=float)
    p_adjust: str = option("--p-adjust", "holm", "multiple-comparison adjustment of the search variants' paired "
                           "tests against exact search: holm (Holm-Bonferroni), bh (Benjamini-Hochberg) or none",
                           choices=("holm", "bh", "none"))
    table: str | None = option("--table", None, "only print the table of a results file", metavar="JSON")


@dataclass(frozen=True)
class Job:
    """One child process: a section and what it measures (an index variant, a training arch and model, a growth
    factor, a chunk size); ``label`` names its row of results."""

    label: str
    section: str
    variant: str | None = None
    arch: str | None = None
    train_model: str | None = None
    factor: int | None = None
    chunk: int | None = None


def job_json(config: Any, job: Job) -> str:
    """What ``--child-config`` carries: the whole configuration and the job."""
    from dataclasses import asdict

    return json.dumps({"config": asdict(config), "job": asdict(job)})
