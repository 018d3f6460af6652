"""What surrounds one training run started from the command line (``nitro train`` / ``resume``).

* **Where the run is**, said at the start, before Prefect's slow start-up: the run id, where its
  state lives (checkpoints, config, log file, MLflow store) and the command that resumes it.
* **Its log file**, ``<home>/runs/<run id>/nitro.log``: every line the terminal shows plus Prefect's
  logs and the full traceback of a failure, which the terminal does not get.
* **Its own Prefect API.** With no ``PREFECT_API_URL`` configured, Prefect would start a temporary
  API server (a ``uvicorn`` child) that outlives a ``kill -9`` of this process and keeps using CPU.
  This starts that same server itself, as a child that the kernel stops when this process dies
  (``nitro.processes.die_with_parent``), and points the run at it. The run opens its Redis,
  actors, learner and MLflow store while the server starts (``prefect_api``'s ``meanwhile``),
  instead of after it. Its database (SQLite in the Prefect home) keeps the flow run after the
  server stops, so the run's links point at the UI of a ``prefect server start`` over that same
  home, and the command ends by printing how to start it (``serve_hint``); a link to the temporary
  server would be dead by then.
* **One line on failure**: ``CommandFailed`` holds it, naming the component, its URL without a
  password and the exact resume command where the failure is one of infrastructure
  (``nitro.run.failures``); any other error is one line too, pointing at the log file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nitro.cache import free_port
from nitro.config import NitroConfig
from nitro.processes import die_with_parent, on_main_thread
from nitro.run.failures import PrefectUnavailableError, describe_failure, one_line, resume_command
from nitro.run.rundir import LOG_FILE, RunDir

log = logging.getLogger("nitro")

# Prefect's console handler shows only what is critical: otherwise a failed task, its subflow and
# its flow each log the same traceback to the terminal (three times over). The run's log file and
# Prefect's own run logs (its API handler) still get everything.
CONSOLE_LEVEL_ENV = ("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "CRITICAL")


class CommandFailed(RuntimeError):
    """A command that failed; ``str()`` is the one line to print."""

    def __init__(self, line: str, exit_code: int = 1):
        super().__init__(line)
        self.exit_code = exit_code


class Stopped(KeyboardInterrupt):
    """SIGTERM or Ctrl-C: the run unwinds as Ctrl-C makes it (its lease released, its children
    stopped), keeping its last checkpoint."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def stop_on_signals() -> None:
    """SIGTERM and Ctrl-C raise ``Stopped`` in the main thread, where the run's context managers
    unwind; a second one ends the process at once (its children die with it, ``die_with_parent``).
    Prefect swaps in its own SIGTERM handler while a flow runs and re-sends the signal to this one
    when it has unwound the flow."""
    def handler(signum: int, frame: object) -> None:
        if _STOPPING:
            os.write(2, f"nitro: {signal.Signals(signum).name} again: stopping at once\n".encode())
            os._exit(128 + signum)
        _STOPPING.append(signum)
        raise Stopped(signum)

    if on_main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handler)


_STOPPING: list[int] = []  # the signals received so far


def quiet_prefect_console() -> None:
    """Call before Prefect configures its logging (before it is imported). An API that went away
    is reported once, by the run's one line; Prefect's background services (its event and log
    workers) would each print every item they could not send."""
    os.environ.setdefault(*CONSOLE_LEVEL_ENV)
    os.environ.setdefault("PREFECT_LOGGING_INTERNAL_LEVEL", "CRITICAL")
    logging.raiseExceptions = False  # the log worker's "--- Error logging to API ---" per batch


def new_run_id() -> str:
    """A run id chosen before the flow starts, so it can be said (and resumed) from the start."""
    return f"run-{secrets.token_hex(6)}"


def announce(config: NitroConfig, run_id: str, resumed: bool, tracking_uri: str) -> None:
    where = RunDir(config.home, run_id).path
    verb = "resuming" if resumed else "starting"
    print(f"nitro: {verb} run {run_id}", flush=True)
    print(f"  state:  {where} (checkpoints, config.yaml, {LOG_FILE})", flush=True)
    print(f"  MLflow: {tracking_uri}", flush=True)
    print(f"  resume: {resume_command(run_id, config.home)}", flush=True)


@contextlib.contextmanager
def run_log(config: NitroConfig, run_id: str) -> Iterator[Path]:
    """Everything logged while the run is open, also into the run's log file."""
    path = RunDir(config.home, run_id).log_file
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    nitro = logging.getLogger("nitro")  # the CLI's does not propagate to the root logger; a library caller's may
    loggers = [logging.getLogger()] + ([] if nitro.propagate else [nitro])
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield path
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
        handler.close()


