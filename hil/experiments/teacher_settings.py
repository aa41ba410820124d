"""The named settings of the teacher tool (``hil teacher``), without the models and files behind them, so that its
``--help`` needs nothing more: the kinds of teacher (:mod:`hil.experiments.teacher_models`) and the formats of the
examples file (:mod:`hil.experiments.teacher`)."""

KINDS = ("auto", "colbert", "cross-encoder", "dense")
FORMATS = ("colbert", "pylate", "trec")
