"""The cross-rank in-batch loss as training runs it: the real ``InBatchCE`` through the real gather, two gloo ranks.

Each rank holds its own triples (uneven batch sizes and document lengths); ``InBatchCE`` gathers every rank's
documents and scores its queries against all of them, query i of rank r having its positive at row
``offset_r + i`` of the gathered batch. The reference is one process holding the concatenated batch, written out
by hand: MaxSim by loops, cross-entropy as -log softmax. It checks each rank's loss and logged parts, and that the
gradients after backward equal those of the sum of the ranks' losses on the concatenated batch (what DDP averages).

Keep this module's top-level imports light (no Lightning, no transformers): spawned workers import it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import gloo_group, run_spawned

QUERIES_PER_RANK = (3, 2)   # uneven on purpose
DOC_LENGTHS = (5, 7)        # rank 1's documents are longer than rank 0's
QUERY_LENGTHS = (4, 6)      # and so are its queries
DIM = 8


def rank_batches():
    """Every rank's (queries (B_r, Lq_r, D), query mask, docs [pos; neg] (2 B_r, Ld_r, D), doc mask, doc ids)."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for b, ld, lq in zip(QUERIES_PER_RANK, DOC_LENGTHS, QUERY_LENGTHS):
        q_mask = torch.rand(b, lq, generator=generator) > 0.2
        q_mask[:, 0] = True
        q = F.normalize(torch.randn(b, lq, DIM, generator=generator), dim=-1) * q_mask[..., None]
        d_mask = torch.rand(2 * b, ld, generator=generator) > 0.3
        d_mask[:, 0] = True
        d = F.normalize(torch.randn(2 * b, ld, DIM, generator=generator), dim=-1) * d_mask[..., None]
        ids = torch.randint(1, 1000, (2 * b, ld), generator=generator)
        out.append((q, q_mask, d, d_mask, ids))
    return out


def slow_maxsim(q: np.ndarray, q_mask: np.ndarray, d: np.ndarray, d_mask: np.ndarray) -> float:
    total = 0.0
    for i in range(len(q)):
        if q_mask[i]:
            total += max(float(np.dot(q[i], d[j])) for j in range(len(d)) if d_mask[j])
    return total


def reference_losses(batches) -> tuple[list[float], list[list[float]], list[list[float]], int]:
    """Per rank: the mean over its queries of -log softmax over ALL ranks' documents at the query's own positive
    (global row offset_r + i, offset_r = the documents of the ranks before r); and each query's (pos, neg)
    scores; the number of documents."""
    docs = [(d[k].numpy(), m[k].numpy()) for _, _, d, m, _ in batches for k in range(len(d))]
    losses, positives, negatives = [], [], []
    offset = 0
    for q, q_mask, d, _, _ in batches:
        b = len(q)
        per_query, pos, neg = [], [], []
        for i in range(b):
            row = [slow_maxsim(q[i].numpy(), q_mask[i].numpy(), dv, dm) for dv, dm in docs]
            top = max(row)
            log_norm = top + math.log(sum(math.exp(s - top) for s in row))
            per_query.append(log_norm - row[offset + i])
            pos.append(row[offset + i])
            neg.append(row[offset + b + i])
        losses.append(sum(per_query) / b)
        positives.append(pos)
        negatives.append(neg)
        offset += len(d)
    return losses, positives, negatives, len(docs)


