"""The Prefect link that `nitro train` prints still works after the run.

With no Prefect server configured, the run's API server is a temporary one that stops with the
run; the command prints instead the `prefect server start` that serves the run's Prefect database
and the page the flow run has there. This test runs that command as printed (on a free port) and
finds the finished flow run, its rounds and its page there, and the same page linked from MLflow.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from mlflow.tracking import MlflowClient

from tests.support.servers import REPO, base_env, free_port, kill_group, spawn, tail, wait_until
from tests.support.templates import nitro_home, prefect_home

pytestmark = pytest.mark.timeout(300)

HINT = re.compile(r"^  Prefect: (?P<url>http://\S+/runs/flow-run/(?P<id>[0-9a-f-]{36})) "
                  r"once this serves the run's Prefect database:\n    (?P<command>.+)$", re.MULTILINE)


def _assignments_and_argv(command: str) -> tuple[dict[str, str], list[str]]:
    """``NAME=value ... program args``, split as a POSIX shell splits it."""
    words = shlex.split(command)
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words


@pytest.mark.slow
def test_the_printed_prefect_hint_serves_the_finished_flow_run(tmp_path: Path):
    home = nitro_home(tmp_path / "home")
    # no PREFECT_API_URL: a temporary server
    env = dict(base_env(), PREFECT_HOME=str(prefect_home(tmp_path / "prefect")))
    done = subprocess.run(
        [sys.executable, "-m", "cli.main", "train", "rounds=2", "steps_per_actor=64", "scaler.name=fixed",
         "scaler.fixed_actors=2", "backend.workers=2", "detector.subset_size=64", "eval.every_rounds=0",
         f"home={home}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    hint = HINT.search(done.stdout)
    assert hint, done.stdout
    url, flow_run_id = hint["url"], hint["id"]
    served_env, argv = _assignments_and_argv(hint["command"])
    assert served_env["PREFECT_HOME"] == str(tmp_path / "prefect"), hint["command"]
    assert argv[-4:-1] == ["server", "start", "--port"], argv
    assert urlsplit(url).port == int(argv[-1]), (url, argv)  # the page is on the server the command starts

    # The MLflow run links to the same page.
    mlflow = MlflowClient(tracking_uri=f"sqlite:///{home}/mlflow.db")
    mlflow_runs = mlflow.search_runs([e.experiment_id for e in mlflow.search_experiments()])
    assert [r.data.tags.get("prefect.flow_run_url") for r in mlflow_runs] == [url]

    # Serve it as printed, on a free port; relative paths in the command are the repository's, where nitro ran.
    port = free_port()
    argv[-1] = str(port)
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "served-prefect.log"
    server = spawn(argv, dict(base_env(), **served_env), log)
    try:
        wait_until(lambda: _get(f"{base}/api/health"), 120, "the printed prefect server healthy", log, server)
        flow_run = _get(f"{base}/api/flow_runs/{flow_run_id}")
        assert flow_run is not None, tail(log)
        flow_run = flow_run.json()
        assert flow_run["id"] == flow_run_id and flow_run["state_type"] == "COMPLETED", flow_run
        task_runs = httpx.post(f"{base}/api/task_runs/filter", timeout=10,
                               json={"flow_runs": {"id": {"any_": [flow_run_id]}}}).json()
        names = {t["name"] for t in task_runs}
        assert {"nitro-round-0", "nitro-round-1"} <= names, names  # the run's rounds, as the UI lists them
        page = httpx.get(base + urlsplit(url).path, headers={"Accept": "text/html"}, timeout=10)
        assert page.status_code == 200 and "<html" in page.text.lower(), page.status_code  # the UI serves the page
    finally:
        kill_group(server)


def _get(url: str) -> httpx.Response | None:
    try:
        resp = httpx.get(url, timeout=5)
    except httpx.HTTPError:
        return None
    return resp if resp.status_code == 200 else None


def test_the_hint_names_a_database_only_where_the_home_does_not_imply_it(tmp_path: Path):
    from cli.session import default_database_url, serve_hint

    venv = tmp_path / "repo" / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "prefect").touch()
    home = tmp_path / "prefect home"
    hint = serve_hint(home, default_database_url(home), "127.0.0.1", 4200, venv / "python", tmp_path / "repo")
    assert hint.command == f"PREFECT_HOME='{home}' .venv/bin/prefect server start --port 4200"
    assert hint.ui_url == "http://127.0.0.1:4200"

    elsewhere = f"sqlite+aiosqlite:///{tmp_path}/other.db"
    hint = serve_hint(home, elsewhere, "0.0.0.0", 4300, venv / "python", tmp_path / "other-dir")
    assert hint.command == (f"PREFECT_HOME='{home}' PREFECT_SERVER_DATABASE_CONNECTION_URL={elsewhere} "
                            f"{venv / 'prefect'} server start --port 4300")
    assert hint.ui_url == "http://127.0.0.1:4300"  # a wildcard bind is reached on the loopback

    # PostgreSQL outlives the server; its settings (and password) stay where they were
    hint = serve_hint(home, "postgresql+asyncpg://u:secret@db/prefect", "127.0.0.1", 4200, venv / "python", tmp_path)
    assert "secret" not in hint.command and "DATABASE" not in hint.command
