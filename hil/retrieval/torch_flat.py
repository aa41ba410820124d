"""Exact inner-product token search in torch on an accelerator: the ``flat`` back-end's search where FAISS cannot
run on the GPU.

faiss-gpu wheels are built per CUDA version and none matches current CUDA 13 builds of torch (issue 29), so with
faiss-cpu a GPU encoder's ``flat`` search would cross to the host and run on the CPU. :class:`TorchFlatSearch`
answers FAISS ``IndexFlatIP.search``'s question (each query vector's ``k`` largest inner products over every stored
token, and their rows) on the device holding the token table (uploaded once by
:mod:`hil.retrieval.device_tokens`): one (T, D) x (D, block) product per block of stored rows, each block's top k
merged into a running top k. Vectors are the stored fp16 widened to fp32, as FAISS's flat index holds them.

The neighbours are FAISS's up to float rounding: a product computed by other kernels may round the last bit
differently, and among equal similarities the two may keep different rows (``tests/test_batched_search.py`` checks
the candidates against FAISS's on the CPU).
"""

from __future__ import annotations

import numpy as np
import torch

from hil.retrieval.integrity import NonFiniteError

# Stored rows multiplied at once: bounds the (T, block) similarity table (T = query tokens of a batch).
_BLOCK_ROWS = 1 << 18


class TorchFlatSearch:
    """``search(vectors, k)`` as FAISS's ``IndexFlatIP`` over ``table`` (n_tokens, D), on ``table``'s device."""

    def __init__(self, table: torch.Tensor, where: str = "token search", block_rows: int = _BLOCK_ROWS):
        # FAISS never returns a NaN neighbour, so a damaged table must be refused before any search (one check).
        if not bool(torch.isfinite(table).all()):
            raise NonFiniteError(f"{where}: the stored vectors hold NaN or inf: the index is damaged; rebuild it")
        self.table = table
        self.block_rows = block_rows

    @property
    def ntotal(self) -> int:
        return int(self.table.shape[0])

    def search(self, vectors: np.ndarray | torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(T, D) query vectors -> (similarities (T, k) float32, rows (T, k) int64), best first; rows -1 (and
        similarity -FLT_MAX) past the table's size, as FAISS pads."""
        device = self.table.device
        queries = torch.as_tensor(vectors).to(device=device, dtype=torch.float32)
        n_queries, kept = len(queries), min(k, self.ntotal)
        best = torch.full((n_queries, 0), float("-inf"), device=device)
        rows = torch.zeros((n_queries, 0), dtype=torch.int64, device=device)
        for start in range(0, self.ntotal, self.block_rows):
            block = self.table[start: start + self.block_rows].float()
            sims = queries @ block.T  # (T, b)
            top = sims.topk(min(kept, sims.shape[1]), dim=1)
            merged = torch.cat([best, top.values], dim=1)
            merged_rows = torch.cat([rows, top.indices + start], dim=1)
            order = merged.topk(min(kept, merged.shape[1]), dim=1).indices
            best, rows = merged.gather(1, order), merged_rows.gather(1, order)
        if kept < k:  # FAISS's padding
            lowest = float(np.finfo(np.float32).min)
            best = torch.cat([best, torch.full((n_queries, k - kept), lowest, device=device)], dim=1)
            rows = torch.cat([rows, torch.full((n_queries, k - kept), -1, dtype=torch.int64, device=device)], dim=1)
        return best.cpu().numpy(), rows.cpu().numpy()