def reference_gradients(batches):
    """d(sum over ranks of each rank's loss)/d(queries, documents) on the concatenated batch, with MaxSim written
    as a padded einsum and a masked max here (not the library's)."""
    lq, ld = max(QUERY_LENGTHS), max(DOC_LENGTHS)
    qs = [q.clone().requires_grad_() for q, _, _, _, _ in batches]
    ds = [d.clone().requires_grad_() for _, _, d, _, _ in batches]
    q_all = torch.cat([F.pad(q, (0, 0, 0, lq - q.shape[1])) for q in qs])           # (sum B, Lq, D)
    q_mask = torch.cat([F.pad(m, (0, lq - m.shape[1])) for _, m, _, _, _ in batches])
    d_all = torch.cat([F.pad(d, (0, 0, 0, ld - d.shape[1])) for d in ds])           # (N, Ld, D)
    d_mask = torch.cat([F.pad(m, (0, ld - m.shape[1])) for _, _, _, m, _ in batches])
    sim = torch.einsum("qid,njd->qnij", q_all, d_all).masked_fill(~d_mask[None, :, None, :], -1e9)
    scores = (sim.max(dim=-1).values * q_mask[:, None, :]).sum(dim=-1)            # (sum B, N)
    total, row, offset = 0.0, 0, 0
    for q, _, d, _, _ in batches:
        b = len(q)
        targets = offset + torch.arange(b)
        total = total + F.cross_entropy(scores[row: row + b], targets)
        row, offset = row + b, offset + len(d)
    total.backward()
    return [q.grad for q in qs], [d.grad for d in ds]


class LateInteraction:
    """The scoring part of an encoder, as ``InBatchCE`` calls it (``score``: every query against every document)."""

    def score(self, queries, docs):
        from hil.modeling.scoring import late_interaction_matrix

        return late_interaction_matrix(queries.heads["colbert"], docs.heads["colbert"], queries.mask, docs.mask)


def _worker(rank: int, world: int, port: int) -> None:
    with gloo_group(rank, world, port):
        torch.set_num_threads(1)
        from hil.modeling.contracts import EncodedBatch
        from hil.modeling.losses import InBatchCE, TripleBatch

        batches = rank_batches()
        ref_losses, ref_pos, ref_neg, n_docs = reference_losses(batches)
        ref_q_grads, ref_d_grads = reference_gradients(batches)
        q, q_mask, d, d_mask, ids = batches[rank]
        q, d = q.clone().requires_grad_(), d.clone().requires_grad_()
        q_ids = torch.randint(1, 1000, q_mask.shape)
        triples = TripleBatch(EncodedBatch({"colbert": q}, q_mask, q_ids), EncodedBatch({"colbert": d}, d_mask, ids))
        out = InBatchCE()(LateInteraction(), triples)

        assert abs(float(out.loss) - ref_losses[rank]) < 1e-5, (rank, float(out.loss), ref_losses[rank])
        assert float(out.parts["in_batch_candidates"]) == n_docs
        b = len(q)
        accuracy = sum(p > n for p, n in zip(ref_pos[rank], ref_neg[rank])) / b
        margin = sum(p - n for p, n in zip(ref_pos[rank], ref_neg[rank])) / b
        assert abs(float(out.parts["pair_accuracy"]) - accuracy) < 1e-6, (rank, accuracy)
        assert abs(float(out.parts["score_margin"]) - margin) < 1e-5, (rank, margin)
        out.loss.backward()
        torch.testing.assert_close(q.grad, ref_q_grads[rank], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(d.grad, ref_d_grads[rank], rtol=1e-4, atol=1e-6)


def test_reference_itself_is_the_one_process_in_batch_loss():
    """On one process (offset 0) the real loss over the concatenated batch of rank 0 equals the reference's rank 0
    value computed over rank 0's documents alone -- a check of the reference's target convention."""
    from hil.modeling.contracts import EncodedBatch
    from hil.modeling.losses import InBatchCE, TripleBatch

    q, q_mask, d, d_mask, ids = rank_batches()[0]
    triples = TripleBatch(EncodedBatch({"colbert": q}, q_mask, torch.ones_like(q_mask, dtype=torch.long)),
                          EncodedBatch({"colbert": d}, d_mask, ids))
    losses, _, _, _ = reference_losses([rank_batches()[0]])
    assert float(InBatchCE()(LateInteraction(), triples).loss) == pytest.approx(losses[0], abs=1e-5)


def test_in_batch_loss_on_two_ranks_equals_one_process_on_the_concatenated_batch():
    run_spawned(_worker)
