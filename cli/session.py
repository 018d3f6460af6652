"""What surrounds one training run started from the command line (``nitro train`` / ``resume``).

* **Where the run is**, said at the start, before Prefect's slow start-up: the run id, where its
  state lives (checkpoints, config, log file, MLflow store) and the command that resumes it.
* **Its log file**, ``<home>/runs/<run id>/nitro.log``: every line the terminal shows plus Prefect's
  logs and the full traceback of a failure, which the terminal does not get.
* **Its own Prefect API.** With no ``PREFECT_API_URL`` configured, Prefect would start a temporary
  API server (a ``uvicorn`` child) that outlives a ``kill -9`` of this process and keeps using CPU.
  This starts that same server itself, as a child that the kernel stops when this process dies
  (``nitro.processes.die_with_parent``), and points the run at it.
* **One line on failure**: ``CommandFailed`` holds it, naming the component, its URL without a
  password and the exact resume command where the failure is one of infrastructure
  (``nitro.failures``); any other error is one line too, pointing at the log file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from nitro.checkpoint import run_dir
from nitro.config import NitroConfig
from nitro.failures import PrefectUnavailableError, describe_failure, one_line, resume_command
from nitro.processes import die_with_parent, on_main_thread

log = logging.getLogger("nitro")

LOG_FILE = "nitro.log"
# Prefect's console handler shows only what is critical: otherwise a failed task, its subflow and
# its flow each log the same traceback to the terminal (three times over). The run's log file and
# Prefect's own run logs (its API handler) still get everything.
CONSOLE_LEVEL_ENV = ("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "CRITICAL")


class CommandFailed(RuntimeError):
    """A command that failed; ``str()`` is the one line to print."""


def quiet_prefect_console() -> None:
    """Call before Prefect configures its logging (before it is imported)."""
    os.environ.setdefault(*CONSOLE_LEVEL_ENV)


def new_run_id() -> str:
    """A run id chosen before the flow starts, so it can be said (and resumed) from the start."""
    return f"run-{secrets.token_hex(6)}"


def announce(config: NitroConfig, run_id: str, resumed: bool, tracking_uri: str) -> None:
    where = run_dir(config.home, run_id)
    verb = "resuming" if resumed else "starting"
    print(f"nitro: {verb} run {run_id}", flush=True)
    print(f"  state:  {where} (checkpoints, config.yaml, {LOG_FILE})", flush=True)
    print(f"  MLflow: {tracking_uri}", flush=True)
    print(f"  resume: {resume_command(run_id, config.home)}", flush=True)


@contextlib.contextmanager
def run_log(config: NitroConfig, run_id: str) -> Iterator[Path]:
    """Everything logged while the run is open, also into the run's log file."""
    path = run_dir(config.home, run_id) / LOG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    loggers = [logging.getLogger(), logging.getLogger("nitro")]  # the CLI's "nitro" logger does not propagate
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield path
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
        handler.close()


@contextlib.contextmanager
def prefect_api() -> Iterator[str]:
    """The Prefect API this command talks to: the configured one, else a temporary server that
    dies with this process (see the module docstring)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    configured = PREFECT_API_URL.value()
    if configured:
        yield configured
        return
    server = _start_owned_server()
    try:
        with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
            try:
                yield server.api_url
            finally:
                _drain_prefect_workers()
    finally:
        server.stop()


def _drain_prefect_workers() -> None:
    """Send the run's last logs and events while the server is still there; otherwise Prefect
    tries at exit and prints its connection errors after our last line."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        try:
            worker.drain_all(timeout=5)
        except Exception as exc:
            log.debug("could not drain Prefect's %s: %s", worker.__name__, exc)


def _start_owned_server() -> Any:
    """Prefect's own temporary-server class, its ``uvicorn`` child started with ``die_with_parent``
    (from the main thread, where the kernel's parent-death signal is reliable)."""
    from prefect.server.api import server as prefect_server

    class OwnedServer(prefect_server.SubprocessASGIServer):
        def _run_uvicorn_command(self):  # type: ignore[override]
            real = prefect_server.subprocess
            shim = types.SimpleNamespace(**vars(real))
            shim.Popen = lambda *a, **kw: real.Popen(*a, preexec_fn=die_with_parent if on_main_thread() else None, **kw)
            prefect_server.subprocess = shim
            try:
                return super()._run_uvicorn_command()
            finally:
                prefect_server.subprocess = real

    server = OwnedServer()
    try:
        server.start()
    except Exception as exc:
        raise PrefectUnavailableError(f"the temporary Prefect API server did not start: {one_line(exc)}") from exc
    return server


def run_command(config: NitroConfig, run_id: str, fn: Callable[[], dict]) -> dict:
    """Run ``fn`` (the flow) with the run's log file and Prefect API; a failure becomes one
    ``CommandFailed`` line and its traceback goes to the log file."""
    from nitro.lease import LeaseLost, RunHeld
    from nitro.runtime import configured_redis_url
    from nitro.tracking import default_tracking_uri

    with run_log(config, run_id) as log_path:
        api = None
        try:
            with prefect_api() as api:
                return fn()
        except KeyboardInterrupt:
            raise
        except (RunHeld, LeaseLost) as exc:  # its line already says who holds the run and what to do
            raise CommandFailed(" ".join(str(exc).split())) from None
        except Exception as exc:
            logging.getLogger().error("run %s failed", run_id, exc_info=exc)  # to the log file, not the terminal
            urls = {"Redis": configured_redis_url(config),
                    "MLflow store": default_tracking_uri(config), "Prefect API": api}
            failure = describe_failure(exc, run_id, config.home, urls)
            if failure is not None:
                raise CommandFailed(f"{failure} (traceback: {log_path})") from None
            raise CommandFailed(f"{type(exc).__name__}: {one_line(exc)}; traceback: {log_path}; "
                                f"resume with: {resume_command(run_id, config.home)}") from None


def print_failure(exc: CommandFailed) -> int:
    print(f"nitro: error: {exc}", file=sys.stderr)
    return 1
