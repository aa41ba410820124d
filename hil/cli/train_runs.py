"""What ``hil fit`` (:mod:`hil.cli.train`) checks of a run before training, and keeps of it between commands.

- **An interrupted run.** Ctrl-C stops training after the running step with ``last.ckpt`` written there
  (:class:`hil.modeling.interrupts.StopAtStepEnd`); the command prints the exact command that resumes (the same
  arguments and ``--ckpt_path <that last.ckpt>``), exits with status 130, and records the run in
  ``<default_root_dir>/interrupted.json``. The same command again, without ``--ckpt_path``, does not start over
  silently in a new ``version_N``: with ``--resume`` unset it stops with one line naming the ``--ckpt_path`` to
  resume from and the setting that starts afresh (exit 2); ``--resume auto`` resumes from the recorded checkpoint;
  ``--resume never`` starts a new run beside the interrupted one (whose files stay). A run that completes removes
  the record.
- **A checkpoint that does not fit the config**: ``--ckpt_path`` of a ColBERT run with the ColBERT-HIL config, say,
  is one line naming what differs (:func:`check_checkpoint_fits`), not Lightning's ``state_dict`` traceback.
- **A GPU accelerator on a machine without one** (a GPU preset on a CPU): one line naming ``trainer.accelerator``
  and the file that set it (:func:`check_accelerator`), before any model is loaded.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any, Literal, Sequence

from hil.cli.parsers import config_files
from hil.errors import UserError
from hil.provenance import write_text_atomic

INTERRUPTED_RECORD = "interrupted.json"
CKPT_OPTION = "--ckpt_path"
ResumeChoice = Literal["auto", "never"]
RESUME_HELP = ("when trainer.default_root_dir holds an interrupted run (its interrupted.json) and no --ckpt_path is "
               "given: auto resumes it, never starts a new run beside it; unset, the command stops and says which")


def program() -> str:
    """How the running command was called: ``hil`` (also ``python -m hil``, and in-process callers),
    ``hil-train``, or ``python train.py``."""
    called = sys.argv[0] if sys.argv and sys.argv[0] else ""
    name = Path(called).name
    if name == "hil-train":
        return name
    if name.endswith(".py") and name != "__main__.py":
        return f"python {called}"
    return "hil"


def resume_command(argv: Sequence[str], checkpoint: str | os.PathLike) -> str:
    """The command line that resumes the run ``argv`` started (``fit ...``, as given): ``argv`` with its own
    ``--ckpt_path`` and ``--resume`` taken out and ``--ckpt_path <checkpoint>`` added."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in (CKPT_OPTION, "--resume"):
            skip = True
        elif not arg.startswith((f"{CKPT_OPTION}=", "--resume=")):
            kept.append(arg)
    return " ".join([program(), shlex.join([*kept, CKPT_OPTION, str(checkpoint)])])


def record_interrupt(root: str | os.PathLike, checkpoint: str | os.PathLike, step: int, command: str) -> Path:
    """Write ``<root>/interrupted.json``: the checkpoint to resume from, its step and the command that resumes."""
    path = Path(root) / INTERRUPTED_RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({"checkpoint": str(checkpoint), "global_step": int(step),
                                        "command": command}, indent=2) + "\n")
    return path


def interrupted_run(root: str | os.PathLike) -> dict[str, Any] | None:
    """The interrupted run ``<root>/interrupted.json`` records, when its checkpoint is still there; else None (a
    record whose checkpoint was removed has nothing to resume from)."""
    try:
        record = json.loads((Path(root) / INTERRUPTED_RECORD).read_text(encoding="utf-8"))
        return record if Path(record["checkpoint"]).is_file() else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def clear_interrupt(root: str | os.PathLike) -> None:
    """Forget the interrupted run of ``root`` (a run there completed)."""
    (Path(root) / INTERRUPTED_RECORD).unlink(missing_ok=True)


