"""Adapter placeholder for pycylon (Cylon's own C++ engine).

pycylon is not installable from PyPI and was not available where this engine was built, so no
adapter code could be exercised; rather than ship untested calls into it, asking for
``backend="pycylon"`` raises :class:`~hetflow.errors.BackendUnavailable` when pycylon is missing
(see :func:`hetflow.frame._backend.resolve`) and :class:`~hetflow.errors.NotSupported` here when
it is present.
"""
from hetflow.errors import NotSupported


def join(left, right, left_keys, right_keys, how, suffixes):
    raise NotSupported("the pycylon adapter is not implemented: pycylon was not available to "
                       "build and test it against; use backend='cpu' (the default engine)")
