"""The quality bench as a package; ``bench/quality.py`` is its command line.

Read in this order:

- ``runs``: the runs (``RUNS``, groups), their settings (``DEFAULTS``), ids and DeepSpeed configs;
- ``runner``: training them on in-process gloo ranks, checkpointed and resumable (``run``);
- ``diagnostics``: which coordinates move, and how far;
- ``tables``: the summary and curves CSVs that git keeps, and the markdown tables;
- ``plots``: the curves, each configuration at its best lr, and loss against bytes.
"""
