"""GradCache (Gao, Zhang, Han & Callan 2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited
Setup"): a large batch's objective with the gradient of the whole batch, in the memory of a small chunk.

The objective couples every query with every document of the batch (n-way softmax, in-batch negatives, batch
z-score moments, isotropy over the batch), so it cannot simply be accumulated over chunks. GradCache splits the
computation at the token embeddings instead:

    1. encode the batch chunk by chunk without a graph, keeping each chunk's random state (dropout);  (B, L, D)
    2. compute the objective on those embeddings as leaf tensors, and (on backward) its gradient with respect to
       them;
    3. on backward, encode each chunk again with the same random state, now with a graph, and backpropagate
       ``sum(embedding * cached gradient)`` -- the chain rule, one chunk's activations alive at a time.

The backward of steps 2 and 3 runs from a hook on the returned loss (as PyLate's ``CachedContrastive`` and
sentence-transformers' ``CachedMultipleNegativesRankingLoss`` do), so Lightning's ``loss.backward()``, loss scaling
and gradient accumulation drive it unchanged: the gradient reaching the loss enters the objective's backward, as it
enters the whole batch's (under fp16 loss scaling, scaled before any half-precision product's backward, as there).
The objective's graph over the embeddings is kept from the forward to the backward, as the whole batch's is.
The replayed forward runs
under the autocast of step 1, its backward outside autocast (as Lightning's). The parameter gradients equal those of
the whole batch at once up to floating-point reordering (``tests/test_gradcache.py``; under bf16 autocast, up to the
rounding that any other chunking of the batch shows too); the price is a second forward pass
(``bench/training_throughput.py``).

Limits: one process (under DDP each chunk's backward would be a separate gradient reduction; refused), and every
gradient of the objective must flow through the token embeddings (true of every term in ``hil.modeling``).
Tokenization is done once for the whole batch, so chunks share its padding.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import Tensor
from torch.utils.checkpoint import get_device_states, set_device_states

from hil.data.tokenization import TokenizedBatch
from hil.errors import UserError
from hil.modeling.contracts import EncodedBatch, Encoder
from hil.modeling.distributed import is_distributed

Objective = Callable[[EncodedBatch, EncodedBatch], tuple[Tensor, dict[str, Tensor]]]


@dataclass
class RandomState:
    """Torch's CPU and device random states at one moment, to replay a forward pass with the same dropout."""

    cpu: Tensor
    devices: list[int]
    device_states: list[Tensor]

    @classmethod
    def capture(cls, *tensors: Tensor) -> "RandomState":
        devices, states = get_device_states(*tensors)
        return cls(torch.get_rng_state(), devices, states)

    @contextmanager
    def restored(self) -> Iterator[None]:
        with torch.random.fork_rng(devices=self.devices):
            torch.set_rng_state(self.cpu)
            set_device_states(self.devices, self.device_states)
            yield


@dataclass
class Autocast:
    """Whether autocast was on (and in which dtype) where the embeddings were first computed."""

    device_type: str
    enabled: bool
    dtype: torch.dtype

    @classmethod
    def capture(cls, device: torch.device) -> "Autocast":
        kind = device.type
        return cls(kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))

    def context(self):
        return torch.autocast(self.device_type, dtype=self.dtype) if self.enabled else nullcontext()

    def suspended(self):
        """Autocast off, as around Lightning's ``loss.backward()``: the autograd engine runs a backward under the
        autocast state of its caller, which would recast fp32 ops' backward matmuls (CPU's math attention) to bf16."""
        return torch.autocast(self.device_type, enabled=False) if self.enabled else nullcontext()


def select_rows(batch: TokenizedBatch, rows: slice) -> TokenizedBatch:
    """Rows of a batch. Its ``has_padding`` is the whole batch's, an upper bound that the host knows (asking the
    rows themselves would read the device): a chunk without padding then gets an all-True mask, which attends alike."""
    return TokenizedBatch(batch.input_ids[rows], batch.attention_mask[rows], batch.scoring_mask[rows],
                          has_padding=batch.has_padding)


def concat(parts: list[EncodedBatch]) -> EncodedBatch:
    return EncodedBatch({name: torch.cat([p.heads[name] for p in parts]) for name in parts[0].heads},
                        torch.cat([p.mask for p in parts]), torch.cat([p.input_ids for p in parts]))


