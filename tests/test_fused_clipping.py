"""Gradient clipping with an optimizer that unscales fp16 gradients itself (``fused: true``, ``presets/gpu.yaml``).

Lightning refuses to clip for such an optimizer under mixed precision ("does not allow for gradient clipping"),
``bf16-mixed`` included, and ``configs/colbert.yaml`` clips at 2.0 (ColBERT v1): every GPU training stopped at its
first step. ``RetrieverModule.configure_gradient_clipping`` unscales first (ColBERT v1's order), then clips. The
reference is Lightning's own clipping of the same model with the unfused optimizer: the same weights after a few
steps, in ``32-true``, ``bf16-mixed`` and ``16-mixed`` with a GradScaler; and far from a fused run without clipping,
so the clip is not a no-op here (its value is small on purpose).
"""

from __future__ import annotations

import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins.precision import MixedPrecision

from hil.data.datamodule import TrainingDataModule
from hil.modeling.encoder import ColBERTEncoder
from hil.modeling.losses import PairwiseCE
from hil.modeling.module import RetrieverModule, clip_unscaled_gradients

REPO = Path(__file__).resolve().parents[1]
TRIPLES = "msmarco/triples.train.small.head1000.tsv"
pytestmark = pytest.mark.integration


def weights_after(tmp_path: Path, optimizer, precision: str, clip: float | None, algorithm: str = "norm",
                  steps: int = 4) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    encoder = ColBERTEncoder("bert-tiny-splade", dim=16, query_maxlen=12, doc_maxlen=32)
    module = RetrieverModule(encoder, PairwiseCE(), optimizer=optimizer)
    data = TrainingDataModule(triples=TRIPLES, max_triples=32, batch_size=4, seed=3, num_workers=0)
    scaled = precision == "16-mixed-scaled"
    plugins = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))] if scaled \
        else []
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         gradient_clip_val=clip, gradient_clip_algorithm=algorithm, plugins=plugins,
                         **({} if scaled else {"precision": precision}))
    trainer.fit(module, data)
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[name].float() - b[name].float()).abs().max()) for name in a)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed-scaled"])
@pytest.mark.parametrize("algorithm,clip", [("norm", 0.05), ("value", 1e-4)])
def test_a_fused_sgd_clips_as_lightning_clips_the_unfused_one(shared_dir, tmp_path, precision, algorithm, clip):
    sgd = partial(torch.optim.SGD, lr=0.5, momentum=0.9)
    fused = weights_after(tmp_path, partial(sgd, fused=True), precision, clip, algorithm)
    unfused = weights_after(tmp_path, partial(sgd, foreach=True), precision, clip, algorithm)
    unclipped = weights_after(tmp_path, partial(sgd, fused=True), precision, None)
    assert largest_difference(fused, unfused) < 1e-6
    assert largest_difference(fused, unclipped) > 1e-3


def test_a_fused_adamw_clips_under_fp16_loss_scaling(shared_dir, tmp_path):
    """The preset's optimizer: AdamW's update hardly depends on the gradients' scale, so the clip must be of the
    unscaled gradients for the fused and the unfused runs to agree (rounding of the two kernels apart)."""
    adamw = partial(torch.optim.AdamW, lr=1e-3, eps=1e-6)
    fused = weights_after(tmp_path, partial(adamw, fused=True), "16-mixed-scaled", 1e-3)
    unfused = weights_after(tmp_path, partial(adamw, foreach=True), "16-mixed-scaled", 1e-3)
    unclipped = weights_after(tmp_path, partial(adamw, fused=True), "16-mixed-scaled", None)
    # The two kernels round apart by ~1e-5 after 4 steps (8e-6 to 1.01e-5 measured, with the thread count); the
    # clip moves the weights by ~5e-3.
    assert largest_difference(fused, unfused) < 1e-4
    assert largest_difference(fused, unclipped) > 1e-3


def test_clip_unscaled_gradients_by_hand():
    """Against the arithmetic: gradients scaled by 8 are unscaled, then clipped to norm 1 (or to value 0.25)."""
    for algorithm, expected in (("norm", [0.6, 0.8]), ("value", [0.25, 0.25])):
        param = torch.nn.Parameter(torch.zeros(2))
        optimizer = torch.optim.SGD([param], lr=1.0, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
        assert float(scaler.scale(torch.ones(()))) == 8.0  # as a step's loss is scaled (this makes the scale)
        param.grad = torch.tensor([3.0, 4.0]) * 8.0
        clip_unscaled_gradients(optimizer, scaler, 1.0 if algorithm == "norm" else 0.25, algorithm)
        torch.testing.assert_close(param.grad, torch.tensor(expected))
        scaler.step(optimizer)  # recorded as unscaled: the step does not divide by 8 again
        torch.testing.assert_close(param.detach(), -torch.tensor(expected))
    with pytest.raises(ValueError, match="'norm' or 'value'"):
        clip_unscaled_gradients(optimizer, None, 1.0, "max")


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_the_gpu_preset_trains_with_its_clipping(shared_dir, tmp_path, precision):
    """``presets/gpu.yaml`` (fused AdamW) on ``configs/colbert.yaml`` (clip 2.0), as ``train.py`` runs it, on the
    CPU: before the fix, "does not allow for gradient clipping" at the first step."""
    done = subprocess.run(
        [sys.executable, "train.py", "fit", "--config", "configs/colbert.yaml",
         "--config", "configs/presets/smoke.yaml",
         "--config", "configs/presets/gpu.yaml", "--trainer.accelerator", "cpu", "--trainer.devices", "1",
         "--trainer.strategy", "auto", "--trainer.precision", precision, "--trainer.max_steps", "2",
         "--data.num_workers", "0", "--trainer.default_root_dir", str(tmp_path), "--export_dir", str(tmp_path / "x")],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "x" / "config.json").is_file()
