"""Host time and host syncs of a training step (issue 29): wall and CPU milliseconds per step, and how many times a
step makes the host wait for the device, for each ``--repo`` given, side by side in one run.

    python bench/training_step_host.py                                       # this repository
    git worktree add /tmp/before <commit> && python bench/training_step_host.py --repo /tmp/before --repo .

Each (repository, model, precision) trains in a child process through that repository's own ``train.py`` (its
``configs/colbert.yaml``, ``configs/variants/colbert_hil.yaml`` for ColBERT-HIL and ``configs/presets/smoke.yaml``:
the shared tiny BERT, on the CPU), so an older commit runs its own code: this file imports nothing from ``hil``.
The child gets a callback of this file on its command line (``--trainer.callbacks+=training_step_host.HostProbe``,
with ``bench/`` on ``PYTHONPATH``), which times the steps and, in a second child, counts the syncs:

- **time**: wall and process-CPU time from one ``on_train_batch_start`` to the next (the whole Lightning loop:
  data loading, forward, backward, optimizer, callbacks, logging), for the steps after ``--warmup``.
- **syncs** (:class:`SyncCounter`): every operation that makes the host wait for the device when the model is on
  a GPU -- a scalar read (``.item()``, ``bool()``, ``float()``, ``int()``: ``aten._local_scalar_dense``), ``nonzero``,
  boolean-mask indexing, ``unique``, ``repeat_interleave`` without an output size, ``equal``, and ``.tolist()``,
  ``.cpu()``, ``.numpy()`` -- on a tensor that lives where the model lives. On the CPU every tensor lives on the
  CPU, so "lives on the device" is tracked: the model's parameters and buffers and the batch's tensors are the
  device's, and so is every result of an operation that reads one of them. Tensors that stay on the host on a GPU
  too (the sampler's order, the optimizer's step counts of a non-fused AdamW) are then not counted. A host-to-device
  copy from pageable memory (``torch.tensor(x, device=cuda)``) also waits for the device, but looks like any other
  CPU tensor here: those are found by reading the code (``bench/README.md``). A copy made with ``.to(device)`` marks
  its result as the device's.

The JSON (``--output``) holds, per run: the settings, the milliseconds per step (median, mean), the syncs of each
step split into the steps that may read back (logging steps, ``--log-every``, and the last step) and the others, and
where the syncs were made (file, line, function, count). On the CPU a step's host time is mostly the tiny model's
own arithmetic, so the times compare the same configuration across repositories on one machine in one run, and
only roughly; the sync counts are exact.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import weakref
from collections import Counter
from pathlib import Path
from typing import Any, Iterable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MODEL_CONFIGS = {"colbert": [], "colbert_hil": ["configs/variants/colbert_hil.yaml"]}

try:  # the callback side (the children; tests) needs torch and Lightning, the driver only the standard library
    import pytorch_lightning as pl
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
except ImportError:  # pragma: no cover
    pl = torch = TorchDispatchMode = None  # type: ignore[assignment]


def _sync_ops() -> set:
    aten = torch.ops.aten
    names = ["_local_scalar_dense.default", "nonzero.default", "masked_select.default", "_unique2.default",
             "unique_dim.default", "unique_consecutive.default", "_unique.default", "repeat_interleave.Tensor",
             "equal.default", "bincount.default"]
    ops = set()
    for name in names:
        packet, overload = name.split(".")
        if hasattr(aten, packet):
            ops.add(getattr(getattr(aten, packet), overload))
    return ops


# Python methods that read a tensor back to the host without a dispatched operation on a CPU tensor.
HOST_METHODS = ("tolist", "cpu", "numpy")
# Frames that say nothing of where a sync was made: the counter itself and torch's plumbing.
PLUMBING = ("_tensor.py", os.sep + "utils" + os.sep, os.sep + "_dynamo" + os.sep, os.sep + "autograd" + os.sep,
            "module.py", "_compile.py", "overrides.py", "_ops.py")
TORCH = os.sep + "torch" + os.sep


def where_called() -> str:
    """``file:line function`` of the innermost frame outside torch, and ``via`` torch's innermost frame that is not
    its plumbing (an optimizer, a GradScaler) when there is one."""
    frames = [f for f in traceback.extract_stack()[:-2] if f.filename != __file__]

    def short(frame: traceback.FrameSummary) -> str:
        return f"{os.sep.join(Path(frame.filename).parts[-2:])}:{frame.lineno} {frame.name}"

    outside = next((f for f in reversed(frames) if TORCH not in f.filename), None)
    inside = next((f for f in reversed(frames) if TORCH in f.filename
                   and not any(p in os.sep + f.filename.split(TORCH)[-1] for p in PLUMBING)), None)
    text = short(outside) if outside is not None else "?"
    if inside is not None and (outside is None or frames.index(inside) > frames.index(outside)):
        text += f" via {short(inside)}"
    return text


class SyncCounter(TorchDispatchMode if TorchDispatchMode is not None else object):  # type: ignore[misc]
    """Counts the operations that would make the host wait for the device (see the module docstring), on tensors
    marked as the device's (:meth:`mark`) and on every result computed from one. ``step`` and ``logging`` say
    which step an event belongs to; ``events`` holds (step, logging, operation, where)."""

    def __init__(self) -> None:
        super().__init__()
        self._device: dict[int, weakref.ref] = {}
        self.events: list[tuple[int, bool, str, str]] = []
        self.step = -1
        self.logging = False
        self._saved: dict[str, Any] = {}
        self._ops = _sync_ops()

    # -- which tensors live on the device ----------------------------------------------------------------------
    def mark(self, tensors: Iterable[Any]) -> None:
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                key = id(tensor)
                self._device[key] = weakref.ref(tensor, lambda _, key=key: self._device.pop(key, None))

    def unmark(self, tensor: Any) -> None:
        self._device.pop(id(tensor), None)

    def on_device(self, tensor: Any) -> bool:
        ref = self._device.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None
        return ref is not None and ref() is tensor

    def mark_batch(self, batch: Any) -> None:
        """Every tensor of a batch (dicts, lists, dataclasses and objects holding tensors)."""
        seen: list[Any] = []

        def walk(item: Any, depth: int = 0) -> None:
            if depth > 4:
                return
            if isinstance(item, torch.Tensor):
                seen.append(item)
            elif isinstance(item, dict):
                for value in item.values():
                    walk(value, depth + 1)
            elif isinstance(item, (list, tuple)):
                for value in item[:64]:
                    walk(value, depth + 1)
            elif hasattr(item, "__dict__") and not isinstance(item, type):
                for value in vars(item).values():
                    walk(value, depth + 1)

        walk(batch)
        self.mark(seen)

    # -- counting ---------------------------------------------------------------------------------------------
    def record(self, what: str) -> None:
        self.events.append((self.step, self.logging, what, where_called()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        inputs, _ = tree_flatten((args, kwargs))
        from_device = any(self.on_device(item) for item in inputs)
        if from_device:
            if func in self._ops:
                self.record(str(func.overloadpacket.__name__))
            elif func.overloadpacket in (torch.ops.aten.index, torch.ops.aten.index_put, torch.ops.aten.index_put_) \
                    and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                            for i in (args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else [])):
                self.record("boolean-mask indexing")
        out = func(*args, **kwargs)
        if from_device:
            self.mark(tree_flatten(out)[0])
        return out

    def __enter__(self) -> "SyncCounter":
        counter = self
        for name in HOST_METHODS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def wrapped(tensor, *args, _original=original, _name=name, **kwargs):  # noqa: ANN001
                if not counter.on_device(tensor):
                    return _original(tensor, *args, **kwargs)
                counter.record(f".{_name}()")
                out = _original(tensor, *args, **kwargs)
                if _name == "cpu":  # on a GPU a new host tensor; here the same one: a copy, not the device's
                    out = out.clone()
                    counter.unmark(out)
                return out

            setattr(torch.Tensor, name, wrapped)
        original_to = self._saved["to"] = torch.Tensor.to

        def moved(tensor, *args, **kwargs):  # noqa: ANN001
            out = original_to(tensor, *args, **kwargs)
            if "device" in kwargs or any(isinstance(a, (str, torch.device, torch.Tensor)) for a in args):
                counter.mark([out])  # a copy to the device (on the CPU the same tensor): the device's from now on
            return out

        torch.Tensor.to = moved
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()
        return super().__exit__(*exc)

    # -- summaries --------------------------------------------------------------------------------------------
    def per_step(self) -> dict[int, int]:
        return dict(Counter(step for step, *_ in self.events))

    def sites(self, logging: bool | None = None) -> list[dict[str, Any]]:
        counts = Counter((what, where) for _, log, what, where in self.events if logging is None or log == logging)
        return [{"op": what, "where": where, "count": n} for (what, where), n in counts.most_common()]


def reads_back(trainer: Any) -> bool:
    """Whether the step about to run may read values back: Lightning writes its metrics to the loggers then
    (``log_every_n_steps``; the property Lightning's own ``LearningRateMonitor`` reads), or it is the last step."""
    last = 0 < trainer.max_steps <= trainer.global_step + 1
    return bool(trainer._logger_connector.should_update_logs) or last


class HostProbe(pl.Callback if pl is not None else object):  # type: ignore[misc]
    """Times every training step (``on_train_batch_start`` to the next), and with ``count_syncs`` counts its syncs
    (:class:`SyncCounter`, over the whole loop from the start of training); writes ``report`` (JSON) at the end.
    ``threads`` sets torch's intra-op threads at the start of training."""

    def __init__(self, report: str, count_syncs: bool = False, threads: int = 2):
        self.report = Path(report)
        self.count_syncs = count_syncs
        self.threads = threads
        self.counter: SyncCounter | None = None
        self.steps: list[dict[str, Any]] = []
        self._last: tuple[float, float] | None = None

    def on_train_start(self, trainer, pl_module):  # noqa: ANN001
        torch.set_num_threads(self.threads)
        if self.count_syncs:
            self.counter = SyncCounter()
            self.counter.mark([*pl_module.parameters(), *pl_module.buffers()])
            self.counter.__enter__()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001
        now = (time.perf_counter(), time.process_time())
        if self._last is not None:
            self.steps[-1].update(wall_ms=1e3 * (now[0] - self._last[0]), cpu_ms=1e3 * (now[1] - self._last[1]))
        self._last = now
        logging = reads_back(trainer)
        self.steps.append({"step": trainer.global_step, "logging": logging})
        if self.counter is not None:
            self.counter.step, self.counter.logging = trainer.global_step, logging
            self.counter.mark_batch(batch)

    def on_train_end(self, trainer, pl_module):  # noqa: ANN001
        if self.counter is not None:
            self.counter.__exit__(None, None, None)
        syncs = self.counter.per_step() if self.counter is not None else {}
        for step in self.steps:
            step["syncs"] = syncs.get(step["step"], 0) if self.counter is not None else None
        report = {"steps": self.steps, "precision": str(trainer.precision),
                  "sites_logging": self.counter.sites(True) if self.counter else None,
                  "sites_other": self.counter.sites(False) if self.counter else None}
        self.report.parent.mkdir(parents=True, exist_ok=True)
        self.report.write_text(json.dumps(report, indent=1))


# -- the driver --------------------------------------------------------------------------------------------------
def bench_preset(path: Path, report: Path, count_syncs: bool, args: argparse.Namespace) -> Path:
    """A YAML stacked last on the repository's configs: the steps, the logging interval, the callbacks
    (``colbert.yaml``'s learning-rate monitor and this probe; no checkpoints)."""
    probe = {"class_path": "training_step_host.HostProbe",
             "init_args": {"report": str(report), "count_syncs": count_syncs, "threads": args.threads}}
    preset = {"trainer": {"max_steps": args.steps if not count_syncs else args.count_steps,
                          "log_every_n_steps": args.log_every, "enable_progress_bar": False,
                          "enable_checkpointing": False, "precision": args.precision_now,
                          "callbacks": [{"class_path": "pytorch_lightning.callbacks.LearningRateMonitor",
                                         "init_args": {"logging_interval": "step"}}, probe]},
              "data": {"batch_size": args.batch_size, "max_triples": None, "num_workers": args.num_workers},
              "progress_lines": {"when": "never"}}
    path.write_text(json.dumps(preset))  # JSON is YAML
    return path


def run_child(repo: Path, model: str, work: Path, count_syncs: bool, args: argparse.Namespace) -> dict[str, Any]:
    tag = f"{repo.name}-{model}-{args.precision_now}-{'syncs' if count_syncs else 'time'}"
    report = work / f"{tag}.json"
    preset = bench_preset(work / f"{tag}.yaml", report, count_syncs, args)
    configs = ["configs/colbert.yaml", *MODEL_CONFIGS[model], "configs/presets/smoke.yaml"]
    command = [args.python, str(repo / "train.py"), "fit", *[a for c in configs for a in ("--config", str(repo / c))],
               "--config", str(preset), "--trainer.default_root_dir", str(work / tag)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), str(HERE)]), "OMP_NUM_THREADS": str(args.threads),
           "MKL_NUM_THREADS": str(args.threads), "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}
    check = subprocess.run([args.python, "-c", "import hil, sys; sys.stdout.write(hil.__file__)"], cwd=repo, env=env,
                           capture_output=True, text=True, check=True)
    if not Path(check.stdout).resolve().is_relative_to(repo.resolve()):
        raise SystemExit(f"--repo {repo}: `import hil` finds {check.stdout}, not that repository's package")
    done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True)
    if done.returncode != 0 or not report.is_file():
        raise SystemExit(f"{tag} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(report.read_text())


def summary(timed: dict[str, Any], counted: dict[str, Any], warmup: int) -> dict[str, Any]:
    steps = [s for s in timed["steps"][warmup:] if "wall_ms" in s]
    wall, cpu = [s["wall_ms"] for s in steps], [s["cpu_ms"] for s in steps]
    counts = counted["steps"]
    logging = [s["syncs"] for s in counts if s["logging"]]
    other = [s["syncs"] for s in counts if not s["logging"]]
    return {"timed_steps": len(steps),
            "wall_ms_median": statistics.median(wall), "wall_ms_mean": statistics.fmean(wall),
            "cpu_ms_median": statistics.median(cpu), "cpu_ms_mean": statistics.fmean(cpu),
            "syncs_per_step_other": statistics.fmean(other) if other else None,
            "syncs_max_other": max(other) if other else None,
            "syncs_per_step_logging": statistics.fmean(logging) if logging else None,
            "sites_other": counted["sites_other"], "sites_logging": counted["sites_logging"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", action="append", type=Path, default=None,
                        help="a checkout to measure (repeat for side by side; default: this one)")
    parser.add_argument("--models", default="colbert,colbert_hil", help="colbert,colbert_hil")
    parser.add_argument("--precisions", default="32-true,bf16-mixed", help="trainer.precision values")
    parser.add_argument("--steps", type=int, default=60, help="steps of each timed run")
    parser.add_argument("--warmup", type=int, default=10, help="steps not timed")
    parser.add_argument("--count-steps", type=int, default=12, help="steps of each sync-counting run")
    parser.add_argument("--log-every", type=int, default=5, help="trainer.log_every_n_steps")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-workers", type=int, default=0, help="data.num_workers")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--python", default=sys.executable, help="the interpreter of the children")
    parser.add_argument("--output", type=Path, default=HERE / "results" / "training_step_host.json")
    args = parser.parse_args(argv)
    if args.warmup >= args.steps:
        parser.error("--warmup must be below --steps")
    repos = [repo.resolve() for repo in (args.repo or [REPO])]
    runs = []
    with tempfile.TemporaryDirectory(prefix="training-step-host-") as tmp:
        for model in args.models.split(","):
            for precision in args.precisions.split(","):
                args.precision_now = precision
                for repo in repos:  # side by side: each configuration on every repository before the next
                    work = Path(tmp) / f"{len(runs)}"
                    work.mkdir()
                    timed = run_child(repo, model, work, False, args)
                    counted = run_child(repo, model, work, True, args)
                    row = {"repo": str(repo), "model": model, "precision": precision,
                           **summary(timed, counted, args.warmup)}
                    runs.append(row)
                    print(f"{repo.name:>20} {model:>12} {precision:>10}  wall {row['wall_ms_median']:7.1f} ms  "
                          f"cpu {row['cpu_ms_median']:7.1f} ms  syncs/step {row['syncs_per_step_other']} "
                          f"(logging steps {row['syncs_per_step_logging']})", flush=True)
    from measure import write_results  # the driver's side only: the children never import it

    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "precision_now"}
    settings["repo"] = [str(r) for r in repos]
    result = {"load_average": os.getloadavg(), "runs": runs}
    write_results(args.output, settings, sys.argv[1:] if argv is None else argv, result)
    print(f"wrote {args.output}")
    return result


if __name__ == "__main__":
    main()
