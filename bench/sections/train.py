"""train: triples/s of ColBERT and ColBERT-HIL training steps at ``--train-batch`` (forward, backward, AdamW), for
each ``--train-models`` backbone and ``--train-archs`` architecture."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from sections.common import fmt
from sections.options import Job, comma_list, option

if TYPE_CHECKING:
    from sections.config import BenchConfig


@dataclass(frozen=True)
class Config:
    """Training-step throughput per backbone and architecture."""

    models: tuple[str, ...] = option("--train-models", ("sentence-transformers/all-MiniLM-L6-v2", "bert-tiny-splade"),
                                     type=comma_list)
    archs: tuple[str, ...] = option("--train-archs", ("colbert", "hil"), type=comma_list)
    batch: int = option("--train-batch", 32)
    steps: int = option("--train-steps", 3, "timed steps (after one warm-up step)")
    triples: str = option("--triples", "msmarco/triples.train.small.head1000.tsv")


def jobs(config: BenchConfig) -> list[Job]:
    return [Job(f"train:{arch}:{Path(model).name}", "train", arch=arch, train_model=model)
            for model in config.train.models for arch in config.train.archs]


def run(config: BenchConfig, job: Job) -> dict[str, Any]:
    import torch

    from hil.data.triples import read_triples
    from hil.modeling.encoder import ColBERTEncoder
    from hil.modeling.hil import HILEncoder
    from hil.modeling.losses import HILLoss, PairwiseCE
    from hil.modeling.module import RetrieverModule
    from hil.paths import resolve_data_file
    from measure import peak_rss_mb

    settings, model, doc_maxlen = config.train, job.train_model, config.common.doc_maxlen
    triples = read_triples(resolve_data_file(settings.triples), limit=settings.batch * (settings.steps + 1))
    torch.manual_seed(config.common.seed)
    if job.arch == "colbert":
        module = RetrieverModule(ColBERTEncoder(backbone=model, doc_maxlen=doc_maxlen), PairwiseCE())
    else:  # uniform IDF weights: no table is computed (the cost measured is the training step's)
        module = RetrieverModule(HILEncoder(backbone=model, doc_maxlen=doc_maxlen), HILLoss())
    module.train()
    optimizer = torch.optim.AdamW(module.parameters(), lr=3e-6)
    batches = [triples[i: i + settings.batch] for i in range(0, len(triples), settings.batch)]
    times = []
    for step, chunk in enumerate(batches):
        batch = {"queries": [t.query for t in chunk], "documents": [[t.positive, t.negative] for t in chunk]}
        tick = time.perf_counter()
        loss, _ = module.compute_loss(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step > 0:  # the first step pays for allocation and thread start-up
            times.append(time.perf_counter() - tick)
    seconds = float(np.sum(times))
    return {"arch": job.arch, "model": model, "batch": settings.batch, "steps_timed": len(times),
            "triples_per_s": settings.batch * len(times) / seconds if seconds else None,
            "s_per_step": seconds / max(1, len(times)), "peak_rss_mb": peak_rss_mb()}


def rows(label: str, result: dict[str, Any]) -> list[tuple[str, str, str]]:
    r = result
    return [(label.replace("train:", "train "), f"{fmt(r['triples_per_s'], 2)} triples/s",
             f"batch {r['batch']}, {r['s_per_step']:.1f} s/step over {r['steps_timed']} steps, "
             f"peak RSS {r['peak_rss_mb']:.0f} MB")]
