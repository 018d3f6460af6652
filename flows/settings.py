"""The Prefect (and MLflow client) settings every Nitro entry point runs under (the CLI, the
benchmarks), as environment defaults: a value the user set wins."""

from __future__ import annotations

import os


def apply_prefect_defaults() -> None:
    # The ephemeral API server takes 15-20 s to start on a small machine.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # One line per round from Nitro; Prefect's per-task state lines stay in the UI.
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("MUJOCO_GL", "disable")
    # A request the API refuses is retried after 2, 4 and 8 s, not Prefect's 2 to 32 s five times
    # over: the 503 a busy SQLite server gives clears in the first wait (bench/orchestration_overhead.py)
    # and within 14 s on a machine loaded to 7x its cores (seen here), and a run whose API went away
    # stops within a round instead of after minutes of back-off per request.
    os.environ.setdefault("PREFECT_CLIENT_MAX_RETRIES", "3")
    # The same for an MLflow tracking server: MLflow's client retries a request 7 times over about
    # 4 minutes (and waits 120 s for an answer); a run whose store went away goes on and logs its
    # rounds when the store answers again (tasks/bookkeeping.py), so a request gives up in seconds.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
    # The server records task runs one per SQLite transaction by default; each round's subflow
    # start then waits ~2 s behind the last round's writes. Batched, it waits ~0.2 s
    # (bench/orchestration_overhead.py).
    os.environ.setdefault("PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE", "100")
    os.environ.setdefault("PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_READ_BATCH_SIZE", "100")
    # The same for the events behind those task runs (3 per task run): by default the event
    # persister writes them 20 at a time, one message at a time, and holds SQLite's write lock so
    # long that the next round's subflow waits up to 2 s to create its task run
    # (bench/orchestration_overhead.py).
    os.environ.setdefault("PREFECT_SERVER_SERVICES_EVENT_PERSISTER_BATCH_SIZE", "200")
    os.environ.setdefault("PREFECT_SERVER_SERVICES_EVENT_PERSISTER_READ_BATCH_SIZE", "100")
    # The temporary server that `nitro train` starts (no PREFECT_API_URL) has no UI and ends with the
    # process, so nothing reads the events it would store while it runs (the `prefect server start`
    # that `nitro train` prints for afterwards shows the flow run and its task runs, not events);
    # task runs are recorded from the event stream without them. Storing them costs every seventh
    # round or so a 503 and the client's 2 s back-off: the server creates the round subflow's task run
    # in a transaction that reads before it writes, and SQLite refuses that write outright ("database
    # is locked", whatever busy_timeout says) when the persister commits in between. 60 rounds of 8
    # actors, side by side: 0 stalls and a 1.28 s mean round against 6 stalls and 1.45 s with events
    # stored (bench/results/orchestration_events_{off,stored}.json; docs/decisions.md, "Prefect").
    # This setting only reaches a server this process starts; `prefect server start` keeps its own.
    os.environ.setdefault("PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED", "false")
