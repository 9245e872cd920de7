"""The one resource vocabulary every executor translates: :class:`Resources`."""
from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass

RETURNS = ("root", "all")


def _config_error(message: str):
    """A :class:`~hetflow.errors.ConfigError`; the errors module loads only when one is raised
    (a rank unpickles :class:`Resources` but need not pay for ``concurrent.futures``)."""
    from hetflow.errors import ConfigError

    return ConfigError(message)


def _positive_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _config_error(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise _config_error(f"{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True, kw_only=True)
class Resources:
    """What one MPI task asks for.

    ranks: size of the task's private communicator.
    cores_per_rank: cores reserved for each rank (sets OMP_NUM_THREADS).
    gpus_per_rank: GPUs bound to each rank via CUDA_VISIBLE_DEVICES.
    walltime: seconds before the task is stopped with WalltimeExceeded (None: no limit).
    returns: "root" resolves the future to rank 0's value, "all" to every rank's, in rank order.
    retries: extra tries after a retryable failure (bad input is never retried).
    """

    ranks: int = 1
    cores_per_rank: int = 1
    gpus_per_rank: int = 0
    walltime: float | None = None
    returns: str = "root"
    retries: int = 0

    def __post_init__(self):
        _positive_int("ranks", self.ranks, 1)
        _positive_int("cores_per_rank", self.cores_per_rank, 1)
        _positive_int("gpus_per_rank", self.gpus_per_rank, 0)
        _positive_int("retries", self.retries, 0)
        if self.walltime is not None:
            if isinstance(self.walltime, bool) or not isinstance(self.walltime, (int, float)):
                raise _config_error(f"walltime must be seconds (a number) or None, got {self.walltime!r}")
            if not self.walltime > 0:
                raise _config_error(f"walltime must be > 0 seconds, got {self.walltime}")
        if self.returns not in RETURNS:
            raise _config_error(f"returns must be one of {RETURNS}, got {self.returns!r}")

    @property
    def cores(self) -> int:
        """Cores the whole task occupies."""
        return self.ranks * self.cores_per_rank

    def replace(self, **overrides: object) -> "Resources":
        """A copy with ``overrides`` applied; unknown keys raise ConfigError."""
        unknown = set(overrides) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise _config_error(
                f"unknown resource key(s) {sorted(unknown)}; expected some of "
                f"{[f.name for f in dataclasses.fields(self)]}")
        return dataclasses.replace(self, **overrides)

    def as_dict(self) -> dict:
        """The fields as a dict: what ``dataclasses.asdict`` gives for these immutable
        fields, without its deep copy (two of those per task were a fifth of the client's
        Python calls for a no-op task on the pool)."""
        return {name: getattr(self, name) for name in _FIELDS}

    def to_spec(self) -> dict:
        """The dict carried to executors as Parsl's ``parsl_resource_specification``."""
        return {"hetflow": self.as_dict()}

    @classmethod
    def from_spec(cls, spec: Mapping[str, object] | None) -> "Resources":
        """Rebuild from :meth:`to_spec`'s dict; a plain Parsl app (no spec) is one rank."""
        if not spec:
            return cls()
        if "hetflow" not in spec:
            raise _config_error(
                f"resource specification {dict(spec)!r} is not hetflow's; "
                "decorate the function with @hetflow.mpi_app(...) instead")
        extra = set(spec) - {"hetflow"}
        if extra:
            raise _config_error(f"unknown resource specification key(s) {sorted(extra)}")
        fields = spec["hetflow"]
        try:
            return _from_items(tuple(fields.items()))   # the same few specs, task after task
        except TypeError:                              # an unhashable value: checked uncached
            return cls().replace(**fields)


_FIELDS = tuple(f.name for f in dataclasses.fields(Resources))


@functools.lru_cache(maxsize=256)
def _from_items(items: tuple) -> Resources:
    return Resources().replace(**dict(items))


def machine_gpu_ids() -> list:
    """The ids of the GPUs this machine's processes may use: ``CUDA_VISIBLE_DEVICES``'s
    entries when it is set, else ``0..n-1`` for the ``/dev/nvidiaN`` devices (none without a
    driver)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [d.strip() for d in visible.split(",")]
        if "-1" in ids:           # CUDA stops at the first invalid id
            ids = ids[:ids.index("-1")]
        return [d for d in ids if d]
    try:
        count = len([d for d in os.listdir("/dev") if d.startswith("nvidia") and d[6:].isdigit()])
    except OSError:
        count = 0
    return [str(d) for d in range(count)]


def machine_gpus() -> int:
    """GPUs visible on this machine (0 when there are none or no driver)."""
    return len(machine_gpu_ids())


def gpu_ids(gpus) -> list:
    """The device ids an executor's ``gpus=`` declares, per node: a count ``n`` means ids
    ``0..n-1``; a list gives the ids themselves (as ``CUDA_VISIBLE_DEVICES`` spells them,
    e.g. ``[2, 3]`` or ``["GPU-8a1f...", ...]``); None means this machine's
    (:func:`machine_gpu_ids`)."""
    if gpus is None:
        return machine_gpu_ids()
    if isinstance(gpus, int) and not isinstance(gpus, bool):
        if gpus < 0:
            raise _config_error(f"gpus must be >= 0 or a list of device ids, got {gpus}")
        return [str(d) for d in range(gpus)]
    if isinstance(gpus, (list, tuple)):
        ids = [str(d).strip() for d in gpus]
        bad = [d for d in ids if not d or "," in d or d == "-1"]
        if bad or any(isinstance(d, bool) or not isinstance(d, (int, str)) for d in gpus):
            raise _config_error(f"gpus: device ids must be ints or names without commas, got "
                                f"{list(gpus)!r}")
        if len(set(ids)) != len(ids):
            raise _config_error(f"gpus: device ids must be distinct, got {list(gpus)!r}")
        return ids
    raise _config_error(f"gpus must be a count or a list of device ids, got {gpus!r} "
                        f"({type(gpus).__name__})")
