"""A token store read on one device: documents gathered as padded batches where they are scored, not on the host.

Exact scoring reads every candidate's stored vectors. :func:`hil.retrieval.store.gather_documents` reads them on
the host (a memmap) and copies each padded block to the device: on a GPU that is the whole cost of full ranking
(one query's 1,024 candidates are ~45 MB of fp16 rows gathered by the CPU and sent over PCIe, ~9 ms on an H200,
issue 29). :class:`DeviceTokens` keeps a store's tables on the device instead, uploaded once per opened index and
device, and gathers there: the rows are computed on the device from the document numbers, and nothing crosses to the
host but the block's width.

Where the tables live:
- on the CPU: the store's own arrays (views of the memmaps; nothing copied);
- on an accelerator: a copy in the stored dtype (fp16, or the residual codes of a compressed head, 34 bytes a token
  at 2 bits), when it takes at most :data:`DEVICE_SHARE` of the device's free memory; otherwise the rows are read on
  the host and copied, as ``gather_documents`` does (SciFact's 815,632 fp16 tokens are 209 MB: they fit any GPU;
  MS MARCO's 600M need residual compression or the host).

The gathered batch scores exactly like ``gather_documents``' (the same vectors widened to fp32; padding zeroed, or,
with ``repeat_padding``, a copy of one of the document's own tokens).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from hil.modeling.contracts import EncodedBatch
from hil.retrieval.codec import CompressedEmbeddings
from hil.retrieval.devices import canonical_device, upload_rows
from hil.retrieval.store import TokenStore

# The largest share of an accelerator's free memory a store's tables may take there.
DEVICE_SHARE = 0.5
def _fits(device: torch.device, n_bytes: int) -> bool:
    """Whether ``n_bytes`` more fit on ``device`` within :data:`DEVICE_SHARE` of its free memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return n_bytes <= DEVICE_SHARE * free
    return False  # another accelerator: read on the host (no portable free-memory query)


class DeviceTokens:
    """``store``'s token tables readable on ``device`` (see the module docstring); get it with
    :func:`device_tokens`, which caches one per store and device."""

    def __init__(self, store: TokenStore, device: torch.device):
        self.store = store
        self.device = device
        self.offsets = torch.from_numpy(store.doc_offsets).to(device)  # (n_docs + 1,) int64
        self.lengths = self.offsets[1:] - self.offsets[:-1]             # (n_docs,)
        self._tables: dict[str, tuple[str, object]] = {}

    def table(self, name: str) -> tuple[str, object]:
        """(where, what) for a head or ``"token_ids"``: ``device`` (a tensor there), ``host`` (a CPU tensor whose
        rows are copied over), ``compressed`` ((codes int32, packed, codec) on the device) or ``compressed-host``
        (the :class:`CompressedEmbeddings`, decompressed on the device from rows read on the host)."""
        if name not in self._tables:  # uploaded on first use
            store, device = self.store, self.device
            array = store.stored_token_ids() if name == "token_ids" else store.embeddings[name]
            if isinstance(array, CompressedEmbeddings):
                if device.type != "cpu" and _fits(device, 4 * len(array.codes) + array.packed.nbytes):
                    self._tables[name] = ("compressed", (upload_rows(array.codes, np.int32, device),
                                                         upload_rows(array.packed, None, device), array.codec))
                else:
                    self._tables[name] = ("compressed-host", array)
            elif device.type != "cpu" and _fits(device, array.nbytes):
                self._tables[name] = ("device", upload_rows(array, None, device))
            else:
                self._tables[name] = ("host", store.torch_view(name))
        return self._tables[name]

    def rows(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Rows of a head (on the device; float32 decompressed for a compressed head, else the stored dtype) or of
        ``token_ids``."""
        where, table = self.table(name)
        if where == "compressed":
            codes, packed, codec = table  # type: ignore[misc]
            return codec.decompress_torch(codes.index_select(0, rows), packed.index_select(0, rows))
        if where == "compressed-host":
            return table.rows_torch(rows, device=self.device)  # type: ignore[union-attr]
        return table.index_select(0, rows.to(table.device)).to(self.device)  # type: ignore[union-attr]

    def gather(self, docs: torch.Tensor, heads: Sequence[str], *, repeat_padding: bool = False,
               token_ids: bool | None = None, lengths: tuple[int, int] | None = None) -> EncodedBatch:
        """Documents ``docs`` (N,) int64 as a padded batch on the device: heads (N, Lmax, D) float32, mask, ids.

        Padding repeats each document's last row; it is zeroed unless ``repeat_padding`` (then a MaxSim needs no
        mask, :attr:`~hil.modeling.contracts.EncodedBatch.padding_repeats_tokens`, when every document has a token).
        ``token_ids=False`` reads no token ids (zeros); None (default) reads them where the store keeps them.
        ``lengths``: the documents' shortest and longest stored length when the caller knows them; else they are
        read (one pair of scalars crosses to the host).
        """
        docs = docs.to(self.device)
        token_ids = self.store.token_ids is not None if token_ids is None else token_ids
        doc_lengths = self.lengths[docs]
        if lengths is not None:
            shortest, longest = lengths
        elif len(docs):
            shortest, longest = (int(v) for v in torch.stack([doc_lengths.min(), doc_lengths.max()]).tolist())
        else:
            shortest, longest = 0, 0
        lengths = doc_lengths
        width = max(longest, 1)
        positions = torch.arange(width, device=self.device)
        mask = positions[None, :] < lengths[:, None]  # (N, Lmax)
        n_tokens = self.store.n_tokens
        repeats = repeat_padding and n_tokens > 0 and shortest > 0
        if n_tokens == 0:  # nothing to read: every document is empty
            zeros = {h: torch.zeros((len(docs), width, self.store.dims[h]), device=self.device) for h in heads}
            return EncodedBatch(zeros, mask, torch.zeros((len(docs), width), dtype=torch.long, device=self.device))
        rows = (self.offsets[docs][:, None] + torch.minimum(positions[None, :], (lengths - 1).clamp(min=0)[:, None])
                ).clamp(max=n_tokens - 1).reshape(-1)
        padding = ~mask[..., None]
        encoded = {}
        for head in heads:
            vectors = self.rows(head, rows).float().view(len(docs), width, -1)
            encoded[head] = vectors if repeats else vectors.masked_fill_(padding, 0.0)
        if token_ids:
            ids = self.rows("token_ids", rows).long().view(len(docs), width).masked_fill_(~mask, 0)
        else:
            ids = torch.zeros((), dtype=torch.long, device=self.device).expand(len(docs), width)
        return EncodedBatch(encoded, mask, ids, repeats)


def device_tokens(store: TokenStore, device: torch.device | str) -> DeviceTokens:
    """The :class:`DeviceTokens` of ``store`` on ``device``, made on first use and kept with the store (an opened
    index): its tables are uploaded once per device."""
    device = canonical_device(device)
    cache: dict[torch.device, DeviceTokens] = store.__dict__.setdefault("_device_tokens", {})
    if device not in cache:
        cache[device] = DeviceTokens(store, device)
    return cache[device]
