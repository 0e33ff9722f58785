"""The ``llama-guard`` command: ``main`` parses it; ``demo``, ``run``, and the ``doctor`` and ``watch`` packages."""
