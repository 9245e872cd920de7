"""Which compute path runs the engine's kernels: NumPy/Arrow on the CPU, cupy on a GPU, or pycylon.

The choice is made per operation from (in order) the operation's ``backend=`` argument,
:func:`set_backend`, and ``$HETFLOW_FRAME_BACKEND``; ``"auto"`` (the default) takes cupy when cupy
imports and sees a GPU, else the CPU. pycylon is only used when asked for by name, since it brings
its own MPI context. A result's ``backend`` attribute names the path that actually ran: nothing
claims GPU or pycylon work that did not happen, and asking for a path that cannot run raises
:class:`~hetflow.errors.BackendUnavailable` instead of falling back silently. (An operation
pycylon has no form of, such as a semi join, runs on the CPU engine with a logged warning and
``backend == "cpu"``; see :mod:`hetflow.frame._pycylon`.)
"""
from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Optional

import numpy as np

from hetflow.errors import BackendUnavailable, ConfigError

log = logging.getLogger("hetflow.frame")

BACKENDS = ("auto", "cpu", "cupy", "pycylon")
ENV = "HETFLOW_FRAME_BACKEND"
_default: Optional[str] = None
_announced = set()


def set_backend(name: Optional[str]) -> None:
    """Set the process-wide default backend (``None`` restores ``$HETFLOW_FRAME_BACKEND``/auto)."""
    global _default
    if name is not None:
        _check_name(name)
    _default = name


def _check_name(name: str) -> str:
    if name not in BACKENDS:
        raise ConfigError(f"unknown frame backend {name!r}; expected one of {', '.join(BACKENDS)}")
    return name


@functools.lru_cache(maxsize=None)
def _cupy_status():
    """(cupy module or None, reason it cannot be used)."""
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - ImportError, or a CUDA library load failure
        return None, f"cupy is not importable ({type(exc).__name__}: {exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - any CUDA error means: no usable GPU
        return None, f"cupy imports but no CUDA device is usable ({type(exc).__name__}: {exc})"
    if count < 1:
        return None, "cupy imports but sees no GPU"
    return cupy, ""


@functools.lru_cache(maxsize=None)
def _pycylon_status():
    try:
        import pycylon
    except Exception as exc:  # noqa: BLE001 - a broken native build fails in many ways
        return None, f"pycylon is not importable ({type(exc).__name__}: {exc})"
    return pycylon, ""


def requested_name(backend: Optional[str] = None) -> str:
    """The backend name asked for (argument, then :func:`set_backend`, then the environment),
    before any check that it can run; the pycylon adapter routes on it."""
    return _check_name(backend or _default or os.environ.get(ENV) or "auto")


def pycylon_module():
    """The imported pycylon module; raises BackendUnavailable (naming the import error) if
    pycylon cannot be imported."""
    resolve("pycylon")
    return _pycylon_status()[0]


def resolve(requested: Optional[str] = None) -> str:
    """The backend an operation will run on: ``"cpu"``, ``"cupy"`` or ``"pycylon"``."""
    name = requested or _default or os.environ.get(ENV) or "auto"
    _check_name(name)
    if name == "cupy":
        if _cupy_status()[0] is None:
            raise BackendUnavailable(f"frame backend 'cupy' was requested but {_cupy_status()[1]}; "
                                     "use backend='cpu' or 'auto'")
        return "cupy"
    if name == "pycylon":
        if _pycylon_status()[0] is None:
            raise BackendUnavailable(f"frame backend 'pycylon' was requested but "
                                     f"{_pycylon_status()[1]}; use backend='cpu' or 'auto'")
        return "pycylon"
    if name == "auto":
        chosen = "cupy" if _cupy_status()[0] is not None else "cpu"
        if chosen not in _announced:
            _announced.add(chosen)
            why = "" if chosen == "cupy" else f" ({_cupy_status()[1]})"
            log.info("hetflow.frame: hash partitioning and local sort run on %s%s",
                     "the GPU (cupy)" if chosen == "cupy" else "the CPU (NumPy/Arrow)", why)
        return chosen
    return "cpu"


def array_module(backend: str):
    """numpy for the CPU path, cupy for the GPU path (the kernels are written against both)."""
    if backend == "cupy":
        return _cupy_status()[0]
    return np


def to_host(xp, array) -> np.ndarray:
    return array if xp is np else xp.asnumpy(array)


def configure_threads(comm) -> int:
    """Give each rank its share of the cores for Arrow's thread pool, once per process.

    With R ranks per node each running Arrow's default pool (one thread per core), the ranks
    oversubscribe the cores and both get slower. ``$HETFLOW_FRAME_THREADS`` overrides.
    """
    return _configure_threads_once(_ranks_on_node(comm))


def _ranks_on_node(comm) -> int:
    for var in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_LOCAL_SIZE"):
        if os.environ.get(var, "").isdigit():
            return max(1, int(os.environ[var]))
    return max(1, comm.Get_size())


