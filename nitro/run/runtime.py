"""The resources one training run owns while it runs, opened once and closed on exit.

``open_run`` starts (or connects to) Redis, starts the actor backend (warm local workers, the
shared Lambda client, or a connection to Ray), builds the ``TrainingRun`` and restores its latest
checkpoint. Prefect tasks find these resources by run id with ``get_run``: a Redis client, a process pool or an MLflow
client cannot travel as a task parameter. What a round computes does travel as parameters, from
task to task (see ``flows/round.py``); the registry holds no per-round state.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nitro.actors.backend import ActorBackend
from nitro.cache import CacheError, TrajectoryCache, connect_redis, redact_url, strip_password
from nitro.cache.home_server import HomeRedis
from nitro.cache.lease import RunLease, acquire_lease
from nitro.config import NitroConfig
from nitro.run.crashes import crash_point
from nitro.run.engine import APPEND_ONLY, TrainingRun
from nitro.run.failures import RunFailed, one_line, resume_command
from nitro.run.interrupted import bill_interrupted_round
from nitro.run.rundir import RunDir

if TYPE_CHECKING:
    from nitro.tracking.tracker import RunTracker

log = logging.getLogger("nitro")


@dataclass
class RunContext:
    """The live resources of one open training run."""

    config: NitroConfig
    run_id: str
    training: TrainingRun
    backend: ActorBackend
    cache: TrajectoryCache
    redis_url: str
    lease: RunLease
    resumed_from: int | None = None
    tracker: RunTracker | None = None  # set when the pipeline attaches MLflow
    store: RunTracker | None = None  # the MLflow store opened by prepared_run, for attach_mlflow to use
    mlflow_run_id: str | None = None
    mlflow_tags: dict[str, str] = field(default_factory=dict)  # MLflow tags not yet logged
    mlflow_queued: bool = False  # a catch-up of the MLflow records waits in the background lane
    mlflow_down: str | None = None  # why the MLflow store did not answer, while it does not


_RUNS: dict[str, RunContext] = {}
_PREPARED: dict[str, RunContext] = {}  # runs opened before their flow (prepared_run)
_LOCK = threading.Lock()


def get_run(run_id: str) -> RunContext:
    try:
        return _RUNS[run_id]
    except KeyError:
        raise RuntimeError(f"training run {run_id!r} is not open in this process") from None


def make_backend(config: NitroConfig) -> ActorBackend:
    from nitro.actors.local import LocalActorPool
    from nitro.actors.preload import warm_modules_for

    b = config.backend
    if b.kind == "lambda":
        from nitro.actors.lambda_ import LambdaActorBackend

        return LambdaActorBackend(b.lambda_, memory_mb=b.memory_mb, timeout_s=b.timeout_s)
    if b.kind == "ray":
        from nitro.actors.ray_ import RayActorBackend

        return RayActorBackend(b.ray, cpus=b.workers or os.cpu_count() or 1, timeout_s=b.timeout_s,
                               memory_mb=b.memory_mb, preload=warm_modules_for(config))
    return LocalActorPool(workers=b.workers or os.cpu_count() or 1, timeout_s=b.timeout_s, memory_mb=b.memory_mb,
                          preload=warm_modules_for(config))


def _start_backend(config: NitroConfig, run_id: str) -> ActorBackend:
    try:
        return make_backend(config)
    except Exception as exc:
        raise RunFailed("actor backend", config.backend.kind, one_line(exc), run_id, config.home) from exc


def load_run_config(home: str | Path, run_id: str) -> NitroConfig:
    """The config a run was started with; CheckpointError naming the known runs for an unknown one."""
    return NitroConfig.from_yaml(RunDir(home, run_id).require_config())


def actor_cache_access(config: NitroConfig, learner_url: str, password: str | None) -> tuple[str, dict[str, str]]:
    """The Redis URL and credentials reference actors get. Lambda actors connect as their own ACL
    user with its password in Secrets Manager where configured; never a password in an event."""
    lam = config.backend.lambda_
    if config.backend.kind == "lambda" and lam.actor_cache_url:
        creds = {"secret_arn": lam.redis_secret_arn} if lam.redis_secret_arn else {}
        return strip_password(lam.actor_cache_url), creds
    return strip_password(learner_url), ({"env": config.redis.password_env} if password else {})


def configured_redis_url(config: NitroConfig) -> str | None:
    """The Redis a run was told to use (``redis.url``, else ``NITRO_REDIS_URL``); None: a local one."""
    return config.redis.url or os.environ.get("NITRO_REDIS_URL")


@contextlib.contextmanager
def run_redis(config: NitroConfig, *, share_now: bool = True) -> Iterator[tuple[Any, str]]:
    """A client of the run's Redis and its URL, for as long as the context lasts: the configured
    one (``redis.url``, else ``NITRO_REDIS_URL``), or the home's local server on ``<home>/redis``
    (``nitro.cache.home_server``: one per home, which reloads what earlier runs left there).
    ``share_now=False``: other processes find a local server this one started only once
    ``share_home_redis`` is called (``open_run`` does, holding its run's lease). Raises CacheError."""
    with contextlib.ExitStack() as stack:
        url = configured_redis_url(config)
        if url is None:
            home_redis = stack.enter_context(HomeRedis(Path(config.home) / "redis"))
            url = home_redis.url
            log.info("%s a local Redis at %s", "started" if home_redis.owner else "found", url)
            if share_now:
                home_redis.share()
            _HOME_REDIS[url] = home_redis
            stack.callback(_HOME_REDIS.pop, url, None)
        client = connect_redis(url, password=os.environ.get(config.redis.password_env) or None,
                               timeout_s=config.redis.connect_timeout_s)
        stack.callback(client.close)
        yield client, url


_HOME_REDIS: dict[str, HomeRedis] = {}


def share_home_redis(url: str) -> None:
    """Let other processes use the local server at ``url`` if this process started it."""
    if url in _HOME_REDIS:
        _HOME_REDIS[url].share()


@contextlib.contextmanager
def open_run(config: NitroConfig, run_id: str) -> Iterator[RunContext]:
    """Open everything a run needs; restore its latest checkpoint if there is one, and bill the
    invocations of a round that died in flight. Every process it starts (the local Redis, the
    actor workers) is stopped on exit and dies with this process if it is killed. A component
    that fails to come up raises ``RunFailed`` (one line, with the resume command). A run that
    ``prepared_run`` opened is yielded as it is, and stays open for it to close."""
    with _LOCK:
        prepared = _PREPARED.get(run_id)
    if prepared is not None:
        if prepared.config != config:
            raise RuntimeError(f"run {run_id} was opened before its flow with another config than the flow's")
        yield prepared
        return
    stack = contextlib.ExitStack()
    with stack:
        run_dir = RunDir(config.home, run_id)
        run_dir.save_config(config.dump_yaml())  # first: whatever fails below, `nitro resume` can start again
        try:
            client, url = stack.enter_context(run_redis(config, share_now=False))
        except CacheError as exc:
            given = configured_redis_url(config)
            raise RunFailed("Redis", redact_url(given) if given else "(local server)", one_line(exc), run_id,
                            config.home) from exc
        # One writer per run (nitro/cache/lease.py): taken before anything of the run is read or written.
        hint = f" with `{resume_command(run_id, config.home)}`"
        lease = acquire_lease(client, run_id, config.redis.lease_ttl_s, floor=run_dir.fence_token(),
                              home_hint=hint)
        stack.callback(lease.release)
        lease.start_renewing()
        share_home_redis(url)
        cache = TrajectoryCache(client, run_id, ttl_s=config.redis.ttl_s)
        actor_url, creds = actor_cache_access(config, url, os.environ.get(config.redis.password_env) or None)
        training = TrainingRun(config, run_id, cache, actor_cache_url=actor_url, actor_credentials=creds)
        loaded = run_dir.load_newest_good()  # a damaged newest checkpoint is set aside, with one line
        resumed = loaded[0] if loaded is not None else None
        if loaded is not None:
            training.load_state_dict(loaded[1])
            log.info("run %s: resuming after round %d", run_id, resumed)  # rounds count from 0
        billed = bill_interrupted_round(run_dir, training.next_round, cache, training.ledger)
        if billed and resumed is not None:  # billed once, even if it dies again
            checkpoint_run(run_dir, resumed, training, lease)
        backend = _start_backend(config, run_id)
        stack.callback(backend.close)
        ctx = RunContext(config, run_id, training, backend, cache, url, lease, resumed)
        with _LOCK:
            _RUNS[run_id] = ctx
        stack.callback(lambda: _RUNS.pop(run_id, None))
        yield ctx


@contextlib.contextmanager
def prepared_run(config: NitroConfig, run_id: str) -> Iterator[RunContext]:
    """The run opened before its flow starts, with its MLflow store: the flow's ``open_run``
    yields this one. ``nitro train`` opens its run while Prefect's temporary API server starts
    (``cli/session.py``), so that what the run needs comes up beside the server instead of after it."""
    from nitro.tracking.tracker import RunTracker, default_tracking_uri

    with open_run(config, run_id) as ctx:
        ctx.store = RunTracker(config.tracking.mlflow_uri or default_tracking_uri(config), config.tracking.experiment)
        with _LOCK:
            _PREPARED[run_id] = ctx
        try:
            yield ctx
        finally:
            with _LOCK:
                _PREPARED.pop(run_id, None)


def checkpoint_run(run_dir: RunDir, round_idx: int, training: TrainingRun, lease: RunLease) -> Path:
    """The round's checkpoint (the ledger in it), written only while ``lease`` holds the run; once
    it is on disk, what no resume needs any more goes: the checkpoints retention does not keep
    (``checkpoint.keep_last`` / ``keep_best``) and the cache keys (batches, weights, episode
    snapshots) of the round two before. A resume from this checkpoint needs this round's keys, and
    one that falls back to the checkpoint before (this one damaged) needs the round before's."""
    lease.check()
    history = training.history[-1] if training.history and int(training.history[-1]["round"]) == round_idx else {}
    path = run_dir.save(round_idx, training.state_dict(), lease.token, eval_return=history.get("eval_return_mean"),
                        append_only=APPEND_ONLY)
    crash_point("after-checkpoint", round_idx)
    keep = training.config.checkpoint
    run_dir.prune(keep.keep_last, keep.keep_best)
    if round_idx >= 2:
        training.cache.delete_round(round_idx - 2)
    return path


# Observers of finished rounds, e.g. the CLI's progress bar. Called in the flow's process.
ROUND_OBSERVERS: list = []


def notify_round(run_id: str, report) -> None:
    for observer in list(ROUND_OBSERVERS):
        try:
            observer(run_id, report)
        except Exception:  # an observer must never break a round
            log.debug("round observer failed", exc_info=True)
