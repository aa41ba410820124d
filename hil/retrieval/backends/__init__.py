"""Search back-ends of a token index: flat FAISS, IVF FAISS, PLAID centroid pruning and MUVERA's fixed dimensional
encodings behind one interface.

``base`` defines the interface (:class:`~hil.retrieval.backends.base.SearchBackend`), ``token_ann``, ``centroid`` and
``muvera`` implement it, and ``registry`` maps an index's ``kind`` to its back-end.
"""

# The built-in back-ends register themselves when their classes are defined: importing them here makes every kind
# known wherever the package is used (a back-end of another package registers when its module is imported, e.g. by
# the ``class_path`` of its settings in a YAML file).
from hil.retrieval.backends import token_ann  # noqa: E402,F401,I001  (first: flat, ivfflat, ivfpq lead the kinds)
from hil.retrieval.backends import centroid, muvera  # noqa: E402,F401
