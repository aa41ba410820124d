"""Training at GPU speed (issue 29, item 1): a training step never makes the host wait for the device between
logging steps, and every guarantee holds as before -- the non-finite policy, the loss curve, exact resume.

The syncs are counted over real ``Trainer.fit`` runs of the tiny model, the whole Lightning loop (data loading,
callbacks, logging, optimizer, progress bar and progress lines), by ``bench/training_step_host.py``'s
``SyncCounter``: every scalar read (``.item()``, ``bool()``, ``float()``, ``int()``), ``nonzero``, boolean-mask
indexing, ``.tolist()``, ``.cpu()``... of a tensor that lives where the model lives (the model's parameters and
buffers, the batch, and whatever is computed from them; on the CPU all tensors are the CPU's, so that is tracked).

Each test was checked by breaking the code it guards and watching it fail (the list is in the note of the change):
the guard's per-step ``bool(isfinite(loss))`` and per-parameter gradient check put back, RunningMoments'
``int(self.updates)`` / ``bool(isfinite(...))`` put back, the loss logged with ``prog_bar=True``, transformers' own
2D mask handed to the backbone, the DDP all-reduce of the loss flag removed, the fused optimizer's ``found_inf`` not
set, the fp16 poisoning of gradients removed, the record of the first step overwritten by later ones, the
checkpoint check removed from ``state_dict``, the collate tokenizing positives and negatives apart, the worker
tokenizer given other settings.
"""

from __future__ import annotations

import importlib.util
import io
import math
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import LearningRateMonitor, ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.plugins.precision import MixedPrecision

from hil.data.datamodule import TokenizedCollate, TrainingDataModule, collate_examples
from hil.data.triples import Triple
from hil.data.triples_file import TextTriples
from hil.modeling.backbone_mask import backbone_attention_mask
from hil.modeling.callbacks import (
    NonFiniteGuard,
    NonFiniteLossError,
    ProgressLines,
    StepReseed,
    nonfinite_gradients,
    step_seed,
)
from hil.modeling.encoder import ColBERTEncoder
from hil.modeling.hil import HILEncoder, RunningMoments
from hil.modeling.losses import HILLoss, LossOutput, PairwiseCE
from hil.modeling.module import RetrieverModule, logs_this_step

from conftest import gloo_group, run_spawned

REPO = Path(__file__).resolve().parents[1]
TRIPLES = "msmarco/triples.train.small.head1000.tsv"


def bench_module():
    spec = importlib.util.spec_from_file_location("training_step_host", REPO / "bench" / "training_step_host.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("training_step_host", module)
    spec.loader.exec_module(module)
    return module


SyncCounter = bench_module().SyncCounter


class CountSyncs(pl.Callback):
    """The syncs of each step's window (this ``on_train_batch_start`` to the next), over the whole loop."""

    def __init__(self):
        self.counter = SyncCounter()
        self.reads_back: dict[int, bool] = {}

    def on_train_start(self, trainer, pl_module):
        self.counter.mark([*pl_module.parameters(), *pl_module.buffers()])
        self.counter.__enter__()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step = trainer.global_step
        self.reads_back[step] = logs_this_step(trainer) or step + 1 >= trainer.max_steps
        self.counter.step, self.counter.logging = step, self.reads_back[step]
        self.counter.mark_batch(batch)

    def on_train_end(self, trainer, pl_module):
        self.counter.__exit__(None, None, None)

    def between_logging_steps(self) -> dict[int, list[str]]:
        """The syncs of every step that is neither a logging step nor the last: step -> [op at where]."""
        out: dict[int, list[str]] = {step: [] for step, reads in self.reads_back.items() if not reads}
        for step, _, what, where in self.counter.events:
            if step in out:
                out[step].append(f"{what} at {where}")
        return out

    def at_logging_steps(self) -> int:
        return sum(1 for step, *_ in self.counter.events if self.reads_back.get(step))


def tiny_module(architecture: str = "colbert", fused: bool = False, loss=None) -> RetrieverModule:
    torch.manual_seed(0)
    settings = {"dim": 16, "query_maxlen": 12, "doc_maxlen": 32}
    if architecture == "colbert":
        encoder, default_loss = ColBERTEncoder("bert-tiny-splade", **settings), PairwiseCE()
    else:
        encoder, default_loss = HILEncoder("bert-tiny-splade", **settings), HILLoss()
    return RetrieverModule(encoder, loss or default_loss, optimizer=partial(torch.optim.AdamW, lr=1e-3, fused=fused))


def fit(tmp_path: Path, module: RetrieverModule, steps: int, log_every: int = 3, policy: str = "raise",
        precision: str | None = "32-true", callbacks: tuple = (), num_workers: int = 0, plugins: tuple = (),
        max_triples: int = 64, batch_size: int = 4, **trainer_args) -> pl.Trainer:
    """``train.py``'s callbacks around a short run: reseeding, the guard, progress lines and the progress bar, a
    learning-rate monitor and a CSV logger."""
    data = TrainingDataModule(TextTriples(TRIPLES), max_triples=max_triples, batch_size=batch_size, seed=3,
                             num_workers=num_workers)
    lines = ProgressLines(every_n_seconds=1e-6, when="always")
    lines.stream = io.StringIO()
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", log_every_n_steps=log_every,
                         logger=CSVLogger(tmp_path, name="csv"), enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[StepReseed(11), NonFiniteGuard(policy), lines, LearningRateMonitor("step"),
                                    *callbacks], plugins=list(plugins), **trainer_args,
                         **({"precision": precision} if precision else {}))
    trainer.fit(module, data)
    return trainer


