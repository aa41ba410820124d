"""``TrainingProbe``: the Lightning callback through which ``train.py`` reports triples/s and peak memory to
``bench/gpu_check.py`` (see ``gpu_check_probe``), added on ``train.py``'s own command line with ``bench/`` on
``PYTHONPATH``::

    --trainer.callbacks+=gpu_check_callback.TrainingProbe --trainer.callbacks.report_dir=DIR

Every DDP rank -- Lightning starts ranks 1.. by re-running the same command line -- writes ``DIR/rank<r>.json``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytorch_lightning as pl

from gpu_check_probe import memory_report, synchronize, write_report

__all__ = ["TrainingProbe"]


class TrainingProbe(pl.Callback):
    """Per rank: the triples trained on and the wall time of the steps after the first ``skip_steps`` (start-up,
    allocator growth and kernel selection are not throughput), and the peak memory at the end of training, written to
    ``report_dir/rank<r>.json``. The clock starts and stops after a CUDA synchronize, so queued GPU work is counted in
    the step that queued it."""

    def __init__(self, report_dir: str, skip_steps: int = 10):
        self.report_dir = Path(report_dir)
        self.skip_steps = skip_steps
        self.started: float | None = None
        self.finished: float | None = None
        self.timed_steps = 0
        self.timed_triples = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001
        if self.started is None and trainer.global_step >= self.skip_steps:
            synchronize()
            self.started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
        if self.started is None:
            return
        self.timed_steps += 1
        self.timed_triples += len(batch["queries"])
        if trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps:
            synchronize()  # the last step: stop before checkpoints and the export
        self.finished = time.perf_counter()

    def on_train_end(self, trainer, pl_module):  # noqa: ANN001
        seconds = None if self.started is None else self.finished - self.started
        write_report(self.report_dir / f"rank{trainer.global_rank}.json", {
            "rank": trainer.global_rank, "world_size": trainer.world_size, "device": str(pl_module.device),
            "precision": str(trainer.precision), "steps": trainer.global_step, "skip_steps": self.skip_steps,
            "timed_steps": self.timed_steps, "timed_triples": self.timed_triples, "seconds": seconds,
            **memory_report()})
