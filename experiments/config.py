"""Experiment configs: small TOML files in ``experiments/configs/``, one per experiment.

Each file gives the full (committed-report) settings at top level and a
``[quick]`` table of overrides for the one-minute smoke run. Command-line flags
(``--rows``, ``--repeats``, ``--executors``) override both.
"""
from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from hetflow.errors import ConfigError

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")

#: Experiment kinds and what their ``rows`` list means.
KINDS = {
    "weak": "per_rank",       # rows per rank, fixed as ranks grow
    "strong": "total",        # total rows, divided over ranks
    "overhead": "per_rank",   # rows per rank of the one task, one size per entry
    "pilot": "per_rank",      # rows per rank: the pair uses the last, the campaign cycles
    "peers": "total",         # total rows of each table, one size per entry
    "analytics": "total",     # rows of the big table, one size per entry
    "paper": "per_rank",      # rows per rank of the weak cases (strong: ``strong_rows``)
    "pipeline": "per_rank",   # events per rank of the features task
    "throughput": "total",    # (unused: ``queued`` gives the task counts)
    "soak": "total",          # throughput's 100,000-task run
}
#: How the pipeline's features table reaches its later tasks (see experiments/pipeline.py).
HANDOFFS = ("table", "keep")
OPS = ("join", "sort")


@dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
    """One experiment's settings (see the TOML files for what each field means there)."""

    name: str
    kind: str
    description: str = ""
    ops: Tuple[str, ...] = OPS
    ranks: Tuple[int, ...] = (1, 2)
    rows: Tuple[int, ...] = (100_000,)
    iterations: int = 10
    repeats: int = 3
    executors: Tuple[str, ...] = ("mpirun", "parsl", "radical", "pool")
    unique: float = 0.9
    paper_rows: Optional[int] = None
    tasks: int = 8
    peers: Tuple[str, ...] = ("pyarrow", "polars", "duckdb")
    baseline: str = "mpirun"
    executor_options: Dict[str, dict] = field(default_factory=dict)
    #: seconds of each runtime-CPU window with no task (after start, after the last task)
    idle_s: float = 2.0
    #: (analytics) the queries to run, by name; empty: all of them
    queries: Tuple[str, ...] = ()
    #: (paper) total rows of the strong cases, divided over ``ranks``
    strong_rows: Tuple[int, ...] = ()
    #: (paper) whether ``hetflow bench all`` runs it (the paper's scale takes minutes and GiBs)
    in_all: bool = True
    #: (pipeline) ranks of the training task (``ranks``: those of the features and evaluation)
    train_ranks: int = 2
    #: (pipeline) how the table is handed over: "table" everywhere, "keep" on the pool only
    handoffs: Tuple[str, ...] = ("table",)
    #: (pipeline) training mini-batch size and hidden width of the MLP
    batch_size: int = 64
    hidden: int = 16
    #: (throughput) tasks submitted at once, slot counts, and at most this many queued at
    #: a time (0: all at once); ``task_limits``: the most tasks a runtime is given (mpirun)
    queued: Tuple[int, ...] = (1000,)
    slots: Tuple[int, ...] = (2,)
    window: int = 0
    task_limits: Dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConfigError(f"experiment {self.name!r}: kind must be one of {sorted(KINDS)}, "
                              f"got {self.kind!r}")
        bad = [op for op in self.ops if op not in OPS]
        if bad:
            raise ConfigError(f"experiment {self.name!r}: unknown op(s) {bad}; expected {OPS}")
        for name, values in (("ranks", self.ranks), ("rows", self.rows),
                             ("queued", self.queued), ("slots", self.slots)):
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                                 for v in values):
                raise ConfigError(f"experiment {self.name!r}: {name} must be a non-empty list of "
                                  f"positive ints, got {list(values)!r}")
        bad = [h for h in self.handoffs if h not in HANDOFFS]
        if bad or not self.handoffs:
            raise ConfigError(f"experiment {self.name!r}: handoffs must be some of {HANDOFFS}, "
                              f"got {list(self.handoffs)!r}")
        for name in ("iterations", "repeats", "tasks", "train_ranks", "batch_size", "hidden"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"experiment {self.name!r}: {name} must be a positive int, "
                                  f"got {value!r}")
        if self.kind == "analytics":
            from hetflow.experiments.analytics import QUERIES

            unknown = sorted(set(self.queries) - {q.name for q in QUERIES})
            if unknown:
                raise ConfigError(f"experiment {self.name!r}: unknown queries {unknown}; expected "
                                  f"some of {[q.name for q in QUERIES]}")
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in self.strong_rows):
            raise ConfigError(f"experiment {self.name!r}: strong_rows must be positive ints, got "
                              f"{list(self.strong_rows)!r}")
        if not 0 < self.unique <= 1:
            raise ConfigError(f"experiment {self.name!r}: unique must be in (0, 1], got {self.unique}")
        if self.kind == "strong":
            too_small = [r for r in self.rows for n in self.ranks if r < n]
            if too_small:
                raise ConfigError(f"experiment {self.name!r}: total rows {too_small} smaller than "
                                  "a rank count")

    @property
    def rows_mode(self) -> str:
        """"per_rank" or "total": how ``rows`` is read for this kind."""
        return KINDS[self.kind]

    @property
    def scale_factor(self) -> Optional[float]:
        """How many times smaller than the paper's size this run is (None if no paper size)."""
        if not self.paper_rows:
            return None
        return self.paper_rows / max(self.rows)

    def replace(self, **overrides) -> "ExperimentConfig":
        overrides = {k: v for k, v in overrides.items() if v is not None}
        return dataclasses.replace(self, **_tuples(overrides))

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(rows_mode=self.rows_mode, scale_factor=self.scale_factor)
        return d


def _tuples(values: dict) -> dict:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}


def experiment_names() -> List[str]:
    """The experiments shipped in ``configs/``, by file name."""
    return sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".toml"))


#: ``idle_s`` of a ``--quick`` run: a smoke run checks the windows are taken, not their size.
QUICK_IDLE_S = 0.5


def load(name_or_path: str, *, quick: bool = False) -> ExperimentConfig:
    """Read an experiment config by name (``weak``) or path; ``quick`` applies ``[quick]``."""
    path = name_or_path if name_or_path.endswith(".toml") else os.path.join(
        CONFIG_DIR, f"{name_or_path}.toml")
    if not os.path.isfile(path):
        raise ConfigError(f"no experiment {name_or_path!r}: expected one of {experiment_names()} "
                          f"or a path to a .toml file")
    with open(path, "rb") as fh:
        try:
            raw = tomllib.load(fh)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML ({exc})") from exc
    quick_overrides = raw.pop("quick", {})
    if quick:
        raw.update({"idle_s": QUICK_IDLE_S, **quick_overrides})
    raw.setdefault("name", os.path.basename(path)[:-5])
    known = {f.name for f in dataclasses.fields(ExperimentConfig)}
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {sorted(unknown)}; expected some of {sorted(known)}")
    return ExperimentConfig(**_tuples(raw))


def parse_ints(text: Optional[str]) -> Optional[Sequence[int]]:
    """``"1e6,2_000_000"`` -> ``[1000000, 2000000]`` (for ``--rows``)."""
    if text is None:
        return None
    out = []
    for part in text.split(","):
        part = part.strip().replace("_", "")
        try:
            value = float(part) if ("e" in part.lower() or "." in part) else int(part)
        except ValueError:
            raise ConfigError(f"--rows: {part!r} is not a number") from None
        if value != int(value) or value < 1:
            raise ConfigError(f"--rows: {part!r} is not a positive whole number")
        out.append(int(value))
    return out
