"""The boostability probe as a flow: a trunk run, forked at each branch round into a plain and a
boosted arm, then a report of how well R and S_k rank the gains (``nitro/experiments/probe.py`` has the method).

Per seed: the trunk trains (forking each arm from a round observer, right after its checkpoint of
round k-1, before round k deletes the entries the fork copies), then every arm runs as an ordinary
training run. All of them are MLflow runs nested under one parent run of the probe, in the MLflow
experiment named after the probe. Re-running resumes: the trunk and each arm continue from their
checkpoints, finished arms are skipped.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import yaml
from prefect import flow, runtime
from prefect.artifacts import acreate_markdown_artifact

from flows.experiment import attach_child, parent_run
from flows.training import run_training
from nitro.config import NitroConfig
from nitro.experiments.probe import (
    ARMS,
    Arm,
    ProbeError,
    ProbeSpec,
    arm_config,
    arm_finished,
    arm_run_id,
    build_probe_report,
    fork,
    load_probe_spec,
    trunk_config,
    trunk_run_id,
)
from nitro.run.rundir import RunDir
from nitro.run.runtime import ROUND_OBSERVERS, get_run, run_redis
from nitro.tracking.tracker import RunTracker, default_tracking_uri

log = logging.getLogger("nitro")

TAG_PROBE = "nitro.probe"
TAG_PROBE_PARENT = "nitro.probe_parent"


@flow(name="nitro-probe", persist_result=False, log_prints=True)
async def probe(spec_path: str = "examples/probe_hopper.yaml", overrides: Sequence[str] = (),
                report_dir: str = "") -> dict:
    """Probe whether the Hessian signal predicts the gain of boosting on a task (paper §2.2, Fig. 7):
    a trunk run forked at chosen rounds into a plain and a boosted arm, then the rank correlation
    of R_k and S_k with the gain, with its 95% CI, in a report and in MLflow.

    Args:
        spec_path: Probe spec YAML on the worker's machine, relative to the repository (see
            examples/probe_hopper.yaml: env, seeds, branch rounds, horizon, actors).
        overrides: Config overrides for every run of the probe, as key=value, one per item, e.g.
            home=/data/nitro or ppo.lr=1e-4.
        report_dir: Where the report goes; empty: the spec's report_dir, else docs/results/<name>.
    """
    parsed = load_probe_spec(spec_path, list(overrides))
    return await run_probe(parsed, report_dir=report_dir or None)


async def run_probe(spec: ProbeSpec, *, report_dir: str | os.PathLike | None = None) -> dict:
    first = trunk_config(spec, spec.seeds[0])
    uri = first.tracking.mlflow_uri or default_tracking_uri(first)
    tracker = RunTracker(uri, spec.name)
    flow_run_id = str(runtime.flow_run.id) if runtime.flow_run.id else None
    parent = parent_run(tracker, TAG_PROBE_PARENT, spec.name, f"probe-{spec.name}", flow_run_id,
                        spec_yaml=yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False),
                        params={"branch_rounds": spec.branch_rounds, "horizon": spec.horizon},
                        tags={TAG_PROBE: spec.name})
    log.info("probe %s: seeds %s, branch rounds %s, MLflow parent run %s",
             spec.name, spec.seeds, spec.branch_rounds, parent)
    for seed in spec.seeds:
        await run_trunk(spec, seed, tracker, parent)
        for k in spec.branch_rounds:
            for arm in ARMS:
                await run_arm(spec, seed, k, arm, tracker, parent)

    out_dir = Path(report_dir or spec.report_dir or Path("docs/results") / spec.name)
    result = build_probe_report(spec, out_dir, parent_run_id=parent)
    tracker.client.log_artifacts(parent, str(out_dir), "report")
    for name, c in result["correlations"].items():
        if c["n"] >= 4 and c["rho"] == c["rho"]:
            tracker.client.log_metric(parent, f"spearman/{name.replace('~', '_vs_')}", c["rho"])
    tracker.client.set_terminated(parent, status="FINISHED")
    slug = spec.name.lower().replace("_", "-").replace(".", "-")
    await acreate_markdown_artifact((out_dir / "README.md").read_text(), key=f"nitro-probe-{slug}",
                                    description=f"Nitro boostability probe {spec.name}")
    log.info("probe %s: report in %s", spec.name, out_dir)
    return {"probe": spec.name, "parent_run_id": parent, "tracking_uri": uri, "report_dir": str(out_dir),
            "rows": result["rows"], "correlations": result["correlations"]}


async def run_trunk(spec: ProbeSpec, seed: int, tracker: RunTracker, parent: str) -> None:
    """Train the trunk up to the last branch round, forking the arms of each branch round k
    right after the trunk's round k-1 is checkpointed."""
    config = trunk_config(spec, seed)
    trunk = trunk_run_id(spec, seed)
    to_fork = {k: [arm_run_id(spec, seed, k, arm) for arm in ARMS] for k in spec.branch_rounds
               if any(RunDir(config.home, arm_run_id(spec, seed, k, arm)).latest_round() is None for arm in ARMS)}
    done = RunDir(config.home, trunk).latest_round()
    passed = sorted(k for k in to_fork if done is not None and done >= k)
    if passed:
        raise ProbeError(f"trunk {trunk} has run round {passed[0]} already, so its arms can no longer be forked; "
                         f"remove {trunk} and its arms' runs from {config.home}/runs or give the probe a new name")
    if done is not None and done + 1 in to_fork:  # it died right after the checkpoint the fork needs
        with run_redis(config) as (client, _):
            _fork_all(client, config, trunk, done + 1, to_fork.pop(done + 1))
    failures: list[BaseException] = []

    def on_round(run_id: str, report) -> None:
        k = report.round + 1
        if run_id == trunk and k in to_fork:
            try:
                _fork_all(get_run(trunk).cache.client, config, trunk, k, to_fork.pop(k))
            except BaseException as exc:  # observers' errors are swallowed: keep it for after the run
                failures.append(exc)

    attach_child(tracker, config, trunk, parent, {TAG_PROBE: spec.name, "nitro.probe_role": "trunk",
                                                  "nitro.probe_seed": str(seed)})
    ROUND_OBSERVERS.append(on_round)
    try:
        if not (done is not None and done >= config.rounds - 1):
            await run_training(config, trunk)
    finally:
        ROUND_OBSERVERS.remove(on_round)
    if failures:
        raise failures[0]
    if to_fork:
        raise ProbeError(f"trunk {trunk} stopped before round(s) {sorted(to_fork)} could be forked")


def _fork_all(client, config: NitroConfig, trunk: str, k: int, arms: list[str]) -> None:
    for arm_id in arms:
        fork(client, config.home, trunk, arm_id, k, config.redis.ttl_s)
    log.info("probe: forked %s after round %d into %s", trunk, k - 1, ", ".join(arms))


async def run_arm(spec: ProbeSpec, seed: int, k: int, arm: Arm, tracker: RunTracker, parent: str) -> None:
    config = arm_config(spec, seed, k, arm)
    run_id = arm_run_id(spec, seed, k, arm)
    if arm_finished(config, run_id):
        return
    attach_child(tracker, config, run_id, parent, {TAG_PROBE: spec.name, "nitro.probe_role": arm,
                                                   "nitro.probe_round": str(k), "nitro.probe_seed": str(seed)})
    await run_training(config, run_id)
