"""A Prefect server on PostgreSQL, as docs/deploy-aws.md and the README describe it for large rounds.

deployments/prefect/postgres.sh starts a private PostgreSQL (its own data directory in a temporary
folder, a free port on 127.0.0.1, its socket in that folder: never the machine's own server); a
real ``prefect server start`` uses it as its database; a short ``nitro train`` runs against that
server. The runs it recorded are then read back from PostgreSQL itself, so the test fails if the
server quietly fell back to SQLite. Skipped only where PostgreSQL's binaries are not installed.
"""

from __future__ import annotations

import asyncio
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.support.servers import REPO, prefect_server

SCRIPT = REPO / "deployments" / "prefect" / "postgres.sh"
NITRO = str(Path(sys.executable).with_name("nitro"))


def _postgres_installed() -> bool:
    return bool(os.environ.get("PG_BIN") or shutil.which("initdb") or glob.glob("/usr/lib/postgresql/*/bin/initdb"))


pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.skipif(
    not _postgres_installed(),
    reason="PostgreSQL's initdb/pg_ctl are not installed (Debian/Ubuntu: apt-get install postgresql)")]


def _script(*args: str) -> str:
    done = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"postgres.sh {' '.join(args)} failed ({done.returncode}): {done.stderr}"
    return done.stdout.strip()


@pytest.fixture(scope="module")
def postgres_url():
    folder = tempfile.mkdtemp(prefix="nitro-test-pg-")  # directly under /tmp: the postgres user can reach it
    try:
        url = _script("start", folder)
        assert url.startswith("postgresql+asyncpg://prefect@127.0.0.1:") and url.endswith("/prefect")
        assert _script("start", folder) == url  # starting twice changes nothing
        assert Path(folder, f".s.PGSQL.{url.split(':')[-1].split('/')[0]}").exists()  # its own socket
        yield url
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop", folder], capture_output=True, timeout=120)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def server_on_postgres(postgres_url, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prefect-on-postgres")
    with prefect_server(tmp, extra_env={"PREFECT_API_DATABASE_CONNECTION_URL": postgres_url}) as server:
        yield server


def _rows(postgres_url: str, query: str) -> list:
    import asyncpg

    async def fetch() -> list:
        conn = await asyncpg.connect(postgres_url.replace("postgresql+asyncpg://", "postgresql://"))
        try:
            return await conn.fetch(query)
        finally:
            await conn.close()

    return asyncio.run(fetch())


def test_training_runs_against_a_prefect_server_on_postgres(server_on_postgres, postgres_url):
    api, env, tmp = server_on_postgres.api, server_on_postgres.env, server_on_postgres.tmp
    run_id = "pg-e2e"
    done = subprocess.run(
        [NITRO, "train", "--run-id", run_id, "rounds=2", "scaler.name=fixed", "scaler.fixed_actors=3",
         "steps_per_actor=64", "detector.subset_size=64", "eval.every_rounds=0", "backend.workers=2",
         f"home={tmp / 'home'}", f"tracking.mlflow_uri=sqlite:///{tmp}/mlflow.db"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, f"nitro train failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"

    # The server's view: both rounds completed, every actor's task run recorded (the task-run
    # recorder writes them from events, so give it a moment).
    with httpx.Client(base_url=api, timeout=30) as client:
        for k in range(2):
            runs = client.post(
                "/flow_runs/filter", json={"flow_runs": {"name": {"any_": [f"{run_id}-round-{k}"]}}}
            ).json()
            assert [r["state"]["type"] for r in runs] == ["COMPLETED"], runs
        body = {"task_runs": {"name": {"like_": f"actor-{run_id}-"}, "state": {"type": {"any_": ["COMPLETED"]}}}}
        deadline = time.monotonic() + 60
        while (count := client.post("/task_runs/count", json=body).json()) < 6 and time.monotonic() < deadline:
            time.sleep(1)
        assert count == 6

    # ... and PostgreSQL's: the rows are in the database the script started.
    rounds = _rows(postgres_url, f"SELECT name FROM flow_run WHERE name LIKE '{run_id}-round-%' ORDER BY name")
    assert [r["name"] for r in rounds] == [f"{run_id}-round-0", f"{run_id}-round-1"]
    actors = _rows(postgres_url, f"SELECT count(*) AS n FROM task_run WHERE name LIKE 'actor-{run_id}-%'")
    assert actors[0]["n"] == 6
