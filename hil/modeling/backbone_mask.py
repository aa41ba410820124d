"""The attention mask an encoder hands its Hugging Face backbone, built without asking the device anything.

transformers (>= 5) turns a 2D padding mask into the 4D mask of PyTorch's scaled-dot-product attention in
``masking_utils.create_bidirectional_mask``, and first asks whether any token is padding at all
(``_ignore_bidirectional_mask_sdpa``: ``padding_mask.all()``, read back to the host) so that a batch without padding
runs with no mask. On a GPU that read waits for every kernel queued before it: twice a training step (queries,
documents), and once per encoded batch when indexing. The tokenizer already knows the answer on the host
(``TokenizedBatch.has_padding``), so :func:`backbone_attention_mask` answers it itself: no mask for a batch without
padding, else the 4D mask that transformers' own ``sdpa_mask`` builds from the 2D one (called the same way
``create_bidirectional_mask`` calls it), which the backbone then takes as it is. The backbone computes exactly what
it computes from the 2D mask (``tests/test_host_syncs.py`` compares the hidden states).

Anything else keeps the 2D mask (and transformers' own check): a batch whose padding is not known, another
attention implementation, a decoder, a model type not read here (:data:`PLAIN_BIDIRECTIONAL_TYPES`: its modeling
code builds one plain bidirectional mask for every layer, no sliding window or other overlay), a backbone whose
module does not build its mask through ``create_bidirectional_mask`` (an older transformers, remote code, an ONNX
Runtime stand-in).
"""

from __future__ import annotations

import sys
from typing import Any

from torch import Tensor

from hil.data.tokenization import TokenizedBatch

# Model types whose transformers code (modeling_<type>.py) was read: one create_bidirectional_mask for all layers.
PLAIN_BIDIRECTIONAL_TYPES = ("bert",)

try:
    from transformers.masking_utils import bidirectional_mask_function, sdpa_mask
except ImportError:  # transformers < 5
    sdpa_mask = bidirectional_mask_function = None


def builds_bidirectional_sdpa_mask(backbone: Any) -> bool:
    """Whether ``backbone`` is an encoder under SDPA attention whose modeling module builds its mask with
    ``create_bidirectional_mask`` (so a 4D mask is taken as given)."""
    config = getattr(backbone, "config", None)
    if sdpa_mask is None or config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if getattr(config, "is_decoder", False) or getattr(config, "model_type", None) not in PLAIN_BIDIRECTIONAL_TYPES:
        return False
    module = sys.modules.get(type(backbone).__module__)
    return module is not None and "create_bidirectional_mask" in vars(module)


def backbone_attention_mask(backbone: Any, batch: TokenizedBatch) -> Tensor | None:
    """The ``attention_mask`` argument for ``backbone(input_ids=batch.input_ids, ...)`` (see the module docstring):
    None when nothing is padding, the 4D mask when something is, the 2D mask when either cannot be told."""
    if batch.has_padding is None or not builds_bidirectional_sdpa_mask(backbone):
        return batch.attention_mask
    if not batch.has_padding:
        return None
    mask = batch.attention_mask.bool()  # as transformers' _preprocess_mask_arguments turns it
    rows, length = mask.shape
    return sdpa_mask(batch_size=rows, q_length=length, kv_length=length, q_offset=0, kv_offset=0,
                     mask_function=bidirectional_mask_function, attention_mask=mask, allow_is_causal_skip=False,
                     allow_is_bidirectional_skip=False, use_vmap=False, device=mask.device)
