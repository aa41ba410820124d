"""Multi-process training on CPU (gloo): sharding, in-batch negatives across ranks, one checkpoint, equal weights.

Two layers:
- ``gather_padded`` / the cross-rank in-batch loss on two spawned gloo processes, against one process holding the
  concatenated batch (values, losses and gradients; uneven batch sizes and lengths);
- ``python train.py fit --trainer.strategy ddp --trainer.devices 2`` with the smoke preset, with a callback
  (``test_faults.RecordBatches``) that writes every rank's triples and a parameter fingerprint per step.

Keep this module's top-level imports light (no Lightning, no transformers): spawned workers import it.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hil.modeling.distributed import gather_encoded, gather_padded, is_distributed
from hil.modeling.losses import in_batch_ce_loss
from hil.modeling.scoring import late_interaction_matrix

from conftest import gloo_group, run_spawned

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
TRIPLES = "msmarco/triples.train.small.head1000.tsv"


# -- helpers --------------------------------------------------------------------------------------------------------
def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(REPO), env.get("PYTHONPATH", "")])
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


# -- spawned gloo workers -------------------------------------------------------------------------------------------
@dataclass
class Batch:  # stands in for hil.modeling.encoder.EncodedBatch (same fields) without importing transformers
    heads: dict
    mask: torch.Tensor
    input_ids: torch.Tensor

    def __len__(self) -> int:
        return self.mask.shape[0]


QUERIES_PER_RANK = (3, 2)   # uneven on purpose
DOC_LENGTHS = (5, 7)        # documents of rank 1 are longer: gathering must pad, not truncate rank 1 to 5
QUERY_LENGTH, DIM = 4, 8


def make_global_batch():
    """Every rank's queries (B_r, Lq, D) and documents [pos; neg] (2 B_r, L_r, D) with masks, same on all ranks."""
    generator = torch.Generator().manual_seed(0)
    ranks = []
    for b, length in zip(QUERIES_PER_RANK, DOC_LENGTHS):
        q = F.normalize(torch.randn(b, QUERY_LENGTH, DIM, generator=generator), dim=-1)
        d = F.normalize(torch.randn(2 * b, length, DIM, generator=generator), dim=-1)
        d_mask = torch.rand(2 * b, length, generator=generator) > 0.3
        d_mask[:, 0] = True
        ids = torch.randint(1, 100, (2 * b, length), generator=generator)
        ranks.append((q, d * d_mask[..., None], d_mask, ids))
    return ranks


def _reference(ranks):
    """One process, concatenated batch: per-rank mean CE over queries scored against all documents, summed."""
    length = max(DOC_LENGTHS)
    qs = [q.clone().requires_grad_() for q, _, _, _ in ranks]
    ds = [d.clone().requires_grad_() for _, d, _, _ in ranks]
    docs = torch.cat([F.pad(d, (0, 0, 0, length - d.shape[1])) for d in ds])  # (N, Lmax, D)
    mask = torch.cat([F.pad(m, (0, length - m.shape[1])) for _, _, m, _ in ranks])
    scores = late_interaction_matrix(torch.cat(qs), docs, None, mask)  # (sum B, N)
    offsets = [0, 2 * QUERIES_PER_RANK[0]]
    targets = torch.cat([off + torch.arange(b) for off, b in zip(offsets, QUERIES_PER_RANK)])
    per_query = F.cross_entropy(scores, targets, reduction="none")
    losses = list(per_query.split(list(QUERIES_PER_RANK)))
    per_rank = [loss.mean() for loss in losses]
    torch.stack(per_rank).sum().backward()
    return docs.detach(), mask, [float(loss) for loss in per_rank], [q.grad for q in qs], [d.grad for d in ds]