# -- 1. no host sync between logging steps -----------------------------------------------------------------------
@pytest.mark.parametrize("architecture,precision", [("colbert", "32-true"), ("colbert", "bf16-mixed"),
                                                    ("hil", "32-true"), ("hil", "bf16-mixed")])
def test_a_training_step_makes_no_host_sync_between_logging_steps(shared_dir, tmp_path, architecture, precision):
    count = CountSyncs()
    fit(tmp_path, tiny_module(architecture), steps=7, precision=precision, callbacks=(count,),
        enable_checkpointing=False)
    quiet = count.between_logging_steps()
    assert sorted(quiet) == [0, 1, 3, 4]  # steps 2 and 5 log (every 3), step 6 is the last
    assert quiet == {step: [] for step in quiet}
    assert count.at_logging_steps() > 0  # the counter sees Lightning read the logged values back


@pytest.mark.parametrize("policy,fused,per_step", [("skip", True, 0), ("raise", True, 0), ("skip", False, 1)])
def test_the_nonfinite_policy_costs_no_sync_with_a_fused_optimizer_and_one_for_skip_without(
        shared_dir, tmp_path, policy, fused, per_step):
    count = CountSyncs()
    fit(tmp_path, tiny_module(fused=fused), steps=7, policy=policy, callbacks=(count,), enable_checkpointing=False)
    quiet = count.between_logging_steps()
    assert all(len(syncs) == per_step for syncs in quiet.values()), quiet
    assert all("callbacks.py" in sync for syncs in quiet.values() for sync in syncs), quiet


