"""Search back-ends of a token index: flat FAISS, IVF FAISS, PLAID centroid pruning and MUVERA's fixed dimensional
encodings behind one interface.

``base`` defines the interface (:class:`~hil.retrieval.backends.base.SearchBackend`), ``token_ann``, ``centroid`` and
``muvera`` implement it, and ``registry`` maps an index's ``kind`` to its back-end.
"""

