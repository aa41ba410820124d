"""SmoothQuant (Xiao et al. 2023, Eq. 4): move the range of a Linear layer's input activations into its weights.

An exact rewrite of each Linear layer ``y = x W^T`` as ``y = (x diag(s)^-1) (diag(s) W^T)`` with, per input
channel j, ``s_j = max|x_j|^alpha / max|W_:,j|^(1 - alpha)``; ``max|x_j|`` is measured on a few calibration
documents. The outputs are unchanged (to float rounding), but the rescaled activations have no outlier channels
left, so one per-tensor int8 scale serves them well. Used before quantizing a backbone, by PyTorch's dynamic
int8 (:mod:`hil.retrieval.fast_encode`) and by ONNX Runtime's (:mod:`hil.retrieval.onnx_encode`).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn

from hil.modeling.encoder import MultiVectorEncoder

DEFAULT_ALPHA = 0.7


class SmoothedLinear(nn.Module):
    """``inner(x * inv_scale)``: a Linear whose weights were multiplied by ``1 / inv_scale`` per input channel."""

    def __init__(self, inv_scale: Tensor, inner: nn.Module):
        super().__init__()
        self.register_buffer("inv_scale", inv_scale)
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x * self.inv_scale)


def linear_children(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear, str]]:
    """(parent, attribute, Linear, dotted name) of every Linear layer inside ``model``."""
    found = []
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                found.append((parent, name, child, f"{parent_name}.{name}" if parent_name else name))
    return found


def activation_ranges(encoder: MultiVectorEncoder, texts: Sequence[str], batch_size: int = 16) -> dict[str, Tensor]:
    """Per input channel, the largest |activation| entering each backbone Linear layer over ``texts``.

    Only attended (non-padding) positions count: padding rows would otherwise widen the ranges.
    """
    ranges: dict[str, Tensor] = {}
    state: dict[str, Tensor] = {}
    hooks = []
    for _, _, linear, name in linear_children(encoder.backbone):
        def hook(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor, name: str = name) -> None:
            x = inputs[0].detach()
            keep = state["mask"].reshape(-1) if x.dim() == 3 and "mask" in state else None
            x = x.reshape(-1, x.shape[-1])
            if keep is not None and keep.numel() == x.shape[0]:
                x = x[keep]
            top = x.abs().amax(dim=0)
            ranges[name] = torch.maximum(ranges[name], top) if name in ranges else top
        hooks.append(linear.register_forward_hook(hook))
    was_training = encoder.training
    encoder.eval()
    try:
        with torch.inference_mode():
            for start in range(0, len(texts), batch_size):
                batch = encoder.tokenizer.encode_documents(list(texts[start: start + batch_size]))
                state["mask"] = batch.attention_mask.bool()
                encoder.encode(batch, is_query=False)
    finally:
        for handle in hooks:
            handle.remove()
        encoder.train(was_training)
    return ranges


def smooth_backbone(encoder: MultiVectorEncoder, ranges: dict[str, Tensor], alpha: float = DEFAULT_ALPHA) -> None:
    """Rewrite every backbone Linear named in ``ranges`` in place as :class:`SmoothedLinear` (same outputs)."""
    for parent, attribute, linear, name in linear_children(encoder.backbone):
        if name not in ranges:
            continue
        weight_range = linear.weight.detach().abs().amax(dim=0).clamp(min=1e-5)  # (in,)
        scale = (ranges[name].clamp(min=1e-5) ** alpha / weight_range ** (1.0 - alpha)).clamp(min=1e-5)
        with torch.no_grad():
            linear.weight.mul_(scale[None, :])
        setattr(parent, attribute, SmoothedLinear((1.0 / scale).to(linear.weight.dtype), linear))
