"""Training end to end on CPU with the shared tiny model: CLI, overfitting, resume, export."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from hil.cli.train import train_main
from hil.data.datamodule import TrainingDataModule
from hil.data.triples_file import TextTriples
from hil.modeling.encoder import ColBERTEncoder
from hil.modeling.loading import load_encoder
from hil.modeling.module import RetrieverModule

from nway_examples import nway_settings, write_nway_examples

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
    data = TrainingDataModule(TextTriples(TRIPLES), max_triples=8, batch_size=8, shuffle=False)
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


# -- n-way examples (issue 22) ------------------------------------------------------------------------------------


def test_collate_lays_out_triples_as_before_and_examples_column_by_column():
    from hil.data.datamodule import collate_examples, collate_triples
    from hil.data.examples import ScoredExample
    from hil.data.triples import Triple
    from hil.errors import UserError

    triples = [Triple("q1", "p1", "n1"), Triple("q2", "p2", "n2")]
    assert collate_examples(triples) == collate_triples(triples)
    assert collate_examples([ScoredExample("q1", ("p1", "n1")), ScoredExample("q2", ("p2", "n2"))]) == \
        collate_triples(triples)
    examples = [ScoredExample("q1", ("a1", "b1", "c1"), (3.0, 1.0, 2.0)),
                ScoredExample("q2", ("a2", "b2", "c2"), (0.5, 0.0, -1.0))]
    batch = collate_examples(examples)
    assert batch["queries"] == ["q1", "q2"] and batch["documents"] == [["a1", "b1", "c1"], ["a2", "b2", "c2"]]
    assert batch["teacher_scores"].tolist() == [[3.0, 1.0, 2.0], [0.5, 0.0, -1.0]]
    with pytest.raises(UserError, match="data.nway"):
        collate_examples([examples[0], ScoredExample("q3", ("a", "b"), (1.0, 0.0))])
    with pytest.raises(UserError, match="with and without teacher scores"):
        collate_examples([examples[0], ScoredExample("q3", ("a", "b", "c"))])


def test_data_module_nway_settings_are_checked():
    """N-way settings with a reader of triples, and no reader at all, are refused in one line; the spelling before
    0.3 (a key per reader) keeps its own refusals."""
    from hil.errors import UserError

    with pytest.raises(UserError, match="data.nway applies to n-way examples; TextTriples gives examples of 2"):
        TrainingDataModule(TextTriples(TRIPLES), nway=4)
    with pytest.raises(UserError, match="data.source: give the reader"):
        TrainingDataModule()
    with pytest.raises(ValueError, match="exactly one"):
        TrainingDataModule(triples=TRIPLES, nway_examples="e.jsonl", queries="q", collection="c")
    with pytest.raises(ValueError, match="go together"):
        TrainingDataModule(nway_examples="e.jsonl", queries="q.tsv")
    with pytest.raises(ValueError, match="go together"):
        TrainingDataModule(triples=TRIPLES, queries="q.tsv", collection="c.tsv")
    with pytest.raises(ValueError, match="data.nway"):
        TrainingDataModule(triples=TRIPLES, nway=4)


def test_distillation_needs_teacher_scores_before_training_starts(shared_dir, tmp_path):
    from hil.errors import UserError
    from hil.modeling.losses import KLDistillation

    module = RetrieverModule(ColBERTEncoder(backbone="bert-tiny-splade", dim=16, query_maxlen=16, doc_maxlen=32),
                             KLDistillation())
    data = TrainingDataModule(TextTriples(TRIPLES), max_triples=4, batch_size=2)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    with pytest.raises(UserError, match=r"KLDistillation needs teacher scores.*data.source=TextTriples\(path="):
        trainer.fit(module, data)
    assert trainer.global_step == 0


def test_an_nway_file_trains_with_its_teacher_scores(shared_dir, tmp_path):
    """The data module reads a ColBERTv2 n-way file; the batches carry (B, N) teacher scores; the KL term trains."""
    from hil.modeling.losses import KLDistillation

    write_nway_examples(tmp_path, n_queries=6, nway=3)
    data = TrainingDataModule(**nway_settings(tmp_path), nway=3, batch_size=3, shuffle=False)
    data.prepare_data()
    data.setup("fit")
    assert data.has_teacher_scores() and "data.source=NWayExamples(path=" in data.describe_source()
    first = next(iter(data.train_dataloader()))
    assert len(first["queries"]) == 3 and [len(documents) for documents in first["documents"]] == [3, 3, 3]
    assert first["teacher_scores"].tolist()[0] == [9.0, 2.0, 1.0]
    seen: list[float] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(float(trainer.callback_metrics["train/loss_kl"]))

    module = RetrieverModule(ColBERTEncoder(backbone="bert-tiny-splade", dim=16, query_maxlen=16, doc_maxlen=32),
                             KLDistillation(), optimizer=partial(torch.optim.AdamW, lr=1e-3))
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[Record()],
                         default_root_dir=tmp_path)
    trainer.fit(module, data)
    assert trainer.global_step == 4 and len(seen) == 4 and all(value >= 0 for value in seen)


def test_an_nway_file_without_scores_trains_contrastively_and_refuses_distillation(shared_dir, tmp_path):
    from hil.errors import UserError
    from hil.modeling.losses import KLDistillation, NWayCE

    write_nway_examples(tmp_path, n_queries=4, nway=3, scored=False)
    data = TrainingDataModule(**nway_settings(tmp_path), nway=3, batch_size=2, shuffle=False)
    data.setup("fit")
    assert not data.has_teacher_scores()
    assert "teacher_scores" not in next(iter(data.train_dataloader()))
    for loss, steps in ((NWayCE(), 2), (KLDistillation(), 0)):
        module = RetrieverModule(ColBERTEncoder(backbone="bert-tiny-splade", dim=16, query_maxlen=16, doc_maxlen=32),
                                 loss)
        trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
        if steps:
            trainer.fit(module, data)
        else:
            with pytest.raises(UserError, match="needs teacher scores.*NWayExamples"):
                trainer.fit(module, data)
        assert trainer.global_step == steps


def test_an_nway_file_resumes_exactly_where_it_stopped(shared_dir, tmp_path):
    """The loader's state after two batches of an n-way file, loaded into a fresh data module, gives exactly the
    batches (texts and teacher scores) an uninterrupted epoch gives after those two."""

    write_nway_examples(tmp_path, n_queries=8, nway=3)

    def loader():
        data = TrainingDataModule(**nway_settings(tmp_path), nway=3, batch_size=2, seed=5)
        data.setup("fit")
        return data.train_dataloader()

    def plain(batches):
        return [{k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in batches]

    whole = plain(loader())
    assert len(whole) == 4 and all(len(b["teacher_scores"]) == 2 for b in whole)
    interrupted = loader()
    batches = iter(interrupted)
    head = [next(batches), next(batches)]
    state = interrupted.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    assert plain(head) + plain(resumed) == whole


def test_a_teacher_run_and_pylate_examples_load_through_the_data_module(shared_dir, tmp_path):
    """``TrecRun`` (a TREC run with teacher scores; ``depth``/``selection`` choose each query's N) and
    ``PyLateExamples`` give the same batch layout as an n-way file."""
    import json

    from hil.data.pylate_files import PyLateExamples
    from hil.data.run_examples import TrecRun

    write_nway_examples(tmp_path, n_queries=4, nway=4)
    nway = nway_settings(tmp_path)
    texts = (nway["source"].queries, nway["source"].collection)
    lines = [json.loads(line) for line in (tmp_path / "examples.jsonl").read_text().splitlines()]
    with open(tmp_path / "run.trec", "w") as run, open(tmp_path / "pylate.jsonl", "w") as pylate:
        for qid, *scored in lines:
            for rank, (pid, score) in enumerate(scored, start=1):
                run.write(f"{qid} Q0 {pid} {rank} {score} teacher\n")
            pylate.write(json.dumps({"query_id": qid, "document_ids": [p for p, _ in scored],
                                     "scores": [s for _, s in scored]}) + "\n")
    common = {"cache_dir": nway["cache_dir"], "nway": 3, "batch_size": 4, "shuffle": False}
    expected = None
    for source in (nway["source"], TrecRun(str(tmp_path / "run.trec"), *texts, depth=3),
                   PyLateExamples(str(tmp_path / "pylate.jsonl"), *texts)):
        data = TrainingDataModule(source, **common)
        data.prepare_data()
        data.setup("fit")
        batch = next(iter(data.train_dataloader()))
        got = {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        assert got["teacher_scores"][0] == [9.0, 2.0, 1.0], source
        expected = expected or got
        assert got == expected, source


def test_hil_fit_prints_no_lightning_noise(shared_dir, tmp_path):
    """``hil fit`` as a user runs it (its own process, arguments on the command line): Lightning's advertisement,
    its "no GPU / no TPU" lines, the warning about the CLI's ``args`` and a torch deprecation are left out; its
    informative lines stay."""
    import os
    import subprocess
    import sys

    command = [sys.executable, "-m", "hil", "fit", "--config", "colbert", "--config", "presets/smoke",
               "--trainer.default_root_dir", str(tmp_path / "run"), "--export_dir", str(tmp_path / "export")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "HIL_DATA_DIR": str(shared_dir / "data"),
                               "HIL_MODELS_DIR": str(shared_dir / "models")})
    assert done.returncode == 0, done.stderr[-2000:]
    for noise in ("Tip:", "GPU available: False", "TPU available", "args parameter", "LeafSpec"):
        assert noise not in done.stderr, noise
    assert "`Trainer.fit` stopped: `max_steps=4` reached." in done.stderr
    assert "exported model to" in done.stdout
