"""``batches``: mini-batches of tensors from a DistributedTable, the same count on every rank.

Copies, stated (the test suite checks each): a fixed-width, null-free column in one chunk
becomes a tensor over its Arrow buffer through DLPack, no copy; several feature columns are
stacked into one ``(rows, columns)`` tensor by exactly one copy (each column written once
into it); unshuffled batches are views of those tensors, shuffled ones one gather each
(what any sampler costs). A fill for nulls, a cast to another dtype, a column of several
chunks or one that is not fixed-width (booleans, bit-packed) costs one copy of that column.
"""
from __future__ import annotations

import functools
import logging
from typing import Optional, Sequence, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from hetflow.errors import ConfigError, InputError, NullValues

log = logging.getLogger("hetflow.torch")

#: What ``even=`` may say about partitions whose batch counts differ.
EVEN_POLICIES = ("rebalance", "drop")


def _names(value, what: str) -> list:
    if isinstance(value, str):
        return [value]
    names = list(value)
    if not names or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{what} must be a column name or a non-empty list of names, "
                          f"got {value!r}")
    return names


def _fixed_width_numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t)


def _tensor_type(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _untensorable(schema: pa.Schema, names) -> Optional[InputError]:
    """An :class:`InputError` naming the first of ``names`` whose type no tensor holds."""
    for name in names:
        kind = schema.field(name).type
        if not _tensor_type(kind):
            return InputError(f"batches: column {name!r} has Arrow type {kind}, which no tensor "
                              f"holds; batches takes integer, floating-point and boolean "
                              f"columns (encode it first, e.g. as category codes)")
    return None


def column_tensor(column, name: str, fill=None, dtype: Optional[torch.dtype] = None):
    """One column as a 1-D tensor, and the bytes copied to make it (0: a view of the Arrow
    buffer). Nulls raise :class:`NullValues` naming the column unless ``fill`` is given."""
    if column.null_count:
        if fill is None:
            raise NullValues(f"column {name!r} has {column.null_count} null value(s): a tensor "
                             f"cannot hold them; pass fill= (a value, or {{column: value}})")
        column = pc.fill_null(column, fill)
    copied = 0
    if isinstance(column, pa.ChunkedArray):
        if column.num_chunks == 1:
            column = column.chunk(0)
        else:
            column = column.combine_chunks() if column.num_chunks else pa.array(
                [], type=column.type)
            copied += column.nbytes
    if _fixed_width_numeric(column.type) and column.type != pa.float16():
        tensor = torch.from_dlpack(column) if len(column) else torch.from_numpy(
            np.empty(0, column.type.to_pandas_dtype()))
    else:   # bit-packed booleans, half floats: Arrow converts them into a fresh array
        values = column.to_numpy(zero_copy_only=False)
        if not values.flags.writeable:
            values = values.copy()
        tensor = torch.from_numpy(values)
        copied += values.nbytes
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
        copied += tensor.numel() * tensor.element_size()
    return tensor, copied


class Batches:
    """An iterable of ``(features, label)`` tensor pairs (``features`` alone without a label),
    the same number of batches on every rank; see :func:`batches`."""

    def __init__(self, table, features, label, *, batch_size: int, shuffle: bool, seed: int,
                 drop_last: bool, fill, dtype, label_dtype, even: str, device):
        from hetflow.frame import DistributedTable
        from hetflow.frame import _check

        if not isinstance(table, DistributedTable):
            raise ConfigError(f"batches() needs a hetflow.frame.DistributedTable, got "
                              f"{type(table).__name__}")
        if int(batch_size) != batch_size or batch_size < 1:
            raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
        if even not in EVEN_POLICIES:
            raise ConfigError(f"even must be one of {EVEN_POLICIES}, got {even!r}")
        self.comm = comm = table.comm
        self.batch_size, self.shuffle, self.seed = int(batch_size), bool(shuffle), int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.single_feature = isinstance(features, str)
        feature_names = _names(features, "features")
        label_names = [] if label is None else _names(label, "label")
        if len(label_names) > 1:
            raise ConfigError(f"label must be one column, got {label!r}")
        local = table.local
        error = None
        try:
            _check.check_columns(local.schema, feature_names + label_names, "batches")
        except InputError as exc:
            error = exc
        if error is None:   # a type no tensor holds, found before any copy or step
            error = _untensorable(local.schema, feature_names + label_names)
        if error is None:   # nulls are found on every rank's partition, then agreed
            for name in feature_names + label_names:
                has = local.column(name).null_count
                wanted = fill.get(name) if isinstance(fill, dict) else fill
                if has and wanted is None:
                    error = NullValues(f"batches: column {name!r} has {has} null value(s) on "
                                       f"this rank; pass fill= (a value, or {{column: value}})")
                    break
        _check.agree(comm, [local.schema], error=error)
        counts = self._counts(local.num_rows)
        if len(set(counts)) > 1 and even == "rebalance":
            local = table.rebalance().local        # equal shares to within a row, order kept
            counts = self._counts(local.num_rows)
        #: Batches every rank yields per epoch: the fewest any rank has.
        self.num_batches = min(counts)
        #: What the rank's own rows would have given, by rank (the agreed count drops the rest).
        self.rank_counts = counts
        self.local_rows = local.num_rows
        self.copied_bytes = 0
        fill_of = (lambda n: fill.get(n)) if isinstance(fill, dict) else (lambda n: fill)
        several = len(feature_names) > 1
        # several columns are cast by the stacking copy itself, not one by one before it
        columns = [self._column(local, n, fill_of(n), None if several else dtype)
                   for n in feature_names]
        if not several:
            x = columns[0]
            self.features = x if self.single_feature else x.unsqueeze(1)   # a view either way
        else:
            # the one copy: each column written once into the (rows, columns) matrix
            # (by NumPy: ~3x faster than torch's strided copy into fresh memory, measured)
            out_dtype = dtype or functools.reduce(torch.promote_types, [c.dtype for c in columns])
            matrix = np.empty((local.num_rows, len(columns)),
                              torch.empty(0, dtype=out_dtype).numpy().dtype)
            for j, c in enumerate(columns):
                matrix[:, j] = c.numpy()
            self.features = torch.from_numpy(matrix)
            self.copied_bytes += matrix.nbytes
        self.label = (self._column(local, label_names[0], fill_of(label_names[0]), label_dtype)
                      if label_names else None)
        if device is None:
            from hetflow.torch._group import active_group

            group = active_group()
            device = group.device if group is not None else "cpu"
        self.device = torch.device(device)
        if self.device.type != "cpu":
            self.features, self.label = (_to_device(t, self.device) if t is not None else None
                                         for t in (self.features, self.label))

    def _column(self, local: pa.Table, name: str, fill, dtype):
        tensor, copied = column_tensor(local.column(name), name, fill, dtype)
        self.copied_bytes += copied
        return tensor

    def _counts(self, rows: int) -> list:
        mine = rows // self.batch_size if self.drop_last else -(-rows // self.batch_size)
        return [int(c) for c in self.comm.allgather(mine)]

    def set_epoch(self, epoch: int) -> None:
        """Shuffle the next iteration by ``(seed, epoch, rank)`` (as DistributedSampler's)."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self):
        rows = self.local_rows
        order = None
        if self.shuffle and rows:
            rng = np.random.default_rng([self.seed, self.epoch, self.comm.Get_rank()])
            order = torch.from_numpy(rng.permutation(rows)).to(self.features.device)
        for i in range(self.num_batches):
            lo, hi = i * self.batch_size, min((i + 1) * self.batch_size, rows)
            if order is None:
                x = self.features[lo:hi]
                y = None if self.label is None else self.label[lo:hi]
            else:
                idx = order[lo:hi]
                x = self.features.index_select(0, idx)
                y = None if self.label is None else self.label.index_select(0, idx)
            yield x if y is None else (x, y)


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The tensor on ``device`` once (then every batch is sliced there): through cupy and
    DLPack where cupy is installed (the engine's GPU arrays are cupy's), else torch's copy."""
    try:
        import cupy
    except ImportError:
        log.info("hetflow.torch: cupy is not installed; tensors reach %s by torch's own "
                 "host-to-device copy", device)
        return tensor.to(device)
    with cupy.cuda.Device(device.index or 0):
        return torch.from_dlpack(cupy.asarray(tensor.numpy()))


def batches(table, features: Union[str, Sequence[str]], label: Optional[str] = None, *,
            batch_size: int = 64, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
            fill=None, dtype: Optional[torch.dtype] = None,
            label_dtype: Optional[torch.dtype] = None, even: str = "rebalance",
            device=None) -> Batches:
    """Mini-batches of ``table``'s ``features`` (and ``label``) as tensors, for a training
    loop: ``for x, y in batches(...)``. Collective: every rank of the table's communicator
    calls it, and every rank then yields exactly ``len(result)`` batches per epoch.

    ``features``: a column name (1-D tensors) or a list of names (2-D, one column each).
    ``shuffle``: a new order each epoch, seeded by ``(seed, epoch, rank)``; call
    ``set_epoch(e)`` as with ``DistributedSampler``. ``drop_last``: leave out a last,
    partial batch. ``fill``: the value (or ``{column: value}``) nulls become; without it a
    null raises :class:`~hetflow.errors.NullValues` naming the column, on every rank.
    ``dtype``/``label_dtype``: cast (one copy) instead of keeping the columns' types.
    ``even``: when the ranks' rows would give different batch counts, ``"rebalance"`` first
    moves rows (global order kept) so each rank holds ⌊N/p⌋ or ⌈N/p⌉; ``"drop"`` keeps the
    partitions. Either way each rank yields the fewest batches any rank has (so a rank never
    waits in an all-reduce its peers will not enter); a rank with more drops its last ones.
    ``device``: where the tensors go (moved once; ``"cuda"`` by DLPack from cupy when
    installed); default the device of the enclosing :func:`process_group` (``cuda:i``
    under NCCL), else the CPU.
    """
    return Batches(table, features, label, batch_size=batch_size, shuffle=shuffle, seed=seed,
                   drop_last=drop_last, fill=fill, dtype=dtype, label_dtype=label_dtype,
                   even=even, device=device)
