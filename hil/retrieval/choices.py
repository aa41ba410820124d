"""The named choices of the retrieval layer, without the machinery behind them (torch, ONNX Runtime, FAISS): what a
command line offers, and its ``--help`` or a settings parser, need no more than this.

- :data:`PRECISIONS`: the corpus encoding's autocast (:func:`hil.retrieval.devices.autocast`); queries stay fp32.
- :data:`DOCUMENT_ENCODINGS`: cheaper document encoders than the model itself (:mod:`hil.retrieval.fast_encode`).
- :data:`QUERY_ENCODINGS`: query encoders for search latency (:mod:`hil.retrieval.onnx_encode`).
- :data:`VERIFY_MODES`: how much of a reused index is checked (:mod:`hil.retrieval.integrity`).
"""

from hil.errors import UserError

PRECISIONS = ("fp32", "fp16", "bf16")
DOCUMENT_ENCODINGS = ("compile", "int8", "onnx", "onnx-int8")
QUERY_ENCODINGS = ("onnx",)
VERIFY_MODES = ("auto", "sizes", "full")


def check_verify(verify: str) -> str:
    """``verify`` when it is one of :data:`VERIFY_MODES`, else a :class:`UserError` naming them."""
    if verify not in VERIFY_MODES:
        raise UserError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
    return verify
