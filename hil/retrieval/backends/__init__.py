"""Search back-ends of a token index: flat FAISS, IVF FAISS and PLAID centroid pruning behind one interface.

``base`` defines the interface (:class:`~hil.retrieval.backends.base.SearchBackend`), ``token_ann`` and ``centroid``
implement it, and ``registry`` maps an index's ``kind`` to its back-end.
"""
