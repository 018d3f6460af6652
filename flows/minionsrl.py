"""MinionsRL's scheduler pre-training as a Prefect flow, for the deployment ``minionsrl-pretrain``:
schedule it from the UI, see its record in the flow run's Artifacts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from nitro.minionsrl.pretrain import pretrain, pretrain_config, save_scheduler


@task(name="pretrain-scheduler", cache_policy=NO_CACHE)
def pretrain_scheduler(overrides: Sequence[str], out: str) -> dict:
    """Train the scheduler on the simulator, save it; returns the file and its pre-training record."""
    cfg = pretrain_config(list(overrides))
    scheduler, _ = pretrain(cfg, log_every=max(1, cfg.episodes // 10))
    return {"path": str(save_scheduler(out, scheduler)), **asdict(scheduler.record)}


@flow(name="nitro-minionsrl-pretrain", persist_result=False, log_prints=True)
def minionsrl_pretrain(out: str = ".nitro/minionsrl.safetensors", overrides: Sequence[str] = ()) -> dict:
    """Pre-train MinionsRL's learned scheduler (a baseline) on the training simulator and save it
    as safetensors with its pre-training record (episodes, simulated env steps, dollars on the
    projected clock), which every report row that uses it shows beside the run's own spend.

    Args:
        out: Where to save the scheduler file, on the worker's machine (what a run's
            scaler.minionsrl.path then names).
        overrides: Pre-training settings as key=value, one per item, e.g. episodes=100,
            normalize_state=true, simulator.rounds=50.
    """
    saved = pretrain_scheduler(overrides, out)
    create_markdown_artifact(
        key="nitro-minionsrl-pretrain",
        markdown=(f"**MinionsRL scheduler** saved to `{saved['path']}`: {saved['episodes']} episodes, "
                  f"{saved['env_steps']} simulated env steps, ${saved['usd']:.4f} on the projected clock."),
        description="MinionsRL's pre-training record")
    print(f"saved {saved['path']}: {saved['episodes']} episodes, ${saved['usd']:.4f} on the projected clock")
    return saved