@pytest.mark.parametrize("precision", ["16-mixed-scaled", "bf16-mixed"])
@pytest.mark.parametrize("clip", [None, 2.0])
def test_fp16_loss_scaling_with_a_fused_optimizer_makes_no_host_sync(shared_dir, tmp_path, precision, clip):
    """``presets/gpu.yaml`` on ``configs/colbert.yaml``: a fused AdamW, and ColBERT v1's clipping at norm 2.0
    (unscaled first: ``RetrieverModule.configure_gradient_clipping``)."""
    count = CountSyncs()
    scaled = precision == "16-mixed-scaled"
    plugins = (MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu")),) if scaled else ()
    fit(tmp_path, tiny_module(fused=True), steps=7, precision=None if scaled else precision, plugins=plugins,
        callbacks=(count,), enable_checkpointing=False, gradient_clip_val=clip)
    quiet = count.between_logging_steps()
    assert quiet == {step: [] for step in quiet}


def test_the_backbone_gets_the_mask_transformers_would_build_without_reading_it_back(shared_dir):
    encoder = ColBERTEncoder("bert-tiny-splade", dim=16, query_maxlen=12, doc_maxlen=32).eval()
    padded = encoder.tokenizer.encode_documents(["a short one", "a much longer document about fever and its causes"])
    unpadded = encoder.tokenizer.encode_documents(["same length", "same length"])
    assert padded.has_padding is True and unpadded.has_padding is False
    for batch in (padded, unpadded):
        with torch.no_grad():
            reference = encoder.backbone(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
            counter = SyncCounter()
            counter.mark([*encoder.parameters(), batch.input_ids, batch.attention_mask])
            with counter:
                ours = encoder.backbone(input_ids=batch.input_ids,
                                        attention_mask=backbone_attention_mask(encoder.backbone, batch))
        assert torch.equal(ours.last_hidden_state, reference.last_hidden_state)
        assert counter.events == []
    # transformers' own path reads the mask back (what the counter would have seen)
    counter = SyncCounter()
    counter.mark([padded.attention_mask])
    with counter, torch.no_grad():
        encoder.backbone(input_ids=padded.input_ids, attention_mask=padded.attention_mask)
    assert [what for _, _, what, _ in counter.events] == ["_local_scalar_dense"]


def old_running_update(mean: float, std: float, updates: int, batch_mean: float, batch_std: float,
                       momentum: float) -> tuple[float, float, int]:
    """RunningMoments.update as it was written with host branches (the reference)."""
    if not (math.isfinite(batch_mean) and math.isfinite(batch_std)):
        return mean, std, updates
    if updates == 0:
        return batch_mean, batch_std, 1
    return mean + momentum * (batch_mean - mean), std + momentum * (batch_std - std), updates + 1


def test_running_moments_update_on_the_device_as_the_host_branches_did():
    moments = RunningMoments(momentum=0.25)
    expected = (0.0, 1.0, 0)
    for batch_mean, batch_std in [(float("nan"), 2.0), (0.5, 2.0), (1.5, float("inf")), (-1.0, 3.0), (2.0, 0.5)]:
        moments.update(torch.tensor(batch_mean), torch.tensor(batch_std))
        expected = old_running_update(*expected, batch_mean, batch_std, 0.25)
        got = (float(moments.mean), float(moments.std), int(moments.updates))
        assert got == pytest.approx(expected, abs=1e-7), (batch_mean, batch_std)


# -- 2. the non-finite policy, read at checks -------------------------------------------------------------------
class NaNAt(PairwiseCE):
    """ColBERT's loss, NaN at the given global steps (``finite_grads``: NaN through a term with no gradient)."""

    def __init__(self, steps: tuple[int, ...], finite_grads: bool = False):
        super().__init__()
        self.steps, self.finite_grads, self.step = steps, finite_grads, 0

    def forward(self, encoder, batch):
        out = super().forward(encoder, batch)
        loss = out.loss
        if self.step in self.steps:
            loss = loss + torch.tensor(float("nan")) if self.finite_grads else loss * float("nan")
        self.step += 1
        return LossOutput(loss, out.parts)


class Weights(pl.Callback):
    """The projection's weights and AdamW's first moment before and after every step."""

    def __init__(self):
        self.before, self.after = {}, {}

    @staticmethod
    def snapshot(pl_module, trainer):
        weight = pl_module.encoder.linear.weight
        state = trainer.optimizers[0].state.get(weight, {})
        moment = state["exp_avg"].clone() if "exp_avg" in state else None
        return weight.detach().clone(), moment, float(state["step"]) if "step" in state else 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before[trainer.global_step] = self.snapshot(pl_module, trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after[trainer.global_step - 1] = self.snapshot(pl_module, trainer)


def unchanged(first, second) -> bool:
    weight_a, moment_a, step_a = first
    weight_b, moment_b, step_b = second
    same_moment = (moment_a is None and moment_b is None) or (
        moment_a is not None and moment_b is not None and torch.equal(moment_a, moment_b))
    return torch.equal(weight_a, weight_b) and same_moment and step_a == step_b


def test_raise_stops_at_the_next_check_naming_the_first_nonfinite_step(shared_dir, tmp_path):
    module = tiny_module(loss=NaNAt((3, 4)))
    with pytest.raises(NonFiniteLossError) as error:
        fit(tmp_path, module, steps=9, log_every=3, enable_checkpointing=False)
    message = str(error.value)
    # the parts recorded at step 3 (this loss turns NaN after its parts were taken), not those of a later step
    assert message.startswith("non-finite loss nan at global step 3 (epoch 0, batch 3); loss parts: loss_late=")
    assert "pair_accuracy=" in message and "inter_iso=" in message and "policy=skip" in message
    assert module.trainer.global_step == 6  # stopped at the check after step 5 (a logging step), not before


def test_raise_writes_no_checkpoint_past_an_unreported_nonfinite_step(shared_dir, tmp_path):
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    with pytest.raises(NonFiniteLossError, match="at global step 1 "):
        fit(tmp_path, tiny_module(loss=NaNAt((1,))), steps=8, log_every=50, callbacks=(checkpoints,))
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").iterdir())


@pytest.mark.parametrize("precision", ["32-true", "16-mixed-scaled"])
def test_skip_with_a_fused_optimizer_leaves_weights_and_optimizer_state_untouched(shared_dir, tmp_path, precision):
    """On the device: the fused AdamW's found_inf. Under fp16 loss scaling, a NaN loss whose gradients are finite
    (NaN added through a constant) is dropped too: the guard makes the gradients NaN before the scaler looks."""
    record = Weights()
    scaled = precision != "32-true"
    plugins = (MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1.0)),) if scaled \
        else ()
    with pytest.warns(UserWarning, match="skipping batch: non-finite loss nan at global step 1"):
        trainer = fit(tmp_path, tiny_module(fused=True, loss=NaNAt((1, 3), finite_grads=scaled)), steps=6,
                      log_every=50, policy="skip", precision=None if scaled else precision, plugins=plugins,
                      callbacks=(record,), enable_checkpointing=False)
    guard = next(c for c in trainer.callbacks if isinstance(c, NonFiniteGuard))
    assert guard.skipped == 2 and float(trainer.logged_metrics["train/nonfinite_skipped"]) == 2.0
    for step in range(6):
        assert unchanged(record.before[step], record.after[step]) == (step in (1, 3)), step
    assert record.after[5][2] == 4.0  # AdamW's step count: 4 updates of 6 steps


def test_ranks_vote_on_the_device_and_raise_together(tmp_path):
    run_spawned(_vote_worker)


def _vote_worker(rank: int, world: int, port: int) -> None:
    with gloo_group(rank, world, port):
        guard = NonFiniteGuard("raise")
        layer = torch.nn.Linear(2, 1)
        trainer = SimpleNamespace(global_step=0, current_epoch=0, precision_plugin=None, should_stop=False,
                                  max_steps=-1, _logger_connector=SimpleNamespace(should_update_logs=False))
        for step in range(3):
            trainer.global_step = step
            guard.on_train_batch_start(trainer, layer, None, step)
            loss = torch.tensor(float("nan") if (rank == 1 and step == 1) else 1.0)
            guard.on_before_backward(trainer, layer, loss)
            for param in layer.parameters():
                param.grad = torch.zeros_like(param)
            guard.on_before_optimizer_step(trainer, layer, torch.optim.SGD(layer.parameters(), lr=0.1))
        with pytest.raises(NonFiniteLossError) as error:
            guard.check(None)
        expected = "non-finite loss nan" if rank == 1 else "non-finite loss on another rank"
        assert str(error.value).startswith(f"{expected} at global step 1 (epoch 0, batch 1)")


def test_nonfinite_gradients_is_any_nan_or_inf_of_any_gradient():
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3)),
              torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))]  # two groups: fp32 and bf16
    assert nonfinite_gradients(params) is None
    for grad, value in [(0, 1.0), (1, float("inf")), (2, float("nan")), (0, -float("inf"))]:
        for param in params:
            param.grad = torch.full_like(param, 3.0)
        params[grad].grad[1] = value
        assert float(nonfinite_gradients(params)) == float(not math.isfinite(value))
        assert torch.equal(params[(grad + 1) % 3].grad, torch.full_like(params[(grad + 1) % 3], 3.0))


