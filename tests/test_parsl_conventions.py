"""What a Parsl user expects of hetflow's executors: Parsl's own exception types.

A plain Parsl app handed another executor's ``parsl_resource_specification``, or a
malformed one, fails with Parsl's ``InvalidResourceSpecification`` (as Parsl's own
executors do), which is also hetflow's ``ConfigError``; everything else keeps its
hetflow type. Runs on the ``debug`` runtime (in-process, no MPI launch) and on
``mpirun`` in a user's own ``parsl.Config``.
"""
import pickle

import parsl
import pytest
from parsl.executors.errors import InvalidResourceSpecification

import hetflow
from hetflow.executors.kernel import InvalidResourceSpec

pytestmark = pytest.mark.timeout(120)


@parsl.python_app
def plain(x, parsl_resource_specification=None):
    return x + 1


@hetflow.mpi_app
def one(comm, x):
    return x * 2


FOREIGN = [
    {"num_nodes": 2, "ranks_per_node": 2, "num_ranks": 4},          # Parsl MPI mode's keys
    {"cores": 2, "memory": 1000, "disk": 1000},                    # Work Queue's keys
    {"hetflow": {"ranks": 0}},                                     # hetflow's, bad value
    {"hetflow": {"ranks": 1}, "priority": 3},                      # hetflow's plus a stranger
    {"hetflow": {"no_such_key": 1}},
]


def test_in_a_users_own_parsl_config(tmp_path):
    """The executors are ordinary Parsl executors: the same error in a hand-made Config.

    First in the file: it loads its own DFK before the module's debug runtime is loaded."""
    from hetflow.executors.mpirun import MpirunExecutor

    config = parsl.Config(executors=[MpirunExecutor(max_ranks=2)], run_dir=str(tmp_path),
                          strategy="none")
    with parsl.load(config):
        error = plain(1, parsl_resource_specification={"num_nodes": 1}).exception(timeout=60)
        assert isinstance(error, InvalidResourceSpecification)
        assert isinstance(error, hetflow.ConfigError)
        assert one(3).result(timeout=60) == 6


@pytest.fixture(scope="module")
def debug_runtime():
    with hetflow.runtime("debug"):
        yield


@pytest.mark.parametrize("spec", FOREIGN, ids=lambda s: "-".join(s))
def test_foreign_or_malformed_spec_is_parsls_error(debug_runtime, spec):
    error = plain(1, parsl_resource_specification=spec).exception(timeout=60)
    assert isinstance(error, InvalidResourceSpecification), repr(error)
    assert isinstance(error, hetflow.ConfigError)
    assert isinstance(error, InvalidResourceSpec)
    assert error.invalid_keys == set(spec)
    assert str(error)          # readable, not Parsl's generic "Invalid ... Supplied"


def test_plain_app_without_a_spec_runs_as_one_rank(debug_runtime):
    assert plain(1).result(timeout=60) == 2


def test_mpi_app_given_parsls_spec_keyword_is_parsls_error(debug_runtime):
    with pytest.raises(InvalidResourceSpecification) as info:
        one(1, parsl_resource_specification={"num_ranks": 2})
    assert isinstance(info.value, hetflow.ConfigError)


def test_other_errors_keep_their_hetflow_types(debug_runtime):
    with pytest.raises(hetflow.ResourcesUnavailable) as info:
        one.options(ranks=2)(1)
    assert not isinstance(info.value, InvalidResourceSpecification)
    with pytest.raises(hetflow.ConfigError) as info:
        one.options(ranks=0)
    assert not isinstance(info.value, InvalidResourceSpecification)


def test_the_error_pickles_with_its_keys():
    error = InvalidResourceSpec("bad spec", {"num_nodes"})
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is InvalidResourceSpec
    assert back.invalid_keys == {"num_nodes"} and str(back) == "bad spec"