@dataclass
class _Side:
    """One side of the batch (queries or documents): its tokens, chunks, their random states, cached gradients."""

    tokens: TokenizedBatch
    is_query: bool
    chunks: list[slice]
    states: list[RandomState]
    gradients: dict[str, Tensor] | None = None


def _first_pass(encoder: Encoder, tokens: TokenizedBatch, is_query: bool, chunk_size: int
                ) -> tuple[EncodedBatch, _Side]:
    """Step 1: the embeddings of every chunk, without a graph, and each chunk's random state before it ran."""
    side = _Side(tokens, is_query, [], [])
    parts = []
    probe = next(encoder.parameters()) if isinstance(encoder, torch.nn.Module) else tokens.input_ids
    for start in range(0, len(tokens), chunk_size):
        rows = slice(start, min(start + chunk_size, len(tokens)))
        side.chunks.append(rows)
        side.states.append(RandomState.capture(probe))
        with torch.no_grad():
            parts.append(encoder.encode(select_rows(tokens, rows), is_query))
    return concat(parts), side


def _leaves(batch: EncodedBatch) -> EncodedBatch:
    return EncodedBatch({name: value.detach().requires_grad_() for name, value in batch.heads.items()},
                        batch.mask, batch.input_ids)


def cached_objective(encoder: Encoder, queries: TokenizedBatch, docs: TokenizedBatch, chunk_size: int,
                     objective: Objective) -> tuple[Tensor, dict[str, Tensor]]:
    """The objective of the whole batch, computed with GradCache in chunks of ``chunk_size`` texts (queries and
    documents chunked alike). Returns ``(loss, parts)``: ``loss`` is a detached copy of the value whose backward
    puts into every parameter's ``.grad`` the gradient of the whole-batch objective (see the module docstring).
    ``objective(queries, documents)`` gets EncodedBatches of the whole batch; its side effects (HIL's running
    z-score estimates, I-STAR's running covariance) happen once, as in an ordinary step."""
    if chunk_size < 1:
        raise UserError(f"model.gradcache_chunk_size must be >= 1 (got {chunk_size})")
    if is_distributed():
        raise UserError("model.gradcache_chunk_size: GradCache runs on one process only (under DDP each chunk's "
                        "backward would be reduced on its own); leave it null with strategy ddp")
    autocast = Autocast.capture(encoder.device)
    encoded_queries, query_side = _first_pass(encoder, queries, True, chunk_size)
    encoded_docs, doc_side = _first_pass(encoder, docs, False, chunk_size)
    query_leaves, doc_leaves = _leaves(encoded_queries), _leaves(encoded_docs)
    with torch.enable_grad():
        loss, parts = objective(query_leaves, doc_leaves)                                   # step 2
    leaves = [*query_leaves.heads.values(), *doc_leaves.heads.values()]
    n_query_heads = len(query_leaves.heads)

    def replay(grad_output: Tensor) -> None:
        # Step 2's gradient, taken at backward time: the gradient reaching the loss (GradScaler's scale under fp16,
        # 1/n under accumulation) enters the objective's backward as it enters the whole batch's, so no gradient
        # of the objective's half-precision products underflows before it is scaled. Outside autocast, as the
        # whole batch's backward.
        with autocast.suspended():
            gradients = torch.autograd.grad(loss, leaves, grad_outputs=grad_output.to(loss.dtype), allow_unused=True)
        gradients = [torch.zeros_like(leaf) if grad is None else grad for leaf, grad in zip(leaves, gradients)]
        query_side.gradients = dict(zip(query_leaves.heads, gradients[:n_query_heads]))
        doc_side.gradients = dict(zip(doc_leaves.heads, gradients[n_query_heads:]))
        with torch.enable_grad(), autocast.context():                                       # step 3
            for side in (query_side, doc_side):
                for rows, state in zip(side.chunks, side.states):
                    with state.restored():
                        encoded = encoder.encode(select_rows(side.tokens, rows), side.is_query)
                    surrogate = sum((encoded.heads[name] * gradient[rows].to(encoded.heads[name].dtype)).sum()
                                    for name, gradient in side.gradients.items())
                    with autocast.suspended():  # the forward under autocast, its backward outside, as the batch's
                        surrogate.backward()
        query_side.gradients = doc_side.gradients = None

    value = loss.detach().requires_grad_()
    value.register_hook(replay)
    return value, parts
