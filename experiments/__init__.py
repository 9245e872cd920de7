"""The Radical-Cylon paper's experiments at this machine's scale, and runtime-comparison reports.

``hetflow bench <experiment>`` (or ``python -m hetflow.experiments <experiment>``) runs one of the
configs in ``experiments/configs/`` (weak, strong, overhead, pilot, peers, or ``all``),
appends one JSON line per measurement to ``OUT/results.jsonl`` and writes ``OUT/report.md``
with PNG plots; ``hetflow bench report OUT/results.jsonl`` rebuilds the report from the
results alone. Modules: ``config`` (TOML configs), ``protocol`` (the paper's timing protocol,
run on the ranks), ``runner`` (experiments, sessions, results rows), ``peers`` (pyarrow,
polars, duckdb alone), ``report`` (tables and plots), ``cli``.
"""