@dataclass(frozen=True)
class PrefectApi:
    """The Prefect API a command's flow runs against."""

    url: str
    # With the command's own temporary server, the command that serves its database after the run
    # (the flow run's links point there); None for a configured server, which outlives the run.
    serve_command: str | None = None


@dataclass(frozen=True)
class ServeHint:
    command: str  # e.g. "PREFECT_HOME=/root/.prefect .venv/bin/prefect server start --port 4200"
    ui_url: str  # where that server's UI is, e.g. "http://127.0.0.1:4200"


def serve_hint(home: Path, database_url: str | None, host: str, port: int, executable: Path,
               cwd: Path) -> ServeHint:
    """The ``prefect server start`` that serves the database a temporary server used: its Prefect
    home always (the home also holds the profile whose settings the server read), a SQLite
    database only where it is not the home's default. Another database (PostgreSQL) outlives the
    server anyway and its settings, password included, come from where they came from before, so
    the command does not repeat them."""
    env = [f"PREFECT_HOME={shlex.quote(str(home.expanduser().resolve()))}"]  # from any directory
    if database_url and database_url.startswith("sqlite") and database_url != default_database_url(home):
        env.append(f"PREFECT_SERVER_DATABASE_CONNECTION_URL={shlex.quote(database_url)}")
    prefect = executable.parent / "prefect"
    if prefect.exists():
        argv = [str(prefect.relative_to(cwd)) if prefect.is_relative_to(cwd) else str(prefect)]
    else:
        argv = [str(executable), "-m", "prefect"]
    argv += ["server", "start", "--port", str(port)]
    ui_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host  # a wildcard bind is reached locally
    return ServeHint(" ".join([*env, shlex.join(argv)]), f"http://{ui_host}:{port}")


def default_database_url(home: Path) -> str:
    """Prefect's database when none is configured: SQLite in its home."""
    return f"sqlite+aiosqlite:///{home}/prefect.db"


@contextlib.contextmanager
def prefect_api(meanwhile: contextlib.AbstractContextManager[object] | None = None) -> Iterator[PrefectApi]:
    """The Prefect API this command talks to: the configured one, else a temporary server that
    dies with this process (see the module docstring), with the UI links of the flow run pointing
    at a later ``prefect server start`` over the same database. ``meanwhile`` (the run's own
    set-up, ``nitro.run.runtime.prepared_run``) is entered while that server starts and exited
    before it stops: the server's imports and database migrations take seconds of one core, and
    the run's Redis, actor processes, learner and MLflow store come up beside them."""
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL, get_current_settings, temporary_settings

    with contextlib.ExitStack() as stack:
        configured = PREFECT_API_URL.value()
        if configured:
            stack.enter_context(meanwhile or contextlib.nullcontext())
            yield PrefectApi(configured)
            return
        settings = get_current_settings()
        db = settings.server.database.connection_url
        # `prefect server start` binds to the configured host and port (127.0.0.1:4200 by default).
        hint = serve_hint(Path(settings.home), db.get_secret_value() if db else None, settings.server.api.host,
                          settings.server.api.port, Path(sys.executable), Path.cwd())
        server = TemporaryPrefectServer(Path(settings.home) / "temporary-server.log")
        stack.callback(server.stop)
        stack.enter_context(meanwhile or contextlib.nullcontext())
        server.wait_until_serving(settings.server.ephemeral.startup_timeout_seconds)
        stack.enter_context(temporary_settings(updates={PREFECT_API_URL: server.api_url, PREFECT_UI_URL: hint.ui_url}))
        stack.callback(_drain_prefect_workers)
        yield PrefectApi(server.api_url, hint.command)


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


def _last_error(log_path: Path) -> str:
    """The last exception line of a log (``SomeError: why``), else its last line."""
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception)\b.*:", line)]
    return (errors or lines or ["no output"])[-1]


