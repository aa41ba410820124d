"""Training end to end on CPU with the shared tiny model: CLI, overfitting, resume, export."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from hil.cli import train_main
from hil.data.datamodule import TriplesDataModule
from hil.modeling.encoder import ColBERTEncoder
from hil.modeling.loading import load_encoder
from hil.modeling.module import RetrieverModule

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
TRIPLES = "msmarco/triples.train.small.head1000.tsv"


def cli_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["fit", "--config", str(REPO / "configs/colbert.yaml"), "--config", str(REPO / "configs/presets/smoke.yaml"),
            "--trainer.default_root_dir", str(tmp_path), "--trainer.logger", "false", *extra]


def colbert_module(lr: float = 3e-6, init_from: str | None = None, **encoder_settings) -> RetrieverModule:
    encoder = ColBERTEncoder(backbone="bert-tiny-splade", **encoder_settings)
    return RetrieverModule(encoder, optimizer=partial(torch.optim.AdamW, lr=lr), init_from=init_from)


def checkpoints(tmp_path: Path) -> list[Path]:
    return sorted(tmp_path.rglob("*.ckpt"))


def test_cli_fit_runs_and_exports(shared_dir, tmp_path):
    export = tmp_path / "export"
    cli = train_main(cli_args(tmp_path, "--export_dir", str(export)))
    assert cli.trainer.global_step == 4
    assert any(p.name == "last.ckpt" for p in checkpoints(tmp_path))
    encoder = load_encoder(export)
    assert encoder.settings()["doc_maxlen"] == 48 and encoder.settings()["query_maxlen"] == 16


def test_loss_goes_down_when_overfitting(shared_dir, tmp_path):
    pl.seed_everything(0)
    model = colbert_module(lr=1e-3, dim=32, query_maxlen=16, doc_maxlen=48)
    data = TriplesDataModule(triples=TRIPLES, max_triples=8, batch_size=8, shuffle=False)
    losses: list[float] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer = pl.Trainer(max_steps=25, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, callbacks=[Record()], default_root_dir=tmp_path)
    trainer.fit(model, data)
    assert len(losses) == 25
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.5 * first, (first, last)


def test_resume_continues_at_the_right_step(shared_dir, tmp_path):
    train_main(cli_args(tmp_path, "--trainer.max_steps", "2"))
    ckpt = next(p for p in checkpoints(tmp_path) if p.name == "last.ckpt")
    assert torch.load(ckpt, weights_only=False)["global_step"] == 2
    resumed = tmp_path / "resumed"
    cli = train_main(cli_args(resumed, "--trainer.max_steps", "4", "--ckpt_path", str(ckpt)))
    assert cli.trainer.global_step == 4
    state = torch.load(next(p for p in checkpoints(resumed) if p.name == "last.ckpt"), weights_only=False)
    assert state["global_step"] == 4
    # the optimizer state was restored, not restarted: Adam's step count is the global one
    adam_steps = {int(s["step"]) for s in state["optimizer_states"][0]["state"].values()}
    assert adam_steps == {4}


def test_export_then_load_gives_identical_scores(shared_dir, tmp_path):
    torch.manual_seed(0)
    model = colbert_module(dim=24, query_maxlen=16, doc_maxlen=40)
    model.encoder.eval()
    model.export(tmp_path / "export")
    loaded = load_encoder(tmp_path / "export")
    queries = ["what causes fever", "effects of caffeine"]
    docs = ["Fever is caused by infection.", "Caffeine is a stimulant, found in coffee.", ""]
    with torch.inference_mode():
        before = model.encoder.score(model.encoder.encode_queries(queries), model.encoder.encode_documents(docs))
        after = loaded.score(loaded.encode_queries(queries), loaded.encode_documents(docs))
    torch.testing.assert_close(before, after, rtol=0, atol=0)


def test_init_from_checkpoint_and_export(shared_dir, tmp_path):
    torch.manual_seed(0)
    source = colbert_module(dim=24, query_maxlen=16, doc_maxlen=40)
    source.export(tmp_path / "export")
    trainer = pl.Trainer(max_steps=0, logger=False, enable_checkpointing=False)
    trainer.strategy.connect(source)
    trainer.save_checkpoint(tmp_path / "source.ckpt")
    for origin in (tmp_path / "export", tmp_path / "source.ckpt"):
        torch.manual_seed(1)  # a different random head, which init_from must overwrite
        tuned = colbert_module(dim=24, query_maxlen=16, doc_maxlen=40, init_from=str(origin))
        torch.testing.assert_close(tuned.encoder.linear.weight, source.encoder.linear.weight)
    with pytest.raises(FileNotFoundError, match="init_from"):
        colbert_module(init_from=str(tmp_path / "missing.ckpt"))
