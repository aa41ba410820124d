"""Encoding a corpus into resumable chunks (:mod:`hil.retrieval.chunks`), in this process or in several at once.

``build_index(..., processes=N)`` encodes on ``N`` processes started by Lightning Fabric (strategy ``ddp_spawn``,
one per device: ``cuda:0 .. cuda:N-1``, or ``N`` CPU processes whose process group is gloo), each writing its
share of the chunks into the same folder; the main process then joins the chunks exactly as after a one-process
encoding, so the index is the same (byte for byte on a CPU). Choices:

- **Which rank encodes what.** Chunk ``n`` is encoded by rank ``n % N`` (round robin: a corpus sorted by length,
  or by source, still gives every rank a mix). Chunk boundaries depend on ``chunk_docs`` only, so each chunk's
  documents, batches and files are those of a one-process build, and a rerun on any ``N`` reuses finished chunks.
- **What each rank reads.** Only its own chunks' texts: the main process writes the corpus's texts once into the
  chunks folder (UTF-8 bytes and byte offsets, :mod:`hil.retrieval.corpus_texts`) and sends the ranks the file's
  path, not the texts; a rank reads a chunk's texts from disk when it tokenizes that chunk. (Fabric's launcher
  sends every rank the same arguments, and the corpus arrives as an in-memory list, so this spill is what lets a
  rank hold one chunk's texts instead of the corpus's: ~3.8 GB per rank for MS MARCO before.) The files are
  removed when the ranks are done.
- **Tokenization.** Once per document, in ``tokenizer_workers`` DataLoader processes per rank that tokenize the
  next chunks while the encoder runs (:mod:`hil.retrieval.token_loader`; 0 tokenizes in the rank itself); the
  batches are the same either way.
- **How the encoder crosses the spawn.** As a CPU copy (a CUDA encoder is copied to the CPU first: CUDA tensors are
  not sent between processes), pickled with the job; each rank moves it to its own device. A ``quantize`` view
  (int8, ONNX, ``torch.compile``) cannot be pickled (ONNX Runtime sessions, compiled graphs), so each rank builds
  it from its copy and the same calibration documents: the recipe is deterministic, and every rank reports the
  view's description, which the chunks' identity then holds (the main process checks every chunk against it).
- **Threads.** On a CPU each rank gets ``max(1, cpu_count // N)`` torch threads, so ``N`` ranks do not fight over
  the cores.
- **Failures.** A rank that raises or dies (killed, out of memory) makes Fabric's launcher (torch.multiprocessing)
  stop the others and raise in the main process; the build then removes the files of chunks left half written
  (their arrays without metadata, temporary files) and raises one ``RuntimeError`` naming the rank's fate. What
  stays under ``<dir>.tmp-build/chunks`` are finished chunks, each complete, which a rerun reuses; ``<dir>`` itself
  is never created by a failed build.
"""

from __future__ import annotations

import copy
import os
import signal
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from hil.modeling.contracts import Encoder
from hil.retrieval.chunk_codec import ChunkCodec
from hil.retrieval.chunks import discard_unfinished_chunks, encode_in_chunks, shard_docs
from hil.retrieval.corpus_texts import write_corpus_texts
from hil.retrieval.devices import autocast
from hil.retrieval.encoding import eval_mode
from hil.retrieval.fast_encode import document_encoder

# Test-only: the rank named by this variable kills itself (SIGKILL) after writing its first chunk, so that tests
# can prove what a dead rank leaves behind. Read in the spawned ranks only.
KILL_RANK_AFTER_FIRST_CHUNK_ENV = "HIL_TEST_KILL_RANK_AFTER_FIRST_CHUNK"
MULTIPROCESS_ACCELERATORS = ("cpu", "cuda")


@dataclass  # not frozen: Fabric's launcher rebuilds it in each rank (to unshare the encoder's CPU tensors)
class CorpusEncoding:
    """Everything encoding a corpus's chunks needs; picklable, as it is sent to every rank.

    ``identity`` is what every chunk records and must match to be reused (settings, fingerprints, precision);
    the document encoding of the ``quantize`` view is added to it where the view is built. ``texts``: the caller's
    list, or (in the job sent to the ranks) a :class:`~hil.retrieval.corpus_texts.CorpusTextsFile`.
    ``tokenizer_workers``: loader processes tokenizing chunks ahead of the encoder, per rank (0: none).
    ``compression``: store each chunk as codes and residuals (:mod:`hil.retrieval.chunk_codec`), computed on the
    rank's device.
    """

    encoder: Encoder
    texts: Sequence[str]
    chunks: Path
    identity: dict[str, Any]
    chunk_docs: int
    batch_size: int
    quantize: str | None = None
    calibration_texts: Sequence[str] = ()
    precision: str = "fp32"
    progress: bool = True
    description: str = "encoding"
    tokenizer_workers: int = 0
    compression: ChunkCodec | None = None


