"""index: for each ``--index-variants`` (flat, plaid, plaid-r2 = 2-bit residuals without fp16 vectors, ...), the
build seconds (encoding and search structures apart), bytes per token, disk bytes and peak RSS."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sections.common import INDEX_VARIANTS, base_index, fmt, load_dataset, load_model, variant_index
from sections.options import Job, comma_list, option

if TYPE_CHECKING:
    from sections.config import BenchConfig


@dataclass(frozen=True)
class Config:
    """The index variants built and searched, and extra PLAID build parameters (growth reads them too)."""

    variants: tuple[str, ...] = option("--index-variants", ("flat", "plaid", "plaid-r2"),
                                       f"comma-separated subset of {tuple(INDEX_VARIANTS)}", type=comma_list)
    plaid_params: dict[str, Any] = option("--plaid-params", {}, "extra plaid build params (JSON)", type=json.loads)


def check(config: Config) -> None:
    """Refuse an index variant the benchmark does not know (before any child starts)."""
    unknown = [v for v in config.variants if v not in INDEX_VARIANTS]
    if unknown:
        raise SystemExit(f"bench: unknown index variants {unknown}; known: {sorted(INDEX_VARIANTS)}")


def jobs(config: BenchConfig) -> list[Job]:
    return [Job(f"index:{v}", "index", variant=v) for v in config.index.variants]


def run(config: BenchConfig, job: Job) -> dict[str, Any]:
    from measure import peak_rss_mb

    name = job.variant
    dataset = load_dataset(config)
    encoder = load_model(config)
    encoding = INDEX_VARIANTS[name][2]
    base, record = base_index(config, dataset, encoder, encoding)
    index, seconds = variant_index(config, base, name)
    return {"variant": name, "faiss": index.backend_settings.get("factory"), "params": index.backend_settings["params"],
            "n_docs": index.n_docs, "n_tokens": index.n_tokens, "encode": record, "structure_build_s": seconds,
            "build_s": record["encode_and_write_s"] + seconds, "bytes_per_token": index.bytes_per_token(),
            "disk_bytes": index.disk_bytes(), "disk_bytes_per_token": index.disk_bytes() / max(1, index.n_tokens),
            "disk_bytes_per_doc": index.disk_bytes() / max(1, index.n_docs),
            "structure_bytes_per_doc": structure_bytes(index) / max(1, index.n_docs),
            "peak_rss_mb": peak_rss_mb(), "document_encoding": encoding}


def structure_bytes(index: Any) -> int:
    """Bytes of the back-end's own files (FAISS indexes, centroids, codes, FDEs), every head: what the engine adds
    beside the stored vectors."""
    from hil.retrieval.backends.registry import backend_class

    backend = backend_class(index.backend_settings["kind"])
    return sum(path.stat().st_size for head in index.head_names for path in backend.head_files(index.directory, head)
               if path.is_file())


def rows(label: str, result: dict[str, Any]) -> list[tuple[str, str, str]]:
    r = result
    return [(f"index {r['variant']}", f"{r['build_s']:.1f} s build",
             f"structures {r['structure_build_s']:.1f} s, {r['bytes_per_token']} B/token vectors, "
             f"{r['disk_bytes_per_token']:.1f} B/token on disk ({fmt(r.get('disk_bytes_per_doc'), 0)} B/document, "
             f"of which search structures {fmt(r.get('structure_bytes_per_doc'), 0)}), "
             f"peak RSS {r['peak_rss_mb']:.0f} MB "
             f"(encoding peak {fmt(r['encode'].get('peak_rss_mb'), 0)} MB), {r['n_tokens']} tokens")]