def _port_taken(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


class TemporaryPrefectServer:
    """Prefect's temporary API server: the ``uvicorn`` child that Prefect's own
    ``SubprocessASGIServer`` runs, with its command and environment, started with
    ``die_with_parent`` from the main thread, where the kernel's parent-death signal is reliable.
    Prefect's class would import Prefect's whole server into this process first (2.6 s of this
    process's core, measured here) for a child that imports it anyway; this returns at once, and
    ``wait_until_serving`` waits for the child's health check as Prefect's ``start()`` does."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path  # the child's output: its errors, not the terminal's
        self.port = free_port()
        self.process = self._launch()

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def _launch(self) -> subprocess.Popen[bytes]:
        import prefect
        from prefect.settings import get_current_settings

        env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1",
               **get_current_settings().to_environment_variables(exclude_unset=True),
               CONSOLE_LEVEL_ENV[0]: "ERROR"}  # into its log file: why it failed, if it does
        argv = [sys.executable, "-m", "uvicorn", "--app-dir", str(Path(prefect.__file__).parent.parent),
                "--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(self.port),
                "--log-level", "error", "--lifespan", "on"]
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with self.log_path.open("ab") as output:
                return subprocess.Popen(argv, env=env, stdout=output, stderr=subprocess.STDOUT,
                                        preexec_fn=die_with_parent if on_main_thread() else None)
        except OSError as exc:
            raise PrefectUnavailableError(f"the temporary Prefect API server did not start: {one_line(exc)}") from exc

    def wait_until_serving(self, timeout_s: float) -> None:
        """Its health check every 0.1 s until it answers. A child that lost its port to another
        process starts again on a free one; one that failed otherwise (its database, say) is an
        error at once, where Prefect's ``start()`` would start it again until its timeout."""
        import httpx

        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5) as client:
            while time.monotonic() < deadline:
                code = self.process.poll()
                if code == 3 and _port_taken(self.port):  # uvicorn's exit code for any failed start
                    self.port = free_port()
                    self.process = self._launch()
                    continue
                if code is not None:
                    why = _last_error(self.log_path)
                    raise PrefectUnavailableError(f"the temporary Prefect API server exited with code {code} before "
                                                  f"it answered: {why} (its log: {self.log_path})")
                with contextlib.suppress(httpx.TransportError):
                    if client.get(f"{self.api_url}/health").status_code == 200:
                        return
                time.sleep(0.1)
        raise PrefectUnavailableError(f"the temporary Prefect API server did not answer within {timeout_s:.0f} s "
                                      "(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def run_command(config: NitroConfig, run_id: str, fn: Callable[[], Any]) -> tuple[Any, PrefectApi]:
    """Run ``fn`` (the flow) with the run's log file and Prefect API; returns its result and that
    API. A failure becomes one ``CommandFailed`` line and its traceback goes to the log file."""
    from nitro.cache.lease import LeaseLost, RunHeld
    from nitro.run.runtime import configured_redis_url, prepared_run
    from nitro.tracking.tracker import default_tracking_uri

    with run_log(config, run_id) as log_path:
        api = None
        try:
            with prefect_api(meanwhile=prepared_run(config, run_id)) as api:
                return fn(), api
        except (RunHeld, LeaseLost) as exc:  # its line already says who holds the run and what to do
            raise CommandFailed(" ".join(str(exc).split())) from None
        except Exception as exc:
            if _stopped_by_signal(exc):  # a flow wraps the signal's exception in its own
                raise _stopped(config, run_id, exc) from None
            logging.getLogger().error("run %s failed", run_id, exc_info=exc)  # to the log file, not the terminal
            urls = {"Redis": configured_redis_url(config), "MLflow store": default_tracking_uri(config),
                    "Prefect API": api.url if api is not None else None}
            failure = describe_failure(exc, run_id, config.home, urls)
            if failure is not None:
                raise CommandFailed(f"{failure} (traceback: {log_path})") from None
            raise CommandFailed(f"{type(exc).__name__}: {one_line(exc)}; traceback: {log_path}; "
                                f"resume with: {resume_command(run_id, config.home)}") from None
        except BaseException as exc:
            if not _stopped_by_signal(exc):
                raise
            raise _stopped(config, run_id, exc) from None


def _stopped(config: NitroConfig, run_id: str, exc: BaseException) -> CommandFailed:
    """The one line of a run that a signal stopped (its traceback to the log file)."""
    signum = _STOPPING[0] if _STOPPING else _signal_of(exc)
    name = signal.Signals(signum).name
    logging.getLogger().info("run %s stopped by %s", run_id, name, exc_info=exc)
    return CommandFailed(f"stopped by {name}; the run keeps its last checkpoint. "
                         f"Resume with: {resume_command(run_id, config.home)}", 128 + signum)


def _signal_of(exc: BaseException) -> int:
    """The signal a Prefect ``TerminationSignal`` in the chain carries; SIGINT for Ctrl-C."""
    seen: BaseException | None = exc
    while seen is not None:
        carried = getattr(seen, "signal", None)
        if isinstance(carried, int):
            return int(carried)
        seen = seen.__cause__ or seen.__context__
    return signal.SIGINT


def _stopped_by_signal(exc: BaseException) -> bool:
    """A signal's unwinding: ``Stopped``, Ctrl-C, or Prefect's ``TerminationSignal`` (raised
    while a flow runs), anywhere in the exception's chain."""
    from prefect.exceptions import TerminationSignal

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (KeyboardInterrupt, TerminationSignal)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def print_failure(exc: CommandFailed) -> int:
    print(f"nitro: error: {exc}", file=sys.stderr)
    return exc.exit_code
