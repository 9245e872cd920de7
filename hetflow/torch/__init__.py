"""PyTorch on hetflow tasks: a training process group on exactly a task's ranks, and
mini-batches of tensors from a :class:`~hetflow.frame.DistributedTable`.

Needs the ``torch`` extra (``pip install 'hetflow[torch]'``). Inside an ``@hetflow.mpi_app``::

    with hetflow.torch.process_group() as group:          # Gloo on CPUs, NCCL on GPUs
        model = torch.nn.parallel.DistributedDataParallel(net)
        for features, label in hetflow.torch.batches(table, ["x0", "x1"], "y", batch_size=64):
            ...
"""
from hetflow.errors import NullValues
from hetflow.torch._batches import Batches, batches
from hetflow.torch._group import (BUILD_TIMEOUT, DEFAULT_TIMEOUT, Group, IntruderError,
                                  process_group)

__all__ = ["BUILD_TIMEOUT", "DEFAULT_TIMEOUT", "Batches", "Group", "IntruderError", "NullValues", "batches",
           "process_group"]
