"""A run that dies of its infrastructure says so in one line.

When Redis goes away, the MLflow store fails, the Prefect API cannot be reached or the actor
backend cannot start, the user needs three things: which component failed, where it is (its URL
without a password) and the exact command that continues the run. ``RunFailed`` carries exactly
that line; the traceback goes to the run's log file and to Prefect's logs, not to the terminal.
``describe_failure`` recognises an infrastructure failure by the library its exception comes from
(anywhere in its chain of causes), so a new error type of a known component needs no new code.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from nitro.cache.urls import CacheError, redact_url

DEFAULT_HOME = Path(".nitro")

# The library (or class) an exception comes from -> the component it means (first match wins).
_COMPONENT_BY_MODULE = (
    ("redis", "Redis"),
    ("nitro.cache", "Redis"),
    ("mlflow", "MLflow store"),
    ("sqlalchemy", "MLflow store"),
    ("httpx", "Prefect API"),
    ("httpcore", "Prefect API"),
    ("prefect.exceptions.PrefectHTTPStatusError", "Prefect API"),
    ("botocore", "actor backend"),
    ("nitro.run.rundir.CheckpointWriteError", "run folder"),
)


class RunFailed(RuntimeError):
    """A run ended by a failed component: ``str()`` is the one line to show."""

    def __init__(self, component: str, where: str | None, reason: str, run_id: str, home: str | Path):
        self.component, self.run_id = component, run_id
        at = f" at {where}" if where else ""
        super().__init__(f"{component}{at} failed: {reason}; the run stopped after its last checkpoint. "
                         f"Resume with: {resume_command(run_id, home)}")


class PrefectUnavailableError(RuntimeError):
    """The Prefect API could not be started or reached."""


def resume_command(run_id: str, home: str | Path) -> str:
    """The exact command that continues ``run_id`` (``--home`` only when it is not the default)."""
    cmd = f"nitro resume {run_id}"
    return cmd if Path(home) == DEFAULT_HOME else f"{cmd} --home {home}"


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return (text or type(exc).__name__)[:300]


def component_of(exc: BaseException) -> str | None:
    """The infrastructure component an exception (or one of its causes) comes from; None if it
    is not an infrastructure failure (a bug, a bad batch: those keep their own message)."""
    return next((c for c in map(_component, _chain(exc)) if c is not None), None)


def describe_failure(exc: BaseException, run_id: str, home: str | Path,
                     urls: Mapping[str, str | None]) -> RunFailed | None:
    """``exc`` as a ``RunFailed`` when it is an infrastructure failure, else None. ``urls``: the
    run's component -> URL (redacted here, whatever it holds)."""
    if isinstance(exc, RunFailed):
        return exc
    component = component_of(exc)
    if component is None:
        return None
    root = next(e for e in _chain(exc) if _component(e) == component)
    url = urls.get(component)
    return RunFailed(component, redact_url(url) if url else None, one_line(root), run_id, home)


def _component(e: BaseException) -> str | None:
    """The component of this one exception, not of its causes."""
    if isinstance(e, RunFailed):
        return e.component
    if isinstance(e, CacheError):
        return "Redis"
    if isinstance(e, PrefectUnavailableError):
        return "Prefect API"
    name = f"{type(e).__module__}.{type(e).__qualname__}"
    return next((c for prefix, c in _COMPONENT_BY_MODULE if name.startswith(prefix + ".") or name == prefix), None)


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out
