"""``nitro minionsrl pretrain``: pre-train MinionsRL's scheduler on the simulator and save it
(``nitro.scaling.minionsrl.pretrain``); the file is what ``scaler.minionsrl.path`` deploys. The Prefect
deployment ``minionsrl-pretrain`` (``flows/minionsrl.py``) does the same from the UI."""

from __future__ import annotations

import argparse


def cmd_minionsrl_pretrain(args: argparse.Namespace) -> int:
    from nitro.scaling.minionsrl.pretrain import fitted_pretrain_config, pretrain, pretrain_config, save_scheduler

    fit_from = getattr(args, "fit_from", "") or ""
    if fit_from:
        cfg, report = fitted_pretrain_config(args.overrides, fit_from)
        print(f"simulator {report.summary()} ({fit_from})", flush=True)
    else:
        cfg = pretrain_config(args.overrides)
    scheduler, _ = pretrain(cfg, log_every=max(1, cfg.episodes // 10))
    path = save_scheduler(args.out, scheduler)
    r = scheduler.record
    print(f"saved {path}: {r.episodes} episodes, {r.env_steps} simulated env steps, "
          f"${r.usd:.4f} on the projected clock (the simulated runs' cost)")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("minionsrl", help="MinionsRL's learned scheduler (a baseline): pre-train it")
    msub = p.add_subparsers(dest="minionsrl_command", required=True)
    q = msub.add_parser("pretrain", help="train the scheduler on the training simulator and save it (safetensors)")
    q.add_argument("--out", default=".nitro/scaling/minionsrl.safetensors", help="where to save the scheduler")
    q.add_argument("--fit-from", default="", metavar="PATH",
                   help="fit the simulator's gain curve, noise and learner times to an experiment report's "
                        "rounds.csv first (key=value overrides still win)")
    q.add_argument("overrides", nargs="*", metavar="key=value",
                   help="PretrainConfig fields, e.g. episodes=100 normalize_state=true simulator.rounds=50")
    q.set_defaults(func=cmd_minionsrl_pretrain)
