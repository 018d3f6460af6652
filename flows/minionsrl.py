"""MinionsRL's scheduler pre-training as a Prefect flow, for the deployment ``minionsrl-pretrain``:
schedule it from the UI, see its record in the flow run's Artifacts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from nitro.scaling.minionsrl.pretrain import fitted_pretrain_config, pretrain, pretrain_config, save_scheduler


@task(name="pretrain-scheduler", cache_policy=NO_CACHE)
def pretrain_scheduler(overrides: Sequence[str], out: str, fit_from: str = "") -> dict:
    """Train the scheduler on the simulator (fitted from ``fit_from`` first when given), save it;
    returns the file and its pre-training record."""
    if fit_from:
        cfg, report = fitted_pretrain_config(list(overrides), fit_from)
        print(f"simulator {report.summary()} ({fit_from})")
    else:
        cfg = pretrain_config(list(overrides))
    scheduler, _ = pretrain(cfg, log_every=max(1, cfg.episodes // 10))
    return {"path": str(save_scheduler(out, scheduler)), **asdict(scheduler.record)}


@flow(name="nitro-minionsrl-pretrain", persist_result=False, log_prints=True)
def minionsrl_pretrain(out: str = ".nitro/scaling/minionsrl.safetensors", overrides: Sequence[str] = (),
                       fit_from: str = "") -> dict:
    """Pre-train MinionsRL's learned scheduler (a baseline) on the training simulator and save it
    as safetensors with its pre-training record (episodes, simulated env steps, dollars on the
    projected clock), which every report row that uses it shows beside the run's own spend.

    Args:
        out: Where to save the scheduler file, on the worker's machine (what a run's
            scaler.minionsrl.path then names).
        overrides: Pre-training settings as key=value, one per item, e.g. episodes=100,
            normalize_state=true, simulator.rounds=50.
        fit_from: An experiment report's rounds.csv, on the worker's machine, to fit the
            simulator's gain curve, noise and learner times to first; empty: the assumed shape.
            The overrides still win over the fit.
    """
    saved = pretrain_scheduler(overrides, out, fit_from)
    create_markdown_artifact(
        key="nitro-minionsrl-pretrain",
        markdown=(f"**MinionsRL scheduler** saved to `{saved['path']}`: {saved['episodes']} episodes, "
                  f"{saved['env_steps']} simulated env steps, ${saved['usd']:.4f} on the projected clock, "
                  f"on {saved['simulator']}."),
        description="MinionsRL's pre-training record")
    print(f"saved {saved['path']}: {saved['episodes']} episodes, ${saved['usd']:.4f} on the projected clock")
    return saved
