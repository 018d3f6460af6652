"""``nitro``: the command line.

    nitro train [-c config.yaml] [key=value ...] [--run-id ID]   train (a Prefect flow run)
    nitro resume RUN_ID [--home DIR]                             continue a failed run
    nitro runs [--home DIR]                                      the runs under a home, with resume commands
    nitro status RUN_ID [--home DIR]                             one run: rounds, checkpoints, disk use
    nitro verify RUN_ID [--home DIR]                             check a run's checkpoints, resume nothing
    nitro compare [--experiment NAME] [--tag key=value ...]      table of runs from MLflow
    nitro experiment SPEC [key=value ...]                        a matrix of runs and its report
    nitro experiment report DIR                                  rebuild a report's statistics from its files
    nitro probe SPEC [key=value ...]                             does R predict when boosting pays?
    nitro config [-c config.yaml] [key=value ...]                print the validated config
    nitro profile-actor [-c config.yaml] --memory 512,1024,...   pick the cheapest actor memory
    nitro deploy-lambda [...]                                    create/update the Lambda actor

Runs go through Prefect: with no ``PREFECT_API_URL`` set, the command starts a temporary local API
server on SQLite for its own duration, which dies with it (``cli/session.py``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cli.session import PrefectApi
    from nitro.run.result import RunResult


def _prefect_defaults() -> None:
    from flows.settings import apply_prefect_defaults

    apply_prefect_defaults()


_CONSOLE = None  # rich's Console on stderr, shared by the log handler and the progress bar (a TTY only)


def _setup_logging() -> None:
    global _CONSOLE
    if sys.stderr.isatty():
        # In a terminal, log lines go through the progress bar's console: rich prints them above the
        # live bar instead of gluing them to it or leaving stale bars behind.
        from rich.console import Console
        from rich.logging import RichHandler

        _CONSOLE = Console(stderr=True)
        handler: logging.Handler = RichHandler(console=_CONSOLE, show_level=False, show_path=False,
                                               log_time_format="%H:%M:%S", markup=False)
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    logger = logging.getLogger("nitro")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _run_flow(config_path: str | None, overrides: list[str], run_id: str | None) -> tuple[RunResult, PrefectApi]:
    import asyncio

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from cli.session import announce, new_run_id, run_command
    from flows.training import train
    from nitro.config import NitroConfig
    from nitro.run.rundir import RunDir
    from nitro.run.runtime import ROUND_OBSERVERS
    from nitro.tracking.tracker import default_tracking_uri

    config = NitroConfig.from_yaml(config_path, overrides)  # fail fast, before Prefect starts
    run_id = run_id or new_run_id()
    announce(config, run_id, RunDir(config.home, run_id).latest_round() is not None, default_tracking_uri(config))
    with Progress(TextColumn("[bold]nitro[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("rounds done"),
                  TimeElapsedColumn(), console=_CONSOLE, transient=True, disable=_CONSOLE is None) as progress:
        bar = progress.add_task("rounds", total=config.rounds)
        ROUND_OBSERVERS.append(lambda _run, report: progress.update(bar, completed=report.round + 1))
        return run_command(config, run_id, lambda: asyncio.run(
            train(config_path=config_path or "", overrides=overrides, run_id=run_id)))


def cmd_train(args: argparse.Namespace) -> int:
    _print_result(*_run_flow(args.config, args.overrides, args.run_id))
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    from nitro.run.rundir import RunDir
    from nitro.run.runtime import load_run_config

    load_run_config(args.home, args.run_id)  # unknown run id: clear error
    path = RunDir(args.home, args.run_id).config_file
    _print_result(*_run_flow(str(path), [f"home={args.home}"], args.run_id))
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    from nitro.run.runs import format_runs, list_runs

    print(format_runs(list_runs(args.home)))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from nitro.run.runs import run_status

    print(run_status(args.home, args.run_id))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from nitro.run.runs import verify_run

    lines, whole = verify_run(args.home, args.run_id)
    print("\n".join(lines))
    return 0 if whole else 1


def cmd_compare(args: argparse.Namespace) -> int:
    from nitro.tracking.compare import compare_runs, format_table
    from nitro.tracking.tracker import TrackingError, default_tracking_uri

    tags = dict(t.split("=", 1) for t in args.tag if "=" in t)
    bad = [t for t in args.tag if "=" not in t]
    if bad:
        raise TrackingError(f"--tag wants key=value, got {bad[0]!r}")
    rows = compare_runs(args.tracking_uri or default_tracking_uri(), args.experiment, tags)
    print(format_table(rows))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from nitro.config import NitroConfig

    print(NitroConfig.from_yaml(args.config, args.overrides).dump_yaml(), end="")
    return 0


def cmd_profile_actor(args: argparse.Namespace) -> int:
    """Invoke the actor at several memory sizes (paper §7) and recommend the cheapest that is
    not slower. Lambda: one alias per size, ``mem<N>`` (``nitro deploy-lambda --profile-memory``)."""
    from nitro.actors.profile import profile_actor
    from nitro.config import NitroConfig
    from nitro.run.engine import Decision
    from nitro.run.runtime import make_backend, open_run

    config = NitroConfig.from_yaml(args.config, args.overrides)
    sizes = [int(m) for m in args.memory.split(",")]

    def factory(memory_mb: int):
        cfg = config.model_copy(deep=True)
        cfg.backend.memory_mb = memory_mb
        if cfg.backend.kind == "lambda":
            cfg.backend.lambda_.qualifier = f"mem{memory_mb}"
        else:
            cfg.backend.workers = 1
        return make_backend(cfg)

    with open_run(config.model_copy(update={"backend": config.backend.model_copy(update={"workers": 1})}),
                  "profile-actor") as ctx:
        training = ctx.training
        decision = Decision(n_actors=1, wanted=1, reason="profile-actor")
        template = training.plan_invocations(0, decision, training.publish_weights(0))[0]
        report = profile_actor(factory, sizes, template, repeats=args.repeats)
    print(report.table())
    return 0


def _print_result(result: RunResult, api: PrefectApi) -> None:
    ret, at = result.final_eval_return, result.final_eval_round
    score = "not evaluated" if ret is None else f"{ret:.1f} (evaluation in round {at}: whole episodes, mean action)"
    print(f"run {result.run_id}: {result.rounds_done} rounds, stopped by {result.stop_reason}, "
          f"final return {score}, spend ${result.spend_usd:.4f}")
    print(f"  MLflow:  {result.mlflow_url or result.mlflow_run_id}")
    if result.prefect_url and api.serve_command:
        # the run's own API server stopped with it; its database still holds the flow run
        print(f"  Prefect: {result.prefect_url} once this serves the run's Prefect database:")
        print(f"    {api.serve_command}")
    elif result.prefect_url:
        print(f"  Prefect: {result.prefect_url}")
    print(f"  checkpoints: {result.checkpoints}")


def _cmd_experiment(args: argparse.Namespace) -> int:
    from cli.experiment import cmd_experiment

    return cmd_experiment(args)


def _cmd_probe(args: argparse.Namespace) -> int:
    from cli.probe import cmd_probe

    return cmd_probe(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nitro", description="Distributed RL with serverless actors and boosting.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train an agent (one Prefect flow run)")
    p.add_argument("-c", "--config", help="YAML config file")
    p.add_argument("--run-id", help="name the run (default: run-<12 random hex digits>, printed at the start)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. rounds=5 ppo.lr=1e-4 scaler.name=fixed")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("resume", help="continue a run from its last completed round")
    p.add_argument("run_id")
    p.add_argument("--home", default=".nitro", type=Path, help="the run's home directory (config `home`)")
    p.set_defaults(func=cmd_resume)

    p = sub.add_parser("runs", help="list the runs under a home: status, rounds, return, spend, resume command")
    p.add_argument("--home", default=".nitro", type=Path, help="the runs' home directory (config `home`)")
    p.set_defaults(func=cmd_runs)

    p = sub.add_parser("status", help="one run: its rounds, its checkpoints, its disk use and retention")
    p.add_argument("run_id")
    p.add_argument("--home", default=".nitro", type=Path, help="the run's home directory (config `home`)")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("verify", help="check a run's checkpoints against their digests, without resuming it")
    p.add_argument("run_id")
    p.add_argument("--home", default=".nitro", type=Path, help="the run's home directory (config `home`)")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("compare", help="table of runs from MLflow",
                       description="One row per Nitro run in MLflow: env, algo, scaler, seed, rounds done, "
                                   "final evaluation return, spend, status.")
    p.add_argument("--experiment", default=None, metavar="NAME",
                   help="only this MLflow experiment (config tracking.experiment; default: all experiments)")
    p.add_argument("--tag", action="append", default=[], metavar="key=value",
                   help="only runs with this tag value, e.g. scaler=nitro or env=Hopper-v5; "
                        "repeat to AND several (params.x=... filters on a param)")
    p.add_argument("--tracking-uri", default=None, metavar="URI",
                   help="MLflow store (default: $MLFLOW_TRACKING_URI, else sqlite:///.nitro/mlflow.db)")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("experiment", help="run an experiment spec (matrix of training runs) and write its report",
                       epilog="nitro experiment report DIR [--reps N]: rewrite a finished report's rliable "
                              "statistics from its committed files alone (see nitro experiment report --help)")
    p.add_argument("spec", help="experiment spec YAML (see examples/study_hopper.yaml)")
    p.add_argument("--sensitivity", action="store_true", help="also run the spec's sensitivity sweep (paper 8.4)")
    p.add_argument("--report-dir", default=None, help="default: the spec's report_dir, else docs/results/<name>")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first failing cell")
    p.add_argument("--only", action="append", default=[], metavar="FIELD=V1,V2",
                   help="run only the cells with these values of env, algo, scaler or seed (repeatable); "
                        "the report still covers the whole spec")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every cell, e.g. home=/data")
    p.set_defaults(func=_cmd_experiment)

    p = sub.add_parser("probe",
                       help="fork a run at chosen rounds into plain and boosted arms: does R predict the gain?")
    p.add_argument("spec", help="probe spec YAML (see examples/probe_hopper.yaml)")
    p.add_argument("--report-dir", default=None, help="default: the spec's report_dir, else docs/results/<name>")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every run, e.g. home=/data")
    p.set_defaults(func=_cmd_probe)

    p = sub.add_parser("config", help="print the validated config")
    p.add_argument("-c", "--config")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("profile-actor", help="profile the actor at several memory sizes")
    p.add_argument("-c", "--config")
    p.add_argument("--memory", default="512,1024,1769,2048,3008", help="comma-separated MB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(func=cmd_profile_actor)

    from cli.minionsrl import add_parser as add_minionsrl

    add_minionsrl(sub)

    sub.add_parser("deploy-lambda", help="create or update the Lambda actor (see docs/deploy-aws.md)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    from cli.session import CommandFailed, Stopped, print_failure, quiet_prefect_console, stop_on_signals

    quiet_prefect_console()
    _prefect_defaults()
    _setup_logging()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["deploy-lambda"]:  # its own parser and --help
        from deployments.deploy_lambda import main as deploy_main

        return deploy_main(argv[1:])
    if argv[:2] == ["experiment", "report"]:  # ``experiment``'s own positional is a spec, so not a subparser
        from cli.experiment import report_parser

        args = report_parser().parse_args(argv[2:])
    else:
        args = build_parser().parse_args(argv)
    from nitro.cache import CacheError
    from nitro.config import ConfigError
    from nitro.run.rundir import CheckpointError
    from nitro.tracking.store import TrackingError

    stop_on_signals()
    try:
        return args.func(args)
    except (ConfigError, CheckpointError, CacheError, TrackingError) as exc:
        print(f"nitro: error: {exc}", file=sys.stderr)
        return 2
    except CommandFailed as exc:
        return print_failure(exc)
    except KeyboardInterrupt as exc:  # outside a run (a run says which one and how to resume it)
        print(f"nitro: stopped by {exc}" if isinstance(exc, Stopped) else "nitro: interrupted", file=sys.stderr)
        return 130


# How long the process may take to end once the command is done: Prefect's log and event workers
# send what they hold to the API at interpreter exit and wait for it without a deadline, which an
# API that went away turns into minutes of client retries.
EXIT_DEADLINE_S = 30.0


def run() -> None:
    """The ``nitro`` console script. A run stopped by a signal may leave a worker thread blocked
    in a wait it cannot be woken from (a socket read): once the run has unwound (its lease released,
    its children stopped), the process ends without waiting for such threads. Otherwise it ends as
    Python does, with a deadline (``EXIT_DEADLINE_S``)."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    if code >= 128:
        logging.shutdown()
        os._exit(code)

    def exit_now() -> None:
        os.write(2, f"nitro: Prefect's log and event workers did not finish sending within {EXIT_DEADLINE_S:.0f} s "
                    f"(is its API gone?); exiting without them\n".encode())
        os._exit(code)

    deadline = threading.Timer(EXIT_DEADLINE_S, exit_now)
    deadline.daemon = True
    deadline.start()
    sys.exit(code)


if __name__ == "__main__":
    run()
