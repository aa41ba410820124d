"""Search back-ends of a token index: flat FAISS, IVF FAISS, PLAID centroid pruning and MUVERA's fixed dimensional
encodings behind one interface.

``base`` defines the interface (:class:`~hil.retrieval.backends.base.SearchBackend`); ``token_ann``, ``centroid``
and ``muvera`` implement it, each with its typed settings beside it (``token_ann_configs``, ``centroid_configs``,
``muvera_configs``: torch-free, on :mod:`~hil.retrieval.backends.config_base`'s base classes). ``configs`` is the
one registry (kind -> settings classes and back-end class) and its look-ups, and ``registry`` imports the built-in
back-ends and opens an index's back-end by its ``kind``. This package's ``__init__`` imports nothing: parsing a
command line reaches ``configs`` without torch.
"""
