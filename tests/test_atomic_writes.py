"""Writing artifacts whole and one process at a time (issue 16): ``hil.provenance.file_lock``,
``atomic_directory`` and the results writer, with real second processes and SIGKILL.

The other process only imports ``hil.provenance`` (no torch), so these tests take about a second each.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hil.provenance import atomic_directory, file_digest, file_lock, lock_path

REPO = Path(__file__).resolve().parents[1]

# Hold a lock (argv[1] "lock") or sit inside an atomic_directory block (argv[1] "directory") until killed.
HOLDER = r"""
import sys, time
from pathlib import Path
from hil.provenance import atomic_directory, file_lock
what, path = sys.argv[1], Path(sys.argv[2])
if what == "lock":
    with file_lock(path):
        print("ready", flush=True)
        time.sleep(600)
else:
    with atomic_directory(path) as tmp:
        (tmp / "half.txt").write_text("half of the new content")
        print("ready", flush=True)
        time.sleep(600)
"""


def start_holder(what: str, path: Path) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", HOLDER, what, str(path)], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    if line.strip() != "ready":
        process.kill()
        pytest.fail(f"holder did not start: {process.communicate()[1][-2000:]}")
    return process


def kill(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)


def test_a_second_process_waits_for_the_lock_until_its_holder_dies(tmp_path, caplog):
    path = lock_path(tmp_path / "index")
    assert path == tmp_path / "index.lock"
    holder = start_holder("lock", path)
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=f"still locked by pid {holder.pid} on "):
            with file_lock(path, timeout=0.5):
                pass
        assert time.monotonic() - started >= 0.5
        assert f"locked by pid {holder.pid}" in caplog.text and "waiting" in caplog.text
    finally:
        kill(holder)  # SIGKILL: the kernel releases the lock, no stale lock is left behind
    with file_lock(path, timeout=5):
        assert path.read_text().startswith(f"pid {os.getpid()} ")


def test_the_lock_is_reentrant_in_a_process_and_serializes_its_threads(tmp_path):
    path = tmp_path / "x.lock"
    order = []

    def other_thread():
        with file_lock(path):
            order.append("thread")

    with file_lock(path):
        with file_lock(path):  # a locked function calling another that takes the same lock
            thread = threading.Thread(target=other_thread)
            thread.start()
            time.sleep(0.2)
            order.append("main")
    thread.join(timeout=10)
    assert order == ["main", "thread"]


COUNTER = """
import sys, time
from pathlib import Path
from hil.provenance import file_lock
lock, counter = Path(sys.argv[1]), Path(sys.argv[2])
for _ in range(int(sys.argv[3])):
    with file_lock(lock):
        value = int(counter.read_text())
        time.sleep(0.002)  # widens the window a second holder would need
        counter.write_text(str(value + 1))
"""


def test_the_lock_file_is_removed_and_the_lock_still_excludes(tmp_path):
    """Four processes each increment a shared counter 25 times under the lock: no increment is lost (the lock is
    exclusive even though every holder removes the lock file before it unlocks), and no ``.lock`` file is left."""
    import sys

    lock, counter = tmp_path / "index.lock", tmp_path / "counter"
    counter.write_text("0")
    workers = [subprocess.Popen([sys.executable, "-c", COUNTER, str(lock), str(counter), "25"]) for _ in range(4)]
    assert [w.wait(timeout=120) for w in workers] == [0, 0, 0, 0]
    assert int(counter.read_text()) == 100
    assert not lock.exists()
    with file_lock(lock):
        assert lock.is_file()
    assert not lock.exists()


def test_atomic_directory_replaces_whole_or_not_at_all(tmp_path):
    target = tmp_path / "export"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_directory(target) as tmp:
            (tmp / "new.txt").write_text("new")
            raise RuntimeError("boom")
    assert sorted(p.name for p in target.iterdir()) == ["old.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"], "the temporary folder is removed on error"
    with atomic_directory(target) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".export.")
        (tmp / "new.txt").write_text("new")
        assert (target / "old.txt").is_file(), "nothing changes before the block ends"
    assert sorted(p.name for p in target.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    with pytest.raises(FileExistsError, match="overwrite=True"):
        with atomic_directory(target, overwrite=False):
            pass


def test_a_writer_killed_inside_atomic_directory_leaves_the_old_folder(tmp_path):
    target = tmp_path / "export"
    target.mkdir()
    (target / "old.txt").write_text("old")
    kill(start_holder("directory", target))
    assert sorted(p.name for p in target.iterdir()) == ["old.txt"], "the target is never half replaced"
    leftovers = [p for p in tmp_path.iterdir() if p.name != "export"]
    assert len(leftovers) == 1 and (leftovers[0] / "half.txt").is_file()
    with atomic_directory(target) as tmp:  # the next writer removes what the dead one left
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_file_digest_is_sha256_of_the_bytes(tmp_path):
    import hashlib

    path = tmp_path / "blob"
    data = os.urandom(3 * (1 << 20) + 17)  # more than one 1 MiB block, not a multiple of it
    path.write_bytes(data)
    assert file_digest(path) == hashlib.sha256(data).hexdigest()


def test_results_are_written_under_the_folder_lock(tmp_path):
    """Two evaluations writing one results folder: the second waits for the first to finish all its files."""
    from hil.data.beir import BeirDataset
    from hil.evaluation.evaluate import Evaluation
    from hil.evaluation.results import RESULTS_LOCK, write_results

    dataset = BeirDataset("toy", {"d1": {"title": "", "text": "a"}}, {"q1": "a"}, {"q1": {"d1": 1}}, "test",
                          "memory")
    evaluation = Evaluation("run", {"q1": {"d1": 1.0}}, {"ndcg@10": 1.0}, {"q1": {"ndcg@10": 1.0}})
    folder = tmp_path / "results"
    holder = start_holder("lock", folder / RESULTS_LOCK)
    writer = threading.Thread(target=write_results, args=(folder, dataset, [evaluation], {}, {}))
    try:
        writer.start()
        time.sleep(1.0)
        assert writer.is_alive() and not (folder / "metrics.json").exists(), "written while another process wrote"
    finally:
        kill(holder)
    writer.join(timeout=30)
    assert json.loads((folder / "metrics.json").read_text())["results"]["run"]["metrics"] == {"ndcg@10": 1.0}
    assert sorted(p.name for p in folder.iterdir()) == ["metrics.json", "per_query.json", "run.trec"]  # no lock left