def encode_shard(job: CorpusEncoding, device: torch.device, rank: int = 0, world: int = 1,
                 on_written: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Encode the chunks of ``rank`` (of ``world``) with ``job.encoder`` (already on ``device``) under autocast to
    ``job.precision``; -> the identity the chunks were written with (``job.identity`` + ``document_encoding``)."""
    from hil.retrieval.progress import progress_bar

    view = document_encoder(job.encoder, job.quantize, calibration_texts=job.calibration_texts)
    identity = dict(job.identity, document_encoding=view.document_encoding or None)
    total = shard_docs(len(job.texts), job.chunk_docs, rank, world)
    description = job.description if world == 1 else f"{job.description} (rank 0 of {world})"
    bar = progress_bar(total, description, "doc", enabled=job.progress and rank == 0)
    with eval_mode(view), autocast(device, job.precision):
        encode_in_chunks(view, job.texts, job.chunks, identity, chunk_docs=job.chunk_docs,
                         batch_size=job.batch_size, progress_bar=bar, rank=rank, world=world,
                         workers=job.tokenizer_workers, on_written=on_written,
                         compression=job.compression.on(device) if job.compression is not None else None)
    bar.close()
    return identity


def check_processes(processes: int, device: torch.device) -> None:
    """Refuse a number of encoding processes this machine cannot run on ``device``'s kind (one line)."""
    if processes < 1:
        raise ValueError(f"processes must be >= 1 (got {processes})")
    if processes == 1:
        return
    if device.type not in MULTIPROCESS_ACCELERATORS:
        raise ValueError(f"processes={processes}: multi-process encoding runs on "
                         f"{' or '.join(MULTIPROCESS_ACCELERATORS)} encoders, not on one on {device}")
    gpus = torch.cuda.device_count()
    if device.type == "cuda" and processes > gpus:
        raise ValueError(f"processes={processes}: one process per GPU, and this machine has {gpus}"
                         + (f" (cuda:0..cuda:{gpus - 1})" if gpus else ""))


def check_tokenizer_workers(tokenizer_workers: int) -> None:
    """Refuse a number of tokenizer worker processes that cannot be (one line)."""
    if isinstance(tokenizer_workers, bool) or not isinstance(tokenizer_workers, int) or tokenizer_workers < 0:
        raise ValueError(f"tokenizer_workers must be an integer >= 0 (got {tokenizer_workers!r})")


def encode_corpus(job: CorpusEncoding, processes: int = 1) -> dict[str, Any]:
    """Encode every chunk of ``job`` on ``processes`` processes of the encoder's device kind (see the module
    docstring); -> the chunks' identity. Raises ``RuntimeError`` when a rank fails, finished chunks kept."""
    device = torch.device(job.encoder.device)
    check_processes(processes, device)
    if processes == 1:
        return encode_shard(job, device)
    from lightning_fabric import Fabric

    fabric = Fabric(accelerator=device.type, devices=processes, strategy="ddp_spawn")
    port_before = os.environ.get("MASTER_PORT")
    # The ranks read their chunks' texts from disk (module docstring): the job they receive holds a path, not texts.
    texts_file = write_corpus_texts(job.texts, job.chunks)
    cpu_job = replace(job, encoder=_cpu_copy(job.encoder), texts=texts_file)
    try:
        return fabric.launch(_encode_on_rank, cpu_job)
    except Exception as error:  # torch.multiprocessing's ProcessExitedException / ProcessRaisedException
        removed = discard_unfinished_chunks(job.chunks)
        raise RuntimeError(f"{job.description} on {processes} {device.type} processes failed: "
                           f"{_summary(error)}. Finished chunks are kept in {job.chunks} and reused by a rerun "
                           f"({len(removed)} files of unfinished chunks removed)") from error
    finally:
        texts_file.remove()
        # The launcher pins MASTER_PORT in this process's environment; a later launch must pick a free port again.
        _restore_env("MASTER_PORT", port_before)


def _encode_on_rank(fabric: Any, job: CorpusEncoding) -> dict[str, Any]:
    """One rank: its own threads and device, then its share of the chunks; -> the identity it wrote."""
    rank, world = fabric.global_rank, fabric.world_size
    if fabric.device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    encoder = job.encoder.to(fabric.device)
    return encode_shard(replace(job, encoder=encoder), fabric.device, rank, world, _test_kill_hook(rank))


def _test_kill_hook(rank: int) -> Callable[[int], None] | None:
    """Test-only (see :data:`KILL_RANK_AFTER_FIRST_CHUNK_ENV`): die hard after the first chunk this rank writes."""
    if os.environ.get(KILL_RANK_AFTER_FIRST_CHUNK_ENV) != str(rank):
        return None
    return lambda number: os.kill(os.getpid(), signal.SIGKILL)


def _cpu_copy(encoder: Encoder) -> Encoder:
    """``encoder`` itself when it lives on the CPU, else a CPU copy (the caller's encoder stays where it is)."""
    if torch.device(encoder.device).type == "cpu":
        return encoder
    return copy.deepcopy(encoder).cpu()


def _summary(error: BaseException) -> str:
    """One line for a rank's failure: torch.multiprocessing's first line (which process, how it ended) and, for a
    Python error, the last line of the rank's traceback (the error itself)."""
    lines = [line.strip(" -") for line in str(error).strip().splitlines() if line.strip(" -")]
    if not lines:
        return type(error).__name__
    return (lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}").rstrip(".")


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
