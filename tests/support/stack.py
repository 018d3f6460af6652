"""One Prefect + MLflow stack for the tests that use Prefect as a user does (tests/test_prefect_server.py
and tests/test_ui.py): `prefect server` with its UI, `mlflow ui` over one store, the work pools and
deployments made by the README's own step-2 commands, and a process worker on `nitro-local` whose
flow runs take the faults planted in their home (tests/support/faults.py).

``SharedStack`` starts it for the first test module that asks and stops it once no later test of
the session needs it (tests/conftest.py runs those modules one after the other).
"""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support import faults
from tests.support.servers import REPO, deploy_leaves_no_trace, mlflow_ui, prefect_cli, prefect_server, prefect_worker
from tests.support.templates import mlflow_db


@dataclass
class Stack:
    prefect_ui: str
    api: str
    env: dict  # what a CLI call needs to talk to this server
    mlflow_ui: str
    tracking_uri: str  # the store that `mlflow ui` shows
    worker_log: Path
    tmp: Path

    def deployment(self, name: str) -> dict:
        resp = httpx.get(f"{self.api}/deployments/name/{name}", timeout=30)
        assert resp.status_code == 200, resp.text
        return resp.json()


def readme_setup_commands() -> list[list[str]]:
    """The README's step-2 `prefect work-pool create` and `prefect ... deploy` lines, as written."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Run it from Prefect"):]
    commands = []
    for line in section[: section.index("```", section.index("```bash") + 7)].splitlines():
        if not line.startswith("prefect "):
            continue
        words = shlex.split(line.split("#", 1)[0])
        if "work-pool" in words or "deploy" in words:
            commands.append([w for w in words[1:] if w != "--no-prompt"])
    assert any("deploy" in c for c in commands) and sum("work-pool" in c for c in commands) >= 2, commands
    return commands


@contextlib.contextmanager
def prefect_stack(tmp: Path) -> Iterator[Stack]:
    uri = f"sqlite:///{mlflow_db(tmp / 'mlflow' / 'mlflow.db')}"  # migrated before two processes share it
    with prefect_server(tmp, ui=True) as srv, mlflow_ui(tmp, uri) as mlflow_url:
        with deploy_leaves_no_trace():
            for command in readme_setup_commands():  # README step 2, exactly (issue 12, item 1)
                prefect_cli(srv.env, *command)
        log = tmp / "worker.log"
        with prefect_worker(faults.worker_env(dict(srv.env, MLFLOW_UI_URL=mlflow_url)), "nitro-local", log):
            yield Stack(srv.ui, srv.api, srv.env, mlflow_url, uri, log, tmp)


class SharedStack:
    """The session's stack: started by ``open`` (once), stopped by ``close``."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.stack: Stack | None = None
        self.started = 0
        self._exit = contextlib.ExitStack()

    def open(self) -> Stack:
        if self.stack is None:
            self.started += 1
            tmp = self.tmp / f"stack-{self.started}"
            tmp.mkdir()
            self.stack = self._exit.enter_context(prefect_stack(tmp))
        return self.stack

    def close(self) -> None:
        self.stack = None
        self._exit.close()
