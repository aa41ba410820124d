"""N-way in-batch negatives across two gloo ranks: the real ``InBatchCE`` (ColBERTv2's ``use_ib_negatives``, own
hard negatives excluded, or every document a candidate) through the real gather, against one process written out.

Each rank holds B_r queries with N = 3 documents each, laid out column by column (document j of query i at row
j B_r + i); the gathered batch is rank 0's N B_0 rows, then rank 1's. Query i of rank r has its positive at row
``offset_r + i`` and its own negatives at ``offset_r + j B_r + i``. The reference is a loop over the concatenated
batch: each rank's loss, and the gradients of the sum of the ranks' losses (what DDP averages).

Keep this module's top-level imports light (no Lightning, no transformers): spawned workers import it.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import gloo_group, run_spawned

QUERIES_PER_RANK = (3, 2)
N = 3
DOC_LENGTHS = (5, 7)
QUERY_LENGTHS = (4, 6)
DIM = 8


def rank_batches():
    generator = torch.Generator().manual_seed(1)
    out = []
    for b, ld, lq in zip(QUERIES_PER_RANK, DOC_LENGTHS, QUERY_LENGTHS):
        q_mask = torch.rand(b, lq, generator=generator) > 0.2
        q_mask[:, 0] = True
        q = F.normalize(torch.randn(b, lq, DIM, generator=generator), dim=-1) * q_mask[..., None]
        d_mask = torch.rand(N * b, ld, generator=generator) > 0.3
        d_mask[:, 0] = True
        d = F.normalize(torch.randn(N * b, ld, DIM, generator=generator), dim=-1) * d_mask[..., None]
        out.append((q, q_mask, d, d_mask))
    return out


def slow_maxsim(q, q_mask, d, d_mask) -> float:
    return sum(max(float(q[i] @ d[j]) for j in range(len(d)) if d_mask[j]) for i in range(len(q)) if q_mask[i])


def candidates(rank: int, i: int, excluded: bool) -> tuple[list[int], int]:
    """The gathered rows query i of ``rank`` is scored against, and the position of its positive among them."""
    sizes = [N * b for b in QUERIES_PER_RANK]
    offset, b = sum(sizes[:rank]), QUERIES_PER_RANK[rank]
    own_negatives = {offset + j * b + i for j in range(1, N)} if excluded else set()
    rows = [r for r in range(sum(sizes)) if r not in own_negatives]
    return rows, rows.index(offset + i)


def reference_losses(batches, excluded: bool) -> list[float]:
    docs = [(d[k], m[k]) for _, _, d, m in batches for k in range(len(d))]
    losses = []
    for rank, (q, q_mask, _, _) in enumerate(batches):
        total = 0.0
        for i in range(len(q)):
            rows, target = candidates(rank, i, excluded)
            scores = [slow_maxsim(q[i], q_mask[i], *docs[r]) for r in rows]
            top = max(scores)
            total += top + math.log(sum(math.exp(s - top) for s in scores)) - scores[target]
        losses.append(total / len(q))
    return losses


def reference_gradients(batches, excluded: bool):
    qs = [q.clone().requires_grad_() for q, _, _, _ in batches]
    ds = [d.clone().requires_grad_() for _, _, d, _ in batches]
    docs = [(d[k], m[k]) for d, (_, _, _, m) in zip(ds, batches) for k in range(len(d))]
    total = 0.0
    for rank, (q, (_, q_mask, _, _)) in enumerate(zip(qs, batches)):
        for i in range(len(q)):
            rows, target = candidates(rank, i, excluded)
            scores = []
            for r in rows:
                d, m = docs[r]
                sim = (q[i] @ d.T).masked_fill(~m[None, :], -1e9)       # (Lq, Ld)
                scores.append((sim.max(dim=1).values * q_mask[i]).sum())
            total = total - F.log_softmax(torch.stack(scores), dim=0)[target] / len(q)
    total.backward()
    return [q.grad for q in qs], [d.grad for d in ds]


class LateInteraction:
    def score(self, queries, docs):
        from hil.modeling.scoring import late_interaction_matrix

        return late_interaction_matrix(queries.heads["colbert"], docs.heads["colbert"], queries.mask, docs.mask)


def _worker(rank: int, world: int, port: int) -> None:
    with gloo_group(rank, world, port):
        torch.set_num_threads(1)
        from hil.modeling.batch import RankingBatch
        from hil.modeling.contracts import EncodedBatch
        from hil.modeling.losses import InBatchCE

        batches = rank_batches()
        for excluded in (True, False):
            q, q_mask, d, d_mask = batches[rank]
            q, d = q.clone().requires_grad_(), d.clone().requires_grad_()
            ids = torch.ones_like(d_mask, dtype=torch.long)
            batch = RankingBatch(EncodedBatch({"colbert": q}, q_mask, torch.ones_like(q_mask, dtype=torch.long)),
                                 EncodedBatch({"colbert": d}, d_mask, ids))
            out = InBatchCE(own_negatives="excluded" if excluded else "candidates")(LateInteraction(), batch)
            expected = reference_losses(batches, excluded)[rank]
            assert abs(float(out.loss) - expected) < 1e-5, (rank, excluded, float(out.loss), expected)
            assert float(out.parts["in_batch_candidates"]) == N * sum(QUERIES_PER_RANK) - (N - 1) * excluded
            out.loss.backward()
            q_grads, d_grads = reference_gradients(batches, excluded)
            torch.testing.assert_close(q.grad, q_grads[rank], rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(d.grad, d_grads[rank], rtol=1e-4, atol=1e-6)


def test_reference_on_one_process_is_the_real_loss_of_rank_zero_alone():
    """A check of the reference's layout: with one rank, its loss is the real loss on that rank's batch."""
    from hil.modeling.batch import RankingBatch
    from hil.modeling.contracts import EncodedBatch
    from hil.modeling.losses import InBatchCE

    global QUERIES_PER_RANK
    q, q_mask, d, d_mask = rank_batches()[0]
    saved, QUERIES_PER_RANK = QUERIES_PER_RANK, QUERIES_PER_RANK[:1]
    try:
        for excluded in (True, False):
            batch = RankingBatch(EncodedBatch({"colbert": q}, q_mask, torch.ones_like(q_mask, dtype=torch.long)),
                                 EncodedBatch({"colbert": d}, d_mask, torch.ones_like(d_mask, dtype=torch.long)))
            loss = InBatchCE(own_negatives="excluded" if excluded else "candidates")(LateInteraction(), batch).loss
            assert float(loss) == pytest.approx(reference_losses([(q, q_mask, d, d_mask)], excluded)[0], abs=1e-5)
    finally:
        QUERIES_PER_RANK = saved


@pytest.mark.slow  # two spawned processes (~30 s on 2 busy cores); the exclusion's offsets are also checked on one
def test_nway_in_batch_loss_on_two_ranks_equals_one_process_written_out():  # process (test_loss_functions.py)
    run_spawned(_worker)
