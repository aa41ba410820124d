"""Two ranks resume exactly (issue 16, item 4): a 2-process gloo run SIGKILLed mid-epoch and resumed from its last
checkpoint ends with the weights, optimizer and scheduler state of an uninterrupted 2-process run.

Three ``python train.py fit --trainer.strategy ddp --trainer.devices 2`` runs on CPU (gloo), with the smoke preset
cut to batches of 4 (32 triples: 16 per rank, 4 steps an epoch), checkpoints every 2 steps, 6 steps, cross-rank
in-batch negatives (``InBatchCE``: every rank's gradient depends on the other rank's batch), a learning rate that
changes every step (warm-up over 10 steps, so the scheduler's state matters) and dropout on:

1. the reference, uninterrupted;
2. the same run, started in a session of its own; when both ranks have finished step 3 (the last checkpoint is step
   2's) the whole process group -- launcher (rank 0) and rank 1 -- gets SIGKILL;
3. a resume of (2) from ``last.ckpt`` (step 2) on 2 processes, to step 6, under another ``seed_everything`` (so
   nothing random may come from the global seed): it redoes step 3, finishes epoch 0 and starts epoch 1.

``test_faults.RecordBatches`` writes, per rank and step, the triples read and a fingerprint of the weights after the
step. The resumed run must read on each rank exactly the batches the reference read after step 2 and hold the same
weights after each step, and its final checkpoint must equal the reference's tensor for tensor (``torch.equal``: on
CPU, gloo sums two ranks' gradients the same way every time, so no tolerance is needed).

What makes this hold: the sampler's position (``hil.data.datamodule.EpochShuffleSampler``, all ranks' count in
rank 0's checkpoint, each rank skipping its share), ``hil.modeling.callbacks.StepReseed`` (dropout seeded from
(seed, epoch, batch, rank), base seed in the checkpoint), and Lightning restoring optimizer and scheduler state.
Checked by breaking each and watching this test fail: the sampler not restoring its position, or skipping the
all-ranks count on every rank; no per-batch reseed; StepReseed not restoring its base seed (caught because the
resume runs under another global seed); Adam's moments or the scheduler's state dropped on load.
Runtime about 50-80 s on 2 busy cores (three 2-rank runs, two of them at once). The same with a ColBERTv2 n-way file
(KL distillation + cross-rank in-batch negatives) is the slow-marked `nway` case (issue 22: exact resume from an
n-way file on two ranks).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_ddp import read_records, subprocess_env
from test_faults import assert_same_tensors, load

from conftest import free_port

REPO = Path(__file__).resolve().parents[1]
STEPS, KILL_AFTER, CHECKPOINT = 6, 3, 2  # 6 steps; killed after step 3; the last checkpoint then is step 2's


def nway_examples(folder: Path, shared_dir: Path) -> list[str]:
    """The smoke preset's 32 MS MARCO triples as a ColBERTv2 n-way file (3 documents a query: the positive, its
    negative and the next query's negative, with teacher scores), and the options that train from it with KL
    distillation plus cross-rank in-batch negatives (issue 22: exact resume from an n-way file on two ranks)."""
    lines = (shared_dir / "data" / "msmarco" / "triples.train.small.head1000.tsv").read_text(
        encoding="utf-8").splitlines()[:33]
    triples = [line.split("\t") for line in lines]
    passages = {}
    pid = lambda text: passages.setdefault(text, f"p{len(passages)}")  # noqa: E731
    with open(folder / "queries.tsv", "w", encoding="utf-8") as queries, \
            open(folder / "examples.jsonl", "w", encoding="utf-8") as examples:
        for i, (query, positive, negative) in enumerate(triples[:32]):
            queries.write(f"q{i}\t{query}\n")
            other = triples[i + 1][2]
            examples.write(json.dumps([f"q{i}", [pid(positive), 3.0], [pid(negative), 0.5], [pid(other), 1.5]]) + "\n")
    (folder / "collection.tsv").write_text("".join(f"{p}\t{' '.join(t.split())}\n" for t, p in passages.items()),
                                          encoding="utf-8")
    return ["--data.source", "NWayExamples", "--data.source.path", str(folder / "examples.jsonl"),
            "--data.source.queries", str(folder / "queries.tsv"), "--data.source.collection",
            str(folder / "collection.tsv"), "--data.nway", "3",
            "--model.loss", "hil.modeling.losses.KLDistillation",
            "--model.terms+=hil.modeling.losses.InBatchCE"]


def command(root: Path, records: Path, *extra: str) -> list[str]:
    return [sys.executable, str(REPO / "train.py"), "fit",
            "--config", str(REPO / "configs/colbert.yaml"), "--config", str(REPO / "configs/presets/smoke.yaml"),
            "--trainer.default_root_dir", str(root), "--trainer.logger", "false", "--trainer.deterministic", "true",
            "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu", "--trainer.devices", "2",
            "--trainer.max_steps", str(STEPS), "--data.batch_size", "4",
            "--model.loss", "hil.modeling.losses.InBatchCE", "--model.lr_scheduler.warmup_steps", "10",
            "--trainer.callbacks+=test_faults.RecordBatches", f"--trainer.callbacks.out_dir={records}", *extra]


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    """A training run in a session (and process group) of its own, which its rank-1 child joins."""
    env = subprocess_env()
    env["OMP_NUM_THREADS"] = "1"  # every run of this test reduces floats with the same number of threads
    env["MASTER_PORT"] = str(free_port())  # two 2-rank runs at once must not meet on one port
    return subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(process: subprocess.Popen, timeout: float = 400) -> None:
    _, stderr = process.communicate(timeout=timeout)
    assert process.returncode == 0, stderr[-3000:]


def live_members(pgid: int) -> list[int]:
    """Processes of group ``pgid`` that are not zombies (from /proc, no psutil here)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def kill_group(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while live_members(process.pid):
        assert time.monotonic() < deadline, f"ranks outlived the SIGKILL: {live_members(process.pid)}"
        time.sleep(0.1)


def steps_recorded(records: Path) -> list[int]:
    return [len(read_records(records).get(rank, [])) for rank in (0, 1)]


@pytest.mark.integration
@pytest.mark.parametrize("data", ["triples", pytest.param("nway", marks=pytest.mark.slow)])
def test_two_rank_run_killed_mid_epoch_resumes_to_the_uninterrupted_weights(shared_dir, tmp_path, data):
    source = nway_examples(tmp_path, shared_dir) if data == "nway" else []
    reference_root, reference_records = tmp_path / "reference", tmp_path / "reference_records"
    killed_root, killed_records = tmp_path / "killed", tmp_path / "killed_records"
    killed_records.mkdir()
    reference = start(command(reference_root, reference_records, *source), tmp_path)
    killed = start(command(killed_root, killed_records, *source, f"--trainer.callbacks.pause_at_step={KILL_AFTER}"),
                   tmp_path)
    try:
        deadline = time.monotonic() + 400
        # RecordBatches writes `paused` before the batch of step KILL_AFTER + 1, after step KILL_AFTER's records
        while not ((killed_records / "paused").exists() and steps_recorded(killed_records) == [KILL_AFTER] * 2):
            assert killed.poll() is None, f"training exited early: {killed.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, f"training never reached step {KILL_AFTER}"
            time.sleep(0.2)
        kill_group(killed)
        finish(reference)
    finally:
        for process in (killed, reference):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()

    # what the kill left: step 2's checkpoint (step 3's work is lost), with the loader position of both ranks
    checkpoints = killed_root / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [f"epoch=0-step={CHECKPOINT}.ckpt", "last.ckpt"]
    last = load(checkpoints / "last.ckpt")
    assert last["global_step"] == CHECKPOINT
    (loader_state,) = last["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert loader_state["_sampler_iter_state"]["sampler_state"] == {"epoch": 0, "consumed": 16, "world_size": 2}
    assert_same_tensors(last["state_dict"], load(reference_root / "checkpoints" / f"epoch=0-step={CHECKPOINT}.ckpt")
                        ["state_dict"], f"weights at step {CHECKPOINT}")

    resumed_root, resumed_records = tmp_path / "resumed", tmp_path / "resumed_records"
    # resumed under another global seed: everything random must come from the checkpoint (StepReseed's base seed
    # included, which would otherwise be taken from this seed_everything) or from the data's own seed
    finish(start(command(resumed_root, resumed_records, *source, "--seed_everything", "999",
                         "--ckpt_path", str(checkpoints / "last.ckpt")), tmp_path))

    expected, crashed, resumed = (read_records(d) for d in (reference_records, killed_records, resumed_records))
    assert sorted(expected) == sorted(crashed) == sorted(resumed) == [0, 1]
    for rank in (0, 1):
        assert [r["step"] for r in expected[rank]] == list(range(1, STEPS + 1))
        assert [r["step"] for r in crashed[rank]] == list(range(1, KILL_AFTER + 1))
        assert [r["step"] for r in resumed[rank]] == list(range(CHECKPOINT + 1, STEPS + 1))
        assert all(r["world"] == 2 for r in resumed[rank])
        # steps 3-4 finish epoch 0, steps 5-6 start epoch 1's permutation
        assert [(r["epoch"], r["batch_idx"]) for r in resumed[rank]] == [(0, 2), (0, 3), (1, 0), (1, 1)]
        for name, run, first in (("killed", crashed[rank], 0), ("resumed", resumed[rank], CHECKPOINT)):
            for got, ref in zip(run, expected[rank][first:]):
                where = f"{name} run, rank {rank}, step {got['step']}"
                assert (got["epoch"], got["batch_idx"]) == (ref["epoch"], ref["batch_idx"]), where
                assert got["triples"] == ref["triples"], f"{where}: other triples than the uninterrupted run's"
                assert got["params"] == ref["params"], f"{where}: other weights than the uninterrupted run's"
    for step in range(STEPS):  # the two ranks read disjoint shards and hold one set of weights
        assert not {tuple(t) for t in expected[0][step]["triples"]} & {tuple(t) for t in expected[1][step]["triples"]}
        assert expected[0][step]["params"] == expected[1][step]["params"]

    final_reference = load(reference_root / "checkpoints" / "last.ckpt")
    final_resumed = load(resumed_root / "checkpoints" / "last.ckpt")
    assert final_resumed["global_step"] == final_reference["global_step"] == STEPS
    assert_same_tensors(final_resumed["state_dict"], final_reference["state_dict"], "final weights")
    assert_same_tensors(final_resumed["optimizer_states"], final_reference["optimizer_states"], "optimizer")
    assert_same_tensors(final_resumed["lr_schedulers"], final_reference["lr_schedulers"], "lr scheduler")
    assert {int(s["step"]) for s in final_resumed["optimizer_states"][0]["state"].values()} == {STEPS}
    assert final_resumed["lr_schedulers"][0]["last_epoch"] == STEPS
    assert final_resumed["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(1e-4 * (STEPS + 1) / 10)
    loader_states = [final["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["_sampler_iter_state"]
                     ["sampler_state"] for final in (final_resumed, final_reference)]
    assert loader_states == [{"epoch": 1, "consumed": 16, "world_size": 2}] * 2
    # dropout was on, so equal weights also show that each rank's random stream was restored
    config = json.loads((shared_dir / "models" / "bert-tiny-splade" / "config.json").read_text())
    assert config["hidden_dropout_prob"] > 0 and config["attention_probs_dropout_prob"] > 0
