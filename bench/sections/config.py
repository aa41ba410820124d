"""The benchmark's typed configuration: one dataclass per section (each section module's ``Config``), beside the
common and run options, assembled as :class:`BenchConfig`, with the parser generated from their fields.

``python bench/run.py --help`` lists the same flags as before the split; ``--quick`` is :func:`quick`.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from types import ModuleType
from typing import Any

from sections import batched as batched_section
from sections import encode as encode_section
from sections import growth as growth_section
from sections import index as index_section
from sections import memory as memory_section
from sections import peak as peak_section
from sections import peer as peer_section
from sections import peer_search as peer_search_section
from sections import search as search_section
from sections import train as train_section
from sections.options import SECTIONS, CommonConfig, RunConfig, add_options, from_dict, from_namespace

SECTION_MODULES: dict[str, ModuleType] = {
    "peak": peak_section, "encode": encode_section, "index": index_section, "search": search_section,
    "train": train_section, "growth": growth_section, "peer": peer_section,
    "peer-search": peer_search_section, "memory": memory_section, "batched": batched_section}
assert tuple(SECTION_MODULES) == SECTIONS


@dataclass(frozen=True)
class BenchConfig:
    """Every option of one benchmark run, by section (``config.encode.docs`` is ``--encode-docs``)."""

    common: CommonConfig = field(default_factory=CommonConfig)
    run: RunConfig = field(default_factory=RunConfig)
    peak: peak_section.Config = field(default_factory=peak_section.Config)
    encode: encode_section.Config = field(default_factory=encode_section.Config)
    index: index_section.Config = field(default_factory=index_section.Config)
    search: search_section.Config = field(default_factory=search_section.Config)
    train: train_section.Config = field(default_factory=train_section.Config)
    growth: growth_section.Config = field(default_factory=growth_section.Config)
    peer: peer_section.Config = field(default_factory=peer_section.Config)
    peer_search: peer_search_section.Config = field(default_factory=peer_search_section.Config)
    memory: memory_section.Config = field(default_factory=memory_section.Config)
    batched: batched_section.Config = field(default_factory=batched_section.Config)

    def record(self) -> dict[str, Any]:
        """The settings written into the results JSON (every option, by section)."""
        return asdict(self)


def _parts() -> list[tuple[str, type]]:
    """(attribute, config class) of every part of :class:`BenchConfig`, in the order of the help text."""
    return [(spec.name, spec.default_factory) for spec in fields(BenchConfig)]  # type: ignore[misc]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="hil speed / memory benchmark (see bench/run.py's docstring)")
    for name, config_class in _parts():
        add_options(parser, name, config_class)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-config", default=None, help=argparse.SUPPRESS)
    return parser


def quick(config: BenchConfig) -> BenchConfig:
    """``--quick``: a < 3 min run: few documents and queries, one repeat, no growth or peer."""
    common = config.common
    return replace(
        config, common=replace(common, docs=common.docs or 256, queries=common.queries or 40),
        run=replace(config.run, sections=tuple(s for s in config.run.sections if s != "peer")),
        peak=replace(config.peak, repeats=4),
        encode=replace(config.encode, docs=min(config.encode.docs, 64), repeats=1),
        search=replace(config.search, v1_queries=min(config.search.v1_queries, 5)),
        train=replace(config.train, steps=1, models=("bert-tiny-splade",)),
        growth=replace(config.growth, factors=()),
        memory=replace(config.memory, chunks=(64, 256), docs=256),
        batched=replace(config.batched, ks=(10,), rounds=1))


def make_config(args: argparse.Namespace) -> BenchConfig:
    """The typed configuration of the parsed command line (``--quick`` applied, the results name filled in);
    unknown sections or index variants stop the run (SystemExit) before any child starts."""
    config = BenchConfig(**{name: from_namespace(args, name, cls) for name, cls in _parts()})
    if config.run.quick:
        config = quick(config)
    check_sections(config.run.sections)
    index_section.check(config.index)
    peer_search_section.check(config.peer_search)
    name = config.run.name or f"{config.common.dataset}-{Path(config.common.model).name}" + \
        ("-quick" if config.run.quick else "")
    return replace(config, run=replace(config.run, name=name))


def check_sections(sections: tuple[str, ...]) -> None:
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        raise SystemExit(f"bench: unknown sections {bad}; known: {SECTIONS}")


def config_from_dict(values: dict[str, Any]) -> BenchConfig:
    """A :class:`BenchConfig` back from its JSON form (what a child process receives)."""
    return BenchConfig(**{name: from_dict(cls, values[name]) for name, cls in _parts()})
