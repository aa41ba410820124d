"""The benchmark's sections, one module each (``bench/run.py`` plans, runs and prints them).

A section module declares ``Config`` (its options, each with its flag: :func:`sections.options.option`),
``jobs(config)`` (the child processes it needs), ``run(config, job)`` (what one child measures, a JSON-able dict)
and ``rows(label, result)`` (its lines of the printed table). ``sections.config`` assembles the options of all of
them into one typed :class:`~sections.config.BenchConfig` and one parser; ``sections.common`` holds what the
children share (dataset, model, base index). A new section is one more module and one line in
``sections.config.SECTION_MODULES``.
"""
