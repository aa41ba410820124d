"""ColBERT (v1) training as a LightningModule, with the isotropy regularizers as settings.

One training step, end to end:
    queries, positives, negatives (strings)
    -> ColBERTTokenizer -> ColBERTEncoder -> Q (B, Lq, D), D+ (B, Ld, D), D- (B, Ld, D)
    -> late interaction (Eq. 1) -> L_late = CE(score(q, d+), score(q, d-))
       [or in-batch CE over all 2B docs; under DDP over the docs of every rank, see in_batch_loss]
    -> + regularizer (InterIso / CosReg / I-STAR, sign of lambda = iso or aniso)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from hil.isotropy.regularizers import Regularizer
from hil.modeling.distributed import gather_encoded
from hil.modeling.contracts import EncodedBatch
from hil.modeling.encoder import ColBERTEncoder
from hil.modeling.module import RetrieverModule
from hil.modeling.scoring import pairwise_ce_loss


class ColBERTModule(RetrieverModule):
    """ColBERT and its regularized variants (ColBERT-iso/aniso, -cosreg, -istar) are configurations of this class.

    Args:
        backbone: Hugging Face name or local directory of a BERT-family model.
        dim: projection size (128 in ColBERT).
        query_maxlen, doc_maxlen: 32 and 180 in the paper.
        in_batch_negatives: score each query against all 2B documents of the batch instead of its own pair.
        regularizer: ``none`` | ``interiso`` | ``cosreg`` | ``istar``; reg_weight is the paper's lambda (> 0 iso,
            < 0 aniso). reg_zeta, reg_shrinkage_target, reg_momentum: I-STAR's shrinkage (see ``Regularizer``).
    """

    def __init__(self, backbone: str = "bert-base-uncased", dim: int = 128, query_maxlen: int = 32,
                 doc_maxlen: int = 180, query_marker: str = "[unused0]", doc_marker: str = "[unused1]",
                 mask_punctuation: bool = True, in_batch_negatives: bool = False, regularizer: str = "none",
                 reg_weight: float = 0.0, reg_zeta: float = 0.2, reg_shrinkage_target: str = "identity",
                 reg_momentum: float = 0.1, lr: float = 3e-6, weight_decay: float = 0.0, adam_eps: float = 1e-8,
                 warmup_steps: int = 0, init_from: str | None = None, on_nonfinite_loss: str = "raise"):
        super().__init__(lr=lr, weight_decay=weight_decay, adam_eps=adam_eps, warmup_steps=warmup_steps,
                         init_from=init_from, on_nonfinite_loss=on_nonfinite_loss)
        self.save_hyperparameters()
        self.encoder = ColBERTEncoder(backbone, dim=dim, query_maxlen=query_maxlen, doc_maxlen=doc_maxlen,
                                      query_marker=query_marker, doc_marker=doc_marker,
                                      mask_punctuation=mask_punctuation)
        self.regularizer = Regularizer(regularizer, reg_weight, zeta=reg_zeta, shrinkage_target=reg_shrinkage_target,
                                       momentum=reg_momentum, dim=dim)
        self.load_initial_weights()

    def compute_loss(self, batch: dict[str, list[str]]) -> tuple[Tensor, dict[str, Tensor]]:
        n = len(batch["queries"])
        queries = self.encoder.encode_queries(batch["queries"])
        docs = self.encoder.encode_documents(batch["positives"] + batch["negatives"])  # positives then negatives
        q, d = queries.heads["colbert"], docs.heads["colbert"]  # (B, Lq, D), (2B, Ld, D)
        positive = self.encoder.score_pairs(queries, docs.select(slice(0, n)))
        negative = self.encoder.score_pairs(queries, docs.select(slice(n, 2 * n)))
        in_batch_candidates = None
        if self.hparams.in_batch_negatives:
            late, in_batch_candidates = self.in_batch_loss(queries, docs)
        else:
            late = pairwise_ce_loss(positive, negative)
        # Queries once, documents as [positives; negatives]: pair_index says which query each document goes with.
        pair_index = torch.arange(n, device=q.device).repeat(2)
        reg, reg_logs = self.regularizer(q, d, queries.mask, docs.mask, pair_index=pair_index)
        parts = {"loss_late": late.detach(), "loss_reg": reg.detach(),
                 "pair_accuracy": (positive > negative).float().mean().detach(),
                 "score_margin": (positive - negative).mean().detach()}
        parts.update({k: v.detach() for k, v in reg_logs.items()})
        if in_batch_candidates is not None:
            parts["in_batch_candidates"] = torch.tensor(float(in_batch_candidates))
        return late + reg, parts

    def in_batch_loss(self, queries: EncodedBatch, docs: EncodedBatch) -> tuple[Tensor, int]:
        """In-batch CE: query i against every document of the batch -- of *every rank* under DDP. -> (loss, #docs)

        ``docs`` is this rank's [positives; negatives]. Under DDP the documents of all ranks are gathered (padded,
        never truncated; ``hil.modeling.distributed.gather_padded``) and this rank's positive of query i sits at row
        ``offset + i`` of the gathered batch. Each rank's loss is the mean over its own queries; DDP averages the
        gradients, so with equal per-rank batches a step equals one on the concatenated global batch.
        """
        everyone, offset = gather_encoded(docs)
        scores = self.encoder.score(queries, everyone)  # (B, N) with N = 2B summed over ranks
        # hil.modeling.scoring.in_batch_ce_loss with the targets shifted to where this rank's positives landed.
        targets = offset + torch.arange(len(queries), device=scores.device)  # (B,)
        return F.cross_entropy(scores, targets), len(everyone)
