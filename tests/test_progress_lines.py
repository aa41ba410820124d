"""Progress lines for training whose output goes to a file (``make demo > log``): a tiny training run with a fake,
non-terminal stream and a fake clock, so that every number on every line is known in advance; and ``train.py``'s
wiring (on by default off a terminal, in place of the progress bar)."""

from __future__ import annotations

import csv
import io
import re
from functools import partial
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger

from hil.cli.train import train_main
from hil.data.datamodule import TrainingDataModule
from hil.modeling.callbacks import ProgressLines, clock_text
from hil.modeling.encoder import ColBERTEncoder
from hil.modeling.module import RetrieverModule

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^step (\d+)/(\d+) \((\d+)%\) \| loss (\S+) \| (\S+) triples/s \| elapsed (\S+) \| ETA (\S+)$")
MAX_STEPS, BATCH, TICK = 6, 4, 10.0


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def ticking_clock(tick: float = TICK):
    """A clock that advances ``tick`` seconds each time it is read: 0, 10, 20, ..."""
    reads = iter(range(10_000))
    return lambda: next(reads) * tick


def train(tmp_path: Path, *callbacks: ProgressLines) -> Path:
    """Six steps of four triples with the shared tiny BERT, every step's loss logged to CSV; -> metrics.csv."""
    pl.seed_everything(0)
    encoder = ColBERTEncoder(backbone="bert-tiny-splade", dim=16, query_maxlen=16, doc_maxlen=32)
    model = RetrieverModule(encoder, optimizer=partial(torch.optim.AdamW, lr=1e-4))
    data = TrainingDataModule(triples="msmarco/triples.train.small.head1000.tsv", max_triples=BATCH * MAX_STEPS,
                             batch_size=BATCH, shuffle=False)
    logger = CSVLogger(tmp_path, name="csv")
    trainer = pl.Trainer(max_steps=MAX_STEPS, accelerator="cpu", logger=logger, log_every_n_steps=1,
                         enable_checkpointing=False, enable_progress_bar=False, callbacks=list(callbacks),
                         default_root_dir=tmp_path)
    trainer.fit(model, data)
    return Path(logger.log_dir) / "metrics.csv"


def logged_losses(metrics_csv: Path) -> list[float]:
    rows = [row for row in csv.DictReader(metrics_csv.open()) if row.get("train/loss")]
    return [float(row["train/loss"]) for row in sorted(rows, key=lambda row: int(row["step"]))]


def progress_lines(stream: io.StringIO, when: str = "auto") -> ProgressLines:
    callback = ProgressLines(every_n_seconds=30, when=when)
    callback.stream, callback.clock = stream, ticking_clock()
    return callback


def test_lines_carry_the_step_the_logged_loss_the_pace_and_the_eta(shared_dir, tmp_path):
    """Off a terminal, "auto" prints; on one it stays quiet (the bar is there), and "never" never prints."""
    stream, terminal, never = io.StringIO(), Terminal(), io.StringIO()
    losses = logged_losses(train(tmp_path, progress_lines(stream), progress_lines(terminal),
                                 progress_lines(never, when="never")))
    assert terminal.getvalue() == never.getvalue() == ""
    assert len(losses) == MAX_STEPS
    lines = stream.getvalue().splitlines()
    parsed = [LINE.match(line) for line in lines]
    assert all(parsed), lines
    # The clock reads 0 at the start and 10 s more at each step: a line after step 1, then once 30 s have passed
    # (step 4), then the last step's at the end (read at 70 s).
    steps = [int(m.group(1)) for m in parsed]
    assert steps == [1, 4, 6]
    for m, step, now in zip(parsed, steps, (10.0, 40.0, 70.0)):
        assert int(m.group(2)) == MAX_STEPS and int(m.group(3)) == round(100 * step / MAX_STEPS)
        assert float(m.group(4)) == pytest.approx(losses[step - 1], abs=5e-5)  # the step's logged train/loss
        assert float(m.group(5)) == pytest.approx(BATCH * step / now, abs=0.05) and float(m.group(5)) > 0
        assert m.group(6) == clock_text(now)
        assert m.group(7) == clock_text((MAX_STEPS - step) * now / step)  # this pace, to max_steps
    assert [m.group(7) for m in parsed] == ["0:00:50", "0:00:20", "0:00:00"]


def test_bad_settings_are_refused_naming_the_option():
    for value in (0, -1, float("nan")):
        with pytest.raises(ValueError, match="progress_lines.every_n_seconds"):
            ProgressLines(every_n_seconds=value)
    with pytest.raises(ValueError, match="progress_lines.when"):
        ProgressLines(when="sometimes")  # type: ignore[arg-type]
    assert ProgressLines(when="always").prints_to(Terminal()) and ProgressLines().prints_to(io.StringIO())
    assert not ProgressLines().prints_to(Terminal()) and not ProgressLines(when="never").prints_to(io.StringIO())
    assert (clock_text(3725.4), clock_text(59.6), clock_text(-3)) == ("1:02:05", "0:01:00", "0:00:00")


def test_train_py_prints_lines_off_a_terminal_instead_of_the_bar(shared_dir, tmp_path, capsys):
    """pytest's captured stdout is not a terminal: the default run prints lines and has no bar."""
    args = ["fit", "--config", str(REPO / "configs/colbert.yaml"), "--config", str(REPO / "configs/presets/smoke.yaml"),
            "--trainer.default_root_dir", str(tmp_path), "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "null"]  # the smoke preset turns the bar off itself; a default config
    cli = train_main(args)
    assert cli.trainer.progress_bar_callback is None
    assert any(isinstance(c, ProgressLines) for c in cli.trainer.callbacks)
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" |")[0] for line in out if LINE.match(line)] == ["step 1/4 (25%)", "step 4/4 (100%)"]


def test_search_and_encoding_bars_write_lines_off_a_terminal(monkeypatch):
    """Off a terminal a bar's updates are lines (no carriage returns a log file would keep as one line)."""
    import io

    from hil.retrieval.progress import progress_bar

    class Pipe(io.StringIO):
        def isatty(self):
            return False

    pipe = Pipe()
    monkeypatch.setattr("sys.stderr", pipe)
    bar = progress_bar(3, "encoding", "doc", every_s=0.0)
    for _ in range(3):
        bar.update(1)
    bar.close()
    text = pipe.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) >= 3 and lines[-1].startswith("encoding: 100%") and "3/3" in lines[-1]
    quiet = Pipe()
    monkeypatch.setattr("sys.stderr", quiet)
    silent = progress_bar(3, "encoding", "doc", enabled=False)
    silent.update(3)
    silent.close()
    assert quiet.getvalue() == ""