# -- 3. the loss curve and exact resume with the loader tokenizing --------------------------------------------------
def string_loop_losses(module: RetrieverModule, steps: int, base_seed: int, batch_size: int) -> list[float]:
    """The old path written out: batches of strings from the same sampler, tokenized by ``compute_loss``, the step
    seeded as StepReseed does, AdamW stepped by hand."""
    data = TrainingDataModule(TextTriples(TRIPLES), max_triples=64, batch_size=batch_size, seed=3, num_workers=0)
    data.setup("fit")
    optimizer = module.configure_optimizers()["optimizer"]
    module.train()
    losses = []
    for batch_idx, batch in enumerate(data.train_dataloader()):
        if batch_idx == steps:
            break
        assert "tokenized" not in batch
        torch.manual_seed(step_seed(base_seed, 0, batch_idx, 0))
        optimizer.zero_grad()
        loss, _ = module.compute_loss(batch)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return losses


def csv_losses(trainer: pl.Trainer) -> list[float]:
    import csv

    with open(Path(trainer.logger.log_dir) / "metrics.csv", newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("train/loss")]
    return [float(row["train/loss"]) for row in sorted(rows, key=lambda row: int(row["step"]))]


@pytest.mark.parametrize("architecture", ["colbert", "hil"])
def test_tokenizing_in_loader_workers_gives_the_loss_curve_of_the_string_path(shared_dir, tmp_path, architecture):
    reference = tiny_module(architecture)
    if architecture == "hil":  # what setup does from the training passages
        data = TrainingDataModule(TextTriples(TRIPLES), max_triples=64, batch_size=4, seed=3)
        data.setup("fit")
        reference.encoder.set_idf_from_texts(*data.idf_documents())
    expected = string_loop_losses(reference, steps=5, base_seed=11, batch_size=4)
    module = tiny_module(architecture)
    trainer = fit(tmp_path, module, steps=5, log_every=1, num_workers=2, enable_checkpointing=False)
    assert csv_losses(trainer) == expected  # equal, not close: the same tensors in the same order
    for (name, ours), (_, theirs) in zip(module.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(ours, theirs), name


class SeenTexts(pl.Callback):
    def __init__(self):
        self.queries: list[list[str]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        assert "tokenized" in batch  # the loader's workers tokenized it
        self.queries.append(list(batch["queries"]))


def test_a_run_resumed_with_loader_workers_equals_the_uninterrupted_run(shared_dir, tmp_path):
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "a" / "ckpt", every_n_train_steps=3, save_top_k=-1)
    whole_texts, resumed_texts = SeenTexts(), SeenTexts()
    whole = tiny_module()
    # 24 triples in batches of 4: 6 batches an epoch; the checkpoint at step 3, while the workers read ahead
    fit(tmp_path / "a", whole, steps=8, num_workers=2, max_triples=24, callbacks=(checkpoints, whole_texts))
    resumed = tiny_module()
    data = TrainingDataModule(TextTriples(TRIPLES), max_triples=24, batch_size=4, seed=3, num_workers=2)
    trainer = pl.Trainer(max_steps=8, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path / "b",
                         callbacks=[StepReseed(11), NonFiniteGuard(), resumed_texts])
    trainer.fit(resumed, data, ckpt_path=str(tmp_path / "a" / "ckpt" / "epoch=0-step=3.ckpt"), weights_only=False)
    assert resumed_texts.queries == whole_texts.queries[3:]
    for (name, ours), (_, theirs) in zip(resumed.state_dict().items(), whole.state_dict().items()):
        assert torch.equal(ours, theirs), name


def test_the_collate_tokenizes_the_strings_it_carries(shared_dir):
    encoder = ColBERTEncoder("bert-tiny-splade", dim=16, query_maxlen=12, doc_maxlen=32)
    triples = [Triple("q one", "a positive passage that is long enough", "neg"), Triple("q two", "pos", "a negative")]
    batch = TokenizedCollate(encoder.tokenizer)(triples)
    assert {k: v for k, v in batch.items() if k != "tokenized"} == collate_examples(triples)
    documents = encoder.tokenizer.encode_documents([t.positive for t in triples] + [t.negative for t in triples])
    queries = encoder.tokenizer.encode_queries([t.query for t in triples])
    for ours, theirs in ((batch["tokenized"]["queries"], queries), (batch["tokenized"]["documents"], documents)):
        for field in ("input_ids", "attention_mask", "scoring_mask"):
            assert torch.equal(getattr(ours, field), getattr(theirs, field)), field
        assert ours.has_padding == bool((ours.attention_mask == 0).any())


# -- 4. the GPU preset's settings -------------------------------------------------------------------------------------
def test_float32_matmul_precision_is_a_setting_applied_before_training(shared_dir, tmp_path, capsys):
    from hil.cli.train import run_train

    args = ["fit", "--config", str(REPO / "configs/colbert.yaml"), "--config", str(REPO / "configs/presets/smoke.yaml"),
            "--trainer.default_root_dir", str(tmp_path), "--trainer.logger", "false", "--trainer.max_steps", "1",
            "--trainer.enable_checkpointing", "false", "--trainer.callbacks", "[]"]
    before = torch.get_float32_matmul_precision()
    try:
        run_train([*args, "--float32_matmul_precision", "medium"])
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(before)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run_train([*args, "--float32_matmul_precision", "fastest"])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert (line.startswith("error:") or ": error: " in line) and "float32_matmul_precision" in line


def test_the_gpu_preset_trains_with_a_fused_adamw_and_tf32_matmuls():
    import yaml

    preset = yaml.safe_load((REPO / "configs/presets/gpu.yaml").read_text())
    assert preset["model"]["optimizer"]["init_args"]["fused"] is True
    assert preset["float32_matmul_precision"] == "high" and preset["trainer"]["precision"] == "16-mixed"
    base = yaml.safe_load((REPO / "configs/colbert.yaml").read_text())  # the CPU default: torch's AdamW, full fp32
    assert "fused" not in base["model"]["optimizer"]["init_args"] and "float32_matmul_precision" not in base
