"""Multi-process (DDP) helpers: who am I, in-batch negatives gathered from every rank, moments pooled over ranks.

Lightning's ``strategy: ddp`` runs one process per device and each reads its own shard of the data
(``hil.data.datamodule.EpochShuffleSampler`` shards by rank). Two things in a training step need the other ranks
(a third, the joint decision to skip a non-finite step, is Lightning's ``strategy.reduce_boolean_decision``):

- In-batch negatives: a query is scored against the documents of *all* ranks, as if the global batch sat on one
  device. ``gather_padded`` pads every rank's ``(B, L, D)`` tensor to a common ``(Bmax, Lmax)`` before
  ``all_gather`` -- documents are never truncated to another rank's length -- and drops the padding rows after.
- ColBERT-HIL's running z-score statistics: ``pooled_moments`` sums the batch moments over ranks, so every rank
  updates the same running estimates.

Everything here is a no-op with one process (no process group, or a group of size 1).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Gathered(NamedTuple):
    """Every rank's batch, in rank order, padded to a common length; padding rows already dropped."""

    values: Tensor  # (N, Lmax, ...) with N = sum of the ranks' batch sizes; rank r owns rows [offsets[r], offsets[r+1])
    mask: Tensor    # (N, Lmax) bool, False on each row's padding tokens
    offset: int     # the first row of this rank's batch


def _pad_to(x: Tensor, rows: int, length: int) -> Tensor:
    """Zero-pad dims 0 and 1 of ``x`` (B, L, ...) to (rows, length, ...)."""
    padded = x.new_zeros((rows, length, *x.shape[2:]))
    padded[: x.shape[0], : x.shape[1]] = x
    return padded


class _AllGatherSumGrad(torch.autograd.Function):
    """all_gather whose backward sums the gradient of the gathered tensor over ranks and returns this rank's part.

    Why not the plain trick (gather without grad, put the local tensor back in its slot): then this rank's documents
    only receive gradient from this rank's queries. Summing the gathered gradient over ranks adds the terms from the
    other ranks' queries, so that after DDP averages parameter gradients the step is exactly the gradient of the mean
    of the ranks' losses -- the single-process gradient on the concatenated batch when batch sizes are equal.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # x (Bmax, Lmax, ...) -> (W, Bmax, Lmax, ...)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        return torch.stack(parts)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad[dist.get_rank()]


def _gather_no_grad(x: Tensor) -> Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.stack(parts)


def gather_padded(x: Tensor, mask: Tensor) -> Gathered:
    """All ranks' ``x`` (B_r, L_r, ...) and ``mask`` (B_r, L_r), concatenated in rank order. -> ``Gathered``.

    Batch sizes and lengths may differ across ranks: each rank pads to (max B, max L) for the collective (padded
    tokens get mask False, padded rows are dropped again), so nothing is truncated. Gradients flow back to every
    rank's own ``x`` (see ``_AllGatherSumGrad``); the mask carries none. Floating tensors in bf16/fp16 travel as fp32
    over gloo, which does not reduce half types everywhere. With one process this returns ``(x, mask, 0)``.
    """
    if not is_distributed():
        return Gathered(x, mask.bool(), 0)
    sizes = _gather_no_grad(torch.tensor([x.shape[0], x.shape[1]], dtype=torch.long, device=x.device))  # (W, 2)
    rows, lengths = sizes[:, 0].tolist(), sizes[:, 1].tolist()
    max_rows, max_length = max(rows), max(lengths)
    send = x
    if dist.get_backend() == "gloo" and x.dtype in (torch.float16, torch.bfloat16):
        send = x.float()
    values = _AllGatherSumGrad.apply(_pad_to(send, max_rows, max_length)).to(x.dtype)  # (W, Bmax, Lmax, ...)
    masks = _gather_no_grad(_pad_to(mask.to(torch.uint8), max_rows, max_length)).bool()  # (W, Bmax, Lmax)
    valid = torch.arange(max_rows, device=x.device)[None, :] < torch.tensor(rows, device=x.device)[:, None]  # (W, Bmax)
    offset = sum(rows[: dist.get_rank()])
    return Gathered(values[valid], masks[valid], offset)


def gather_encoded(batch: Any) -> tuple[Any, int]:
    """An ``EncodedBatch`` (every head, mask, input_ids) gathered from all ranks, and this rank's first row.

    ``encoder.score(queries, gathered)`` then scores local queries against every rank's documents; with one process
    the batch comes back unchanged with offset 0. Padding tokens get input id 0 and mask False.
    """
    if not is_distributed():
        return batch, 0
    heads = {name: gather_padded(values, batch.mask).values for name, values in batch.heads.items()}
    input_ids, mask, offset = gather_padded(batch.input_ids, batch.mask)
    return type(batch)(heads, mask, input_ids), offset


@torch.no_grad()
def pooled_moments(x: Tensor, mask: Tensor, eps: float, unbiased: bool = False) -> tuple[Tensor, Tensor]:
    """Mean and ``sqrt(var + eps)`` of the masked entries of ``x`` over every rank's batch (no gradient).

    On one process this is ``hil_scoring.batch_moments``; under DDP the count, sum and sum of squares are summed
    over ranks first, so every rank gets the moments of the global batch. ColBERT-HIL's running z-score estimates
    are updated with these: each rank then holds the same estimates (which DDP's buffer broadcast from rank 0
    would otherwise impose, keeping only rank 0's batches).
    """
    x = x.detach().to(torch.float64)
    weights = mask.to(x.dtype)
    totals = torch.stack([weights.sum(), (x * weights).sum(), (x.square() * weights).sum()])
    if is_distributed():
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    count = totals[0].clamp(min=1.0)
    mean = totals[1] / count
    variance = (totals[2] - count * mean.square()).clamp(min=0.0) / (count - float(unbiased)).clamp(min=1.0)
    return mean.float(), torch.sqrt(variance + eps).float()
