"""Every compatibility shim of the package, with what replaces it and the release that removes it.

Two kinds:
- **spellings** (an old option, argument or name kept beside its replacement): each warns when used, and goes in
  ``removed_in``. ``tests/test_compat.py`` checks that each is still where this table says, and fails once the
  package's version reaches its ``removed_in``: the shim is then deleted, with this row.
- **readers of old artifacts** (indexes, exports, results files written by an earlier version): kept while such
  files exist (``removed_in`` None); each reads the old layout as the version that wrote it meant it.

The command aliases stay: ``train.py`` / ``hil-train`` are ``hil fit`` (the same LightningCLI, the same options);
``evaluate.py`` / ``hil-evaluate`` are the one-model, one-dataset shortcut with flat options (``--k``, ``--mode``)
where ``hil evaluate`` takes an experiment (``--settings.k``); both on the one option system (:mod:`hil.cli.parsers`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shim:
    """``old`` (found in ``module`` as written) is replaced by ``new``; removed in ``removed_in`` (None: kept)."""

    old: str
    module: str
    new: str
    removed_in: str | None


SHIMS = (
    # spellings from before 0.2 (typed back-end settings replaced FAISS-only names)
    Shim("--faiss", "hil/cli/evaluate_script.py", "--backend", "0.3.0"),
    Shim("--faiss-params", "hil/cli/evaluate_script.py", "--backend-params", "0.3.0"),
    Shim("--faiss", "hil/cli/beir.py", "--backend", "0.3.0"),
    Shim("--faiss", "hil/cli/analyze.py", "--backend", "0.3.0"),
    Shim("backend_params", "hil/evaluation/settings.py", "EvaluationSettings(backend=IndexConfig, search=SearchConfig)",
         "0.3.0"),
    Shim("ncandidates", "hil/evaluation/settings.py", "SearchConfig.ncandidates", "0.3.0"),
    Shim("faiss_kind", "hil/retrieval/builder.py", "build_index(backend=...)", "0.3.0"),
    Shim("def rebuild_faiss", "hil/retrieval/structures.py", "rebuild_search_structures", "0.3.0"),
    Shim("faiss_kind", "hil/retrieval/transformed.py", "derive_index(backend=...)", "0.3.0"),
    Shim("FAISS_KINDS", "hil/retrieval/backends/registry.py", "BACKEND_KINDS", "0.3.0"),
    Shim("faiss_settings = backend_settings", "hil/retrieval/index.py", "TokenIndex.backend_settings", "0.3.0"),
    Shim("TrainingLoss = Term", "hil/modeling/terms.py", "hil.modeling.terms.Term", "0.3.0"),
    Shim('name == "TriplesDataModule"', "hil/data/datamodule.py", "hil.data.datamodule.TrainingDataModule", "0.3.0"),
    # spellings of 0.2 (issue 39: one name per idea across the commands, as hil evaluate spells them)
    Shim("--models", "hil/cli/engines.py", "--model NAME=PATH, repeated", "0.4.0"),
    Shim("--out", "hil/cli/engines.py", "--output", "0.4.0"),
    Shim("--n_bootstrap", "hil/cli/engines.py", "--bootstrap_samples", "0.4.0"),
    Shim("--out", "hil/cli/paper.py", "--output", "0.4.0"),
    # module moves of 0.2 (the user-facing errors at the bottom layer; the command lines in hil.cli)
    Shim("from hil.errors import *", "hil/data/errors.py", "hil.errors", "0.3.0"),
    Shim("from hil.cli.main import main", "hil/console.py", "hil.cli.main (a hil script installed before 0.2)",
         "0.3.0"),
    Shim("MOVED = ", "hil/cli/__init__.py", "hil.cli.train.train_main, hil.cli.evaluate_script.main", "0.3.0"),
    # views of 0.2's two back-end registries, now one (hil.retrieval.backends.configs.REGISTRY)
    Shim('"INDEX_CONFIGS"', "hil/retrieval/backends/configs.py", "REGISTRY[kind].index_config", "0.4.0"),
    Shim('"SEARCH_CONFIGS"', "hil/retrieval/backends/configs.py", "REGISTRY[kind].search_config", "0.4.0"),
    Shim('"BACKEND_KINDS"', "hil/retrieval/backends/configs.py",
         "backend_kinds() (a command's --backend choices: BACKEND_CHOICES)", "0.4.0"),
    Shim('name == "BACKENDS"', "hil/retrieval/backends/base.py", "hil.retrieval.backends.configs.REGISTRY", "0.4.0"),
    Shim('name == "BACKENDS"', "hil/retrieval/backends/registry.py", "backend_class(kind), backend_classes()",
         "0.4.0"),
    Shim('name == "BACKEND_KINDS"', "hil/retrieval/backends/registry.py",
         "hil.retrieval.backends.configs.backend_kinds()", "0.4.0"),
    # the data module's key per reader and per reader setting of 0.2 (data.triples, data.run_depth, ...): one reader
    Shim("SOURCE_KEYS = {", "hil/data/old_source_keys.py", "data.source: {class_path: <reader>, init_args: ...}",
         "0.4.0"),
    Shim("**old_keys", "hil/data/datamodule.py", "TrainingDataModule(source=<an ExampleReader>)", "0.4.0"),
    Shim("add_old_keys(parser)", "hil/cli/train.py", "data.source in hil fit's configs and command line", "0.4.0"),
    # readers of artifacts written by earlier versions
    Shim('"faiss"', "hil/retrieval/index.py", 'index.json "backend" (indexes written before 0.2)', None),
    Shim("LEGACY_SEARCH_PARAMS", "hil/retrieval/index.py", "search-time settings outside index.json (before 0.2)",
         None),
    Shim("written before hil recorded file sizes", "hil/retrieval/integrity.py",
         "index.json's file records (older indexes open unverified, with a warning)", None),
    Shim("identities made before it existed", "hil/evaluation/identity.py",
         "query_encoding in a column's identity only when set", None),
    Shim("written before adjusted p-values existed", "hil/experiments/report.py",
         "results without adjusted p-values read as unadjusted", None),
    Shim("written before ``attend_to_mask_tokens`` existed", "hil/modeling/encoder_settings.py",
         "exports and checkpoints without the v1 conventions keep the convention they were trained with", None),
)