@functools.lru_cache(maxsize=None)
def _configure_threads_once(ranks_on_node: int) -> int:
    import pyarrow as pa

    wanted = os.environ.get("HETFLOW_FRAME_THREADS", "")
    if wanted.isdigit() and int(wanted) > 0:
        threads = int(wanted)
    else:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cores = os.cpu_count() or 1
        threads = max(1, cores // ranks_on_node)
    pa.set_cpu_count(threads)
    # the compiled engine's pool (hetflow/frame/_engine.py), sized when polars is imported:
    # a runtime's rank has it set to its cores per rank already
    if not os.environ.get("POLARS_MAX_THREADS"):
        os.environ["POLARS_MAX_THREADS"] = str(threads)
    if os.environ.get("HETFLOW_FRAME_ALLOCATOR", "") != "keep":
        _tune_allocators()
    return threads


#: Buffers from this size up are mmapped by glibc (and returned to the OS when freed); NumPy
#: asks for transparent huge pages from the same size (4 MiB), so their first touch costs a
#: fault per 2 MiB, not per 4 KiB page, except in their partial first and last 2 MiB, which
#: the engine's own buffers avoid (:func:`hetflow.frame._arrays.empty`, from the same size).
MMAP_THRESHOLD = 4 << 20
#: When the free memory at the top of glibc's heap exceeds this, it goes back to the OS (a
#: larger value kept more freed pages resident: a 2-rank sort of 2M rows then peaked at 3.5x
#: its partition above base instead of 3.0x).
TRIM_THRESHOLD = 4 << 20
#: Operations on partitions below SMALL_BYTES (both sides) keep HEAP_PAD bytes of freed heap
#: resident when glibc trims it (M_TOP_PAD): their buffers are all below MMAP_THRESHOLD, so
#: each operation would otherwise fault in its temporaries again, page by page (a 2-rank join
#: of 100k rows per rank took 13 ms, 6 ms with the pad; one rank 6 ms, 4 ms). Larger
#: operations keep no pad: there the peak's ratio to the partition is what counts (the pad
#: took a 2-rank sort of 2M rows from 2.8x to 3.3x).
SMALL_BYTES = 16 << 20
HEAP_PAD = 8 << 20
_mallopt = None     # glibc's mallopt, once _tune_allocators has tuned the allocator
_pad_now = 0        # the M_TOP_PAD last set


def _tune_allocators() -> None:
    """Keep a rank's peak memory close to its live data without paying a page fault for every
    4 KiB of every temporary (opt out: HETFLOW_FRAME_ALLOCATOR=keep).

    The engine's temporaries are NumPy and Arrow buffers freed within one operation. Left to
    itself glibc raises its mmap threshold after the first large free, after which even the
    largest buffers come from the heap and its high-water mark stays resident; and NumPy
    (malloc) and Arrow (its own mimalloc/jemalloc pool) cannot reuse each other's freed memory:
    Arrow goes on the system allocator, and glibc gets fixed thresholds. Buffers of 4 MiB and
    more are mmapped and go back to the OS when freed (measured on a 2 x 5M-row join, peak RSS
    per rank fell from ~550 to ~430 MiB). Smaller ones come from the heap, which keeps up to
    4 MiB free at its top for reuse: a fresh small buffer costs a page fault per 4 KiB on first touch,
    about 5 us each in a virtual machine, more than the NumPy work on it, and at 100k rows per
    rank those faults were two thirds of an operation's CPU time (a 128 KiB threshold, the
    previous setting, sent every buffer of more than 16k rows to mmap).
    """
    import ctypes

    import pyarrow as pa

    global _mallopt
    mallopt = libc_function("mallopt", ctypes.c_int, [ctypes.c_int, ctypes.c_int])
    if mallopt is not None and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD (glibc); fixed, no dynamic raise
        if "MALLOC_TRIM_THRESHOLD_" not in os.environ:
            mallopt(-1, TRIM_THRESHOLD)  # M_TRIM_THRESHOLD
        if "MALLOC_TOP_PAD_" not in os.environ:
            _mallopt = mallopt           # heap_pad_for sets M_TOP_PAD per operation
    if "ARROW_DEFAULT_MEMORY_POOL" not in os.environ:
        try:
            pa.set_memory_pool(pa.system_memory_pool())
        except Exception:  # noqa: BLE001  # pragma: no cover - very old pyarrow
            pass


def libc_function(name: str, restype, argtypes):
    """The C library's function ``name`` with its signature (ctypes types), or None where
    there is none to call (not Linux, or no such symbol): the caller then goes without."""
    import ctypes

    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.restype = restype
    fn.argtypes = argtypes
    return fn


def heap_pad_for(nbytes: int) -> None:
    """Before an operation on ``nbytes`` of partitions: the heap pad it should run with
    (:data:`HEAP_PAD` below :data:`SMALL_BYTES`, else none); a no-op unless the allocators
    were tuned (see :func:`_tune_allocators`)."""
    global _pad_now
    if _mallopt is None:
        return
    want = HEAP_PAD if nbytes < SMALL_BYTES else 0
    if want != _pad_now:
        _mallopt(-2, want)                    # M_TOP_PAD
        _pad_now = want