def _gather_worker(rank: int, world: int, port: int) -> None:
    with gloo_group(rank, world, port):
        torch.set_num_threads(1)
        ranks = make_global_batch()
        ref_docs, ref_mask, ref_losses, ref_q_grads, ref_d_grads = _reference(ranks)
        q, d, d_mask, ids = ranks[rank]
        q, d = q.clone().requires_grad_(), d.clone().requires_grad_()

        gathered = gather_padded(d, d_mask)
        assert gathered.values.shape == ref_docs.shape, (gathered.values.shape, ref_docs.shape)
        torch.testing.assert_close(gathered.values.detach(), ref_docs, rtol=0, atol=0)
        assert torch.equal(gathered.mask, ref_mask)
        assert gathered.offset == (0 if rank == 0 else 2 * QUERIES_PER_RANK[0])

        # the loss through the real pieces InBatchCE uses (gather_encoded, then in_batch_ce_loss at this rank's
        # offset); tests/test_ddp_inbatch_loss.py calls InBatchCE itself
        everyone, offset = gather_encoded(Batch({"colbert": d}, d_mask, ids))
        assert torch.equal(everyone.input_ids[offset: offset + len(ids), : ids.shape[1]], ids)
        scores = late_interaction_matrix(q, everyone.heads["colbert"], None, everyone.mask)
        loss = in_batch_ce_loss(scores, offset)
        assert abs(float(loss) - ref_losses[rank]) < 1e-6, (float(loss), ref_losses[rank])
        loss.backward()
        # Gradients: this rank's queries and documents get d(sum of all ranks' losses)/d(them), i.e. after DDP's
        # averaging over ranks, the gradient of the mean of the per-rank losses on the concatenated batch.
        torch.testing.assert_close(q.grad, ref_q_grads[rank], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(d.grad, ref_d_grads[rank], rtol=1e-5, atol=1e-6)
        assert float(d.grad.abs().sum()) > 0

        assert is_distributed()


def test_gather_padded_and_cross_rank_in_batch_loss_match_one_process():
    run_spawned(_gather_worker)


def _moments_worker(rank: int, world: int, port: int) -> None:
    from hil.modeling.distributed import pooled_moments
    from hil.modeling.hil_scoring import batch_moments

    with gloo_group(rank, world, port):
        generator = torch.Generator().manual_seed(7)
        xs = [torch.randn(3 + r, 5, generator=generator) * (1 + r) + r for r in range(world)]
        masks = [torch.rand(x.shape, generator=generator) > 0.3 for x in xs]
        mean, std = pooled_moments(xs[rank], masks[rank], eps=1e-6)
        ref_mean, ref_std = batch_moments(torch.cat([x.reshape(-1) for x in xs]),
                                          torch.cat([m.reshape(-1) for m in masks]), eps=1e-6)
        torch.testing.assert_close(mean, ref_mean, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(std, ref_std, atol=1e-5, rtol=1e-5)


def test_pooled_moments_are_the_global_batch_moments_on_every_rank():
    """HIL's running z-score statistics: ranks with different batch sizes agree on the moments of all batches."""
    run_spawned(_moments_worker)


def test_pooled_moments_single_process_equal_batch_moments():
    from hil.modeling.distributed import pooled_moments
    from hil.modeling.hil_scoring import batch_moments

    x, mask = torch.randn(4, 6, dtype=torch.float64), torch.rand(4, 6) > 0.5
    for a, b in zip(pooled_moments(x, mask, 1e-6), batch_moments(x, mask, eps=1e-6)):
        torch.testing.assert_close(a, b.float(), atol=1e-6, rtol=1e-6)


def test_single_process_gather_is_identity():
    x, mask = torch.randn(2, 3, 4), torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    gathered = gather_padded(x, mask)
    assert gathered.values is x and torch.equal(gathered.mask, mask) and gathered.offset == 0


# -- the CLI under DDP ----------------------------------------------------------------------------------------------
def read_records(directory: Path) -> dict[int, list[dict]]:
    return {int(p.stem.removeprefix("rank")): [json.loads(line) for line in p.read_text().splitlines()]
            for p in sorted(directory.glob("rank*.jsonl"))}


@pytest.mark.integration
def test_cli_ddp_two_cpu_processes(shared_dir, tmp_path):
    from hil.data.triples import read_triples
    from hil.paths import resolve_data_file

    records_dir = tmp_path / "records"
    command = [sys.executable, str(REPO / "train.py"), "fit",
               "--config", str(REPO / "configs/colbert.yaml"), "--config", str(REPO / "configs/presets/smoke.yaml"),
               "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.logger", "false",
               "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu", "--trainer.devices", "2",
               "--trainer.max_steps", "2", "--model.loss", "hil.modeling.losses.InBatchCE",
               "--trainer.callbacks+=test_faults.RecordBatches", f"--trainer.callbacks.out_dir={records_dir}"]
    env = subprocess_env()
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]

    records = read_records(records_dir)
    assert sorted(records) == [0, 1]
    # 32 triples, batch 8 per rank, 2 ranks: one epoch is 2 steps, each rank reads 16 triples, none twice
    expected = collections.Counter(tuple(t) for t in
                                   (map(tuple, [(t.query, t.positive, t.negative) for t in
                                                read_triples(resolve_data_file(TRIPLES), limit=32)])))
    seen = {rank: collections.Counter(tuple(t) for r in recs for t in r["triples"]) for rank, recs in records.items()}
    assert sum(seen[0].values()) == sum(seen[1].values()) == 16
    assert not (set(seen[0]) & set(seen[1])), "ranks read overlapping samples"
    assert seen[0] + seen[1] == expected, "the ranks' shards do not cover the data exactly once"
    # after every step, the weights are identical on both ranks (DDP averaged the gradients), and they moved
    for step in (1, 2):
        fingerprints = {records[r][step - 1]["params"] for r in (0, 1)}
        assert all(records[r][step - 1]["step"] == step for r in (0, 1))
        assert len(fingerprints) == 1, f"ranks' weights differ after step {step}"
    assert records[0][0]["params"] != records[0][1]["params"]
    # in-batch negatives span both ranks: each query is scored against 2 ranks x 2 x 8 documents
    assert all(r["in_batch_candidates"] == 32.0 for recs in records.values() for r in recs)

    # checkpoints are written once (by rank 0), with the loader position of the whole world
    checkpoint_dir = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoint_dir.iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert not list((tmp_path / "run").rglob("*rank*"))
    state = torch.load(checkpoint_dir / "last.ckpt", map_location="cpu", weights_only=False)
    assert state["global_step"] == 2
    loader_state = state["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert loader_state["_sampler_iter_state"]["sampler_state"] == {"epoch": 0, "consumed": 32, "world_size": 2}