def resume_decision(root: str | os.PathLike, ckpt_path: str | None, resume: ResumeChoice | None) -> str | None:
    """The ``ckpt_path`` a ``fit`` starts from: the one given; else, when ``root`` holds an interrupted run, its
    checkpoint (``--resume auto``), none (``never``), or a :class:`UserError` saying both (unset)."""
    if ckpt_path is not None or resume == "never":
        return ckpt_path
    record = interrupted_run(root)
    if record is None:
        return None
    checkpoint, step = record["checkpoint"], record.get("global_step", "?")
    if resume == "auto":
        print(f"resuming the run interrupted at step {step}: {CKPT_OPTION} {checkpoint} (--resume auto)",
              file=sys.stderr)
        return checkpoint
    raise UserError(f"{Path(root) / INTERRUPTED_RECORD}: a run of this folder was interrupted at step {step}; "
                    f"resume it with {CKPT_OPTION} {checkpoint} (or --resume auto), or start a new run beside it "
                    f"with --resume never")


def check_checkpoint_fits(path: str | os.PathLike, module: Any, option: str = CKPT_OPTION) -> None:
    """Refuse, in one line, a checkpoint whose weights are not the ones ``module`` (the config's model) holds:
    names missing from it, names it has that the model lacks, shapes that differ (the first few of each), and the
    architecture it records beside the config's. Lightning loads strictly and would fail with the whole list."""
    if not getattr(module, "strict_loading", True):
        return
    import torch

    checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    saved = checkpoint.get("state_dict", {})
    expected = module.state_dict()
    missing = [key for key in expected if key not in saved]
    unexpected = [key for key in saved if key not in expected]
    shapes = [f"{key} {tuple(saved[key].shape)} here {tuple(value.shape)}" for key, value in expected.items()
              if key in saved and hasattr(saved[key], "shape") and tuple(saved[key].shape) != tuple(value.shape)]
    if not (missing or unexpected or shapes):
        return
    recorded = (checkpoint.get("hil") or {}).get("settings", {}).get("architecture")
    built = getattr(getattr(module, "encoder", None), "architecture", None)
    models = f" (it holds a {recorded} model, this config builds a {built} one)" if recorded and built and \
        recorded != built else ""
    parts = [f"{what}: {few(keys)}" for what, keys in (("missing", missing), ("unexpected", unexpected),
                                                       ("other shapes", shapes)) if keys]
    raise UserError(f"{option} {path}: the checkpoint's weights do not fit the model this config builds{models} "
                    f"({'; '.join(parts)}); was it trained with another config? Resume it with the config it was "
                    f"trained with")


def few(names: Sequence[str], shown: int = 3) -> str:
    """``a, b, c and 4 more``."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


# What each GPU accelerator name of Lightning needs: CUDA (``gpu`` takes Apple's MPS too).
GPU_ACCELERATORS = ("gpu", "cuda", "mps")


def check_accelerator(accelerator: Any, argv: Sequence[str]) -> None:
    """Refuse ``trainer.accelerator: gpu`` (``cuda``, ``mps``) where torch sees no such device, naming the setting
    and the ``--config`` file and line that set it (Lightning's own words name neither: "No supported gpu backend
    found!")."""
    if not isinstance(accelerator, str) or accelerator.lower() not in GPU_ACCELERATORS:
        return
    import torch

    mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    name = accelerator.lower()
    if (name in ("gpu", "cuda") and torch.cuda.is_available()) or (name in ("gpu", "mps") and mps):
        return
    where = "" if any(arg.startswith("--trainer.accelerator") for arg in argv) else setting_line(argv, "accelerator")
    raise UserError(f"{where}trainer.accelerator: {accelerator}, but torch sees no GPU here; on a CPU use "
                    f"presets/cpu instead of a GPU preset, or add --trainer.accelerator cpu")


def setting_line(argv: Sequence[str], key: str) -> str:
    """``<file>:<line>: `` of the last ``--config`` file of ``argv`` that sets ``key``; "" when none does."""
    for file in reversed(config_files(argv)):
        try:
            lines = Path(file).read_text(encoding="utf-8").splitlines()
        except OSError:
            continue
        for number, line in enumerate(lines, 1):
            if re.match(rf"\s*{re.escape(key)}\s*:", line):
                return f"{file}:{number}: "
    return ""
