"""Reading a task's ``parsl_resource_specification`` into hetflow's :class:`Resources`, at
submit time (the kernel's ``submit``), with the error both hetflow and Parsl code catch."""
from __future__ import annotations

from parsl.executors.errors import InvalidResourceSpecification

from hetflow.errors import ConfigError
from hetflow.spec import Resources


class InvalidResourceSpec(ConfigError, InvalidResourceSpecification):
    """A ``parsl_resource_specification`` hetflow cannot read: another executor's keys, or
    hetflow's own with bad values.

    It is both a hetflow :class:`~hetflow.ConfigError` and Parsl's
    ``InvalidResourceSpecification``, so code written for either catches it. It lives
    with the executors, where Parsl is imported anyway: ranks import ``hetflow.errors``
    and must not pay for Parsl (``hetflow.executors.kernel`` exports it too).
    """

    def __init__(self, message: str, invalid_keys=()):
        ConfigError.__init__(self, message)
        self.message = message
        self.invalid_keys = set(invalid_keys)

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        return (type(self), (self.message, self.invalid_keys))


def read_resources(spec) -> Resources:
    """``Resources`` from a task's ``parsl_resource_specification``, or InvalidResourceSpec."""
    try:
        return Resources.from_spec(spec)
    except (ConfigError, TypeError) as exc:
        try:
            keys = set(spec)
        except TypeError:   # not a mapping at all
            keys = {type(spec).__name__}
        raise InvalidResourceSpec(str(exc), keys) from exc
