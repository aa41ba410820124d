"""The BEIR datasets of HIL (001) Table 2, in its order, and where each one is found.

Each dataset is a :class:`BeirSet`: BEIR's own name (the ``--datasets`` name and the output folder), Table 2's row
label, and how it is evaluated. Two are special:

- CQADupStack is twelve StackExchange forums, each its own BEIR folder (``cqadupstack/<forum>``); BEIR reports the
  mean of the forums' scores as one number, so each forum is evaluated on its own and the row is their mean
  (:mod:`hil.experiments.beir_table`).
- TREC DL19 and DL20 (``msmarco/dl19``, ``msmarco/dl20``) ship a first-stage run
  (:data:`~hil.experiments.profiles.RERANKING_SETS`, one table for both): each is re-ranked, not fully ranked, and
  that run is its BM25 column. Like MS MARCO dev, they are in-domain for a model trained on MS MARCO, so they are
  not in the average (001: "The Avg. performance does not include MSMARCO").

A dataset is *local* when ``<data dir>/beir/<folder>`` or ``<data dir>/<folder>`` holds ``corpus.jsonl`` and
``queries.jsonl`` (a folder of the same name without them, such as the MS MARCO triples folder, is not BEIR's).
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path

from hil.errors import UserError
from hil.experiments.profiles import FIRST_STAGES, RERANKING_SETS, FirstStage
from hil.paths import DATA_DIR_ENV

CQADUPSTACK_FORUMS = ("android", "english", "gaming", "gis", "mathematica", "physics", "programmers", "stats", "tex",
                      "unix", "webmasters", "wordpress")


@dataclass(frozen=True)
class BeirSet:
    """One row of Table 2.

    Args:
        key: BEIR's name: what ``--datasets`` takes and the output folder's name.
        label: the row's label in Table 2.
        folder: where it lies under the data dir, when not at ``key``.
        split: the qrels split evaluated; None (every set): the dataset's own, as every command takes it
            (:func:`hil.data.beir.default_split`: ``test``, MS MARCO's ``dev``).
        in_average: counted in the average (the zero-shot sets).
        forums: CQADupStack's sub-datasets, each under ``<folder>/<forum>``; the row is their mean.
    """

    key: str
    label: str
    folder: str | None = None
    split: str | None = None
    in_average: bool = True
    forums: tuple[str, ...] = ()

    @property
    def first_stage(self) -> FirstStage | None:
        """The run it ships, re-ranked instead of a full ranking (TREC DL19, DL20), or None."""
        return FIRST_STAGES.get(self.key)

    @property
    def parts(self) -> tuple[str, ...]:
        """What is evaluated one by one, as paths under the data dir and the output folder: the forums, or itself."""
        where = self.folder or self.key
        return tuple(f"{where}/{forum}" for forum in self.forums) or (where,)


# 001 Table 2's rows (MS MARCO dev, then the 18 BEIR sets), with the TREC DL re-ranking sets beside MS MARCO.
BEIR_SETS: tuple[BeirSet, ...] = (
    BeirSet("msmarco", "MS MARCO (dev)", in_average=False),  # dev: hil.data.beir.default_split
    *(BeirSet(key, reranking.label, folder=reranking.folder, in_average=False)
      for key, reranking in RERANKING_SETS.items()),
    BeirSet("trec-covid", "TREC-COVID"),
    BeirSet("bioasq", "BioASQ"),
    BeirSet("nfcorpus", "NFCorpus"),
    BeirSet("nq", "NQ"),
    BeirSet("hotpotqa", "HotpotQA"),
    BeirSet("fiqa", "FiQA-2018"),
    BeirSet("signal1m", "Signal-1M (RT)"),
    BeirSet("trec-news", "TREC-NEWS"),
    BeirSet("robust04", "Robust04"),
    BeirSet("arguana", "ArguAna"),
    BeirSet("webis-touche2020", "Touché-2020"),
    BeirSet("cqadupstack", "CQADupStack", forums=CQADUPSTACK_FORUMS),
    BeirSet("quora", "Quora"),
    BeirSet("dbpedia-entity", "DBPedia"),
    BeirSet("scidocs", "SCIDOCS"),
    BeirSet("fever", "FEVER"),
    BeirSet("climate-fever", "Climate-FEVER"),
    BeirSet("scifact", "SciFact"),
)
BY_KEY = {beir_set.key: beir_set for beir_set in BEIR_SETS}


def data_root(data_dir: str | os.PathLike | None) -> Path | None:
    """``--data-dir``, else ``$HIL_DATA_DIR``, else None."""
    value = data_dir if data_dir is not None else os.environ.get(DATA_DIR_ENV)
    return Path(value).expanduser() if value else None


def local_folder(part: str, root: Path | None) -> Path | None:
    """The BEIR folder of ``part`` (``scifact``, ``cqadupstack/android``) under ``root``, or None."""
    if root is None:
        return None
    for candidate in (root / "beir" / part, root / part):
        if any((candidate / name).is_file() for name in ("corpus.jsonl", "corpus.jsonl.gz")) and \
                any((candidate / name).is_file() for name in ("queries.jsonl", "queries.jsonl.gz")):
            return candidate
    return None


@dataclass(frozen=True)
class Selection:
    """What a run evaluates: each set with the parts to load (local folders, or hub names), and what was not found."""

    sets: tuple[BeirSet, ...]
    parts: dict[str, tuple[str, ...]]  # set key -> its parts to evaluate
    local: dict[str, Path]             # part -> its local folder (absent: loaded from the hub)
    missing: tuple[str, ...]           # what of the chosen sets is left out (not found locally): sets, or forums


def select(names: str, data_dir: str | os.PathLike | None = None) -> Selection:
    """The sets ``--datasets`` names (``all``: every set found locally, the rest listed as missing; a
    comma-separated list: those sets, non-local ones from the hub, and of CQADupStack its local forums when any).

    Raises ``ValueError`` naming an unknown name, or saying that ``all`` found nothing.
    """
    root = data_root(data_dir)
    wanted = [name.strip() for name in names.split(",") if name.strip()]
    everything = wanted == ["all"]
    unknown = [name for name in wanted if name not in BY_KEY]
    if not wanted or (unknown and not everything):
        close = [match for name in unknown for match in difflib.get_close_matches(name, BY_KEY, n=1, cutoff=0.75)]
        hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
        raise ValueError(f"--datasets: unknown dataset {', '.join(map(repr, unknown)) or repr(names)}; {hint}give "
                         f"'all' or a comma-separated list of {', '.join(BY_KEY)}")
    chosen = BEIR_SETS if everything else tuple(s for s in BEIR_SETS if s.key in wanted)
    local = {part: folder for s in chosen for part in s.parts if (folder := local_folder(part, root)) is not None}
    parts = {s.key: _parts_to_run(s, local, hub=not everything) for s in chosen}
    parts = {key: found for key, found in parts.items() if found}
    missing = tuple(name for s in chosen for name in _left_out(s, parts.get(s.key, ())))
    if not parts:
        raise ValueError(f"--datasets {names}: no BEIR dataset found under {root} (looked for <dir>/beir/<name> and "
                         f"<dir>/<name> with corpus.jsonl and queries.jsonl; set --data-dir or {DATA_DIR_ENV})")
    return Selection(tuple(s for s in chosen if s.key in parts), parts, local, missing)


def check_selection(names: str, data_dir: str | os.PathLike | None = None) -> int:
    """:func:`select`'s refusal as a user error, else 0: what ``hil beir`` checks right after parsing, before any
    model (torch) code is imported, so that a misspelled name costs no model import."""
    try:
        select(names, data_dir)
    except ValueError as error:
        raise UserError(str(error)) from None
    return 0


def _parts_to_run(beir_set: BeirSet, local: dict[str, Path], hub: bool) -> tuple[str, ...]:
    """A set's parts found locally; when none is and the set was named, all of them (from the hub)."""
    found = tuple(part for part in beir_set.parts if part in local)
    return found or (beir_set.parts if hub else ())


def _left_out(beir_set: BeirSet, running: tuple[str, ...]) -> list[str]:
    """A set's parts not evaluated: its name when none is, else each missing forum."""
    gone = [part for part in beir_set.parts if part not in running]
    return [beir_set.key] if len(gone) == len(beir_set.parts) else gone


def evaluation_order(selection: Selection) -> list[tuple[BeirSet, str]]:
    """(set, part) pairs to evaluate: parts loaded from the hub first, so that one that cannot be reached ends the
    run before hours of local work; then the local ones in Table 2's order."""
    pairs = [(s, part) for s in selection.sets for part in selection.parts[s.key]]
    return sorted(pairs, key=lambda pair: pair[1] in selection.local)


def missing_notice(selection: Selection, root: Path | None) -> str | None:
    """One line listing the parts of Table 2 that were not found (None when nothing is missing)."""
    if not selection.missing:
        return None
    return (f"notice: {len(selection.missing)} BEIR datasets not found under {root} and left out: "
            f"{', '.join(selection.missing)}")

