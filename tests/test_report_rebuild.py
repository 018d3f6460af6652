"""``nitro experiment report DIR``: a finished report's rliable statistics rebuilt from its own
files (results.json, runs.csv, the rounds file), its hand-written text left as it was."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from cli.main import main
from nitro.experiments.restats import _BLOCK
from nitro.experiments.scores import BLOCK_BEGIN, PROFILE_FILE

TASKS = {"Hopper-v5": 10.0, "Walker2d-v5": 20.0}  # env -> its round-0 evaluation
FINAL = {"fixed": 100.0, "good": 200.0}  # seed s ends at FINAL + 10 s (Walker2d: + 1000 more)
README = """# Experiment `tiny`

Hand-written introduction: why this study ran.

## Hopper-v5 · ppo

| env | algo | scaler | seeds | final eval return |
|---|---|---|---|---|
| Hopper-v5 | ppo | fixed | 3 | 110 ± 25 |

A hand-written remark on Hopper, kept where it is.

![hopper-v5-ppo-return-vs-round](hopper-v5-ppo-return-vs-round.png)

## Walker2d-v5 · ppo

Walker2d has no figure here; its statistics go at the end of its section.

## Runs (`nitro compare --experiment tiny`)

| run | env |
|---|---|

## Machine and versions

- a hand-edited line
"""


def _report(tmp_path: Path, arms: dict[str, float] = FINAL, spec_extra: dict | None = None) -> Path:
    """2 tasks x 2 arms x 3 seeds. runs.csv predates late_return and start_return, so both come from
    the rounds: round 0 evaluates at the task's start, rounds 1-5 at final - 40, -30, ..., 0, so a
    run's late return (its last 5 evaluations) is its final return - 20. Round r has spent $0.01 (r + 1)."""
    out = tmp_path / "tiny"
    out.mkdir()
    runs, rounds = [], []
    for env, start in TASKS.items():
        for label, base in arms.items():
            for seed in range(3):
                name = f"tiny-{env}-{label}-s{seed}"
                final = base + 10 * seed + (1000 if env == "Walker2d-v5" else 0)
                runs.append({"run_name": name, "label": label, "env": env, "algo": "ppo", "seed": seed,
                             "final_return": final, "status": "FINISHED"})
                rounds += [{"run_name": name, "round": r, "eval_return_mean": start if r == 0 else final - 10 * (5 - r),
                            "spend_total_usd": 0.01 * (r + 1)} for r in range(6)]
    for path, rows in ((out / "runs.csv", runs), (out / "rounds.csv", rounds)):
        with path.open("w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    spec = {"name": "tiny", "reference": "fixed", **(spec_extra or {}),
            "matrix": {"env": list(TASKS), "algo": ["ppo"], "scaler": list(arms), "seed": [0, 1, 2]}}
    (out / "results.json").write_text(json.dumps({"experiment": "tiny", "spec": spec, "summary": [], "ratios": [],
                                                  "configs": {}, "runs": runs, "notes": {}}, indent=1))
    (out / "README.md").write_text(README)
    return out


def test_report_rebuilds_the_statistics_and_keeps_the_hand_written_text(tmp_path):
    out = _report(tmp_path)
    before = json.loads((out / "results.json").read_text())
    argv = ["experiment", "report", str(out), "--reps", "500", "--profile-reps", "100"]
    assert main(argv) == 0

    readme = (out / "README.md").read_text()
    assert _BLOCK.sub("", readme) == README  # every line outside the statistics blocks as it was
    hopper = readme.index("## Hopper-v5 · ppo")
    remark, figure = readme.index("A hand-written remark"), readme.index("![hopper-v5-ppo-return-vs-round]")
    assert hopper < remark < readme.index(BLOCK_BEGIN.format(name="Hopper-v5 · ppo")) < figure
    walker_block = readme.index(BLOCK_BEGIN.format(name="Walker2d-v5 · ppo"))
    assert readme.index("Walker2d has no figure") < walker_block < readme.index("## Across tasks (rliable)") \
        < readme.index("## Runs")
    # good on Hopper: final returns 200, 210, 220 (3 seeds: the IQM trims nothing), late returns 180-200,
    # above every fixed seed
    assert "| good | 3 | 190.0 (" in readme and "| 3 | 210.0 (" in readme and "| 1.00 (1.00 to 1.00) |" in readme
    assert "- Hopper-v5 · ppo, final return: 0 = 10.0 (round-0 evaluation), 1 = 210.0 (`good`'s mean)." in readme
    assert "(500 resamples of the seeds, within each task)" in readme
    assert f"![performance-profile]({PROFILE_FILE})" in readme
    assert (out / PROFILE_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    results = json.loads((out / "results.json").read_text())
    stats = results.pop("statistics")
    assert results == before and list(json.loads((out / "results.json").read_text())).index("statistics") == 4
    good = next(s for s in stats["per_task"] if (s["env"], s["label"]) == ("Hopper-v5", "good"))
    assert good["late_return"]["IQM"]["value"] == 190.0 and good["final_return"]["improvement"]["value"] == 1.0
    assert [agg["tasks"] for agg in stats["across_tasks"]] == [["Hopper-v5 · ppo", "Walker2d-v5 · ppo"]] * 2

    # a second rebuild replaces its blocks in place: the same bytes
    files = {p: p.read_bytes() for p in (out / "README.md", out / "results.json")}
    assert main(argv) == 0
    assert {p: p.read_bytes() for p in files} == files


def test_a_budget_report_gains_the_area_under_return_vs_spend_and_the_best_of_its_grid(tmp_path):
    """A budget experiment whose spec names a grid: each run's area under return vs spend comes from
    its rounds, and each arm outside the grid is divided by the grid's best, seed by seed."""
    arms = {"fixed": 100.0, "fixed-2": 150.0, "good": 200.0}
    out = _report(tmp_path, arms, {"compare": "budget", "budget_usd": 0.06, "best_of": ["fixed", "fixed-2"]})
    assert main(["experiment", "report", str(out), "--reps", "500", "--profile-reps", "100"]) == 0
    readme = (out / "README.md").read_text()
    assert "area under return vs spend: IQM (95% CI)" in readme
    assert "Against the best of the grid (`fixed`, `fixed-2`)" in readme
    # Hopper, late return: fixed-2 is the best of the grid (130, 140, 150), good makes 180, 190, 200
    assert "| good | late return | `fixed-2` (140.0) | 3 | 1.36 (" in readme and "| 1.38, 1.36, 1.33 |" in readme
    stats = json.loads((out / "results.json").read_text())["statistics"]
    area = next(s for s in stats["per_task"] if (s["env"], s["label"]) == ("Hopper-v5", "good"))["return_area"]
    # good, seed 0 on Hopper: evaluations 10 (at $0.01), 160, 170, 180, 190, 200 (at $0.06, the budget):
    # 10 x 0.01 + 0.01 x (85 + 165 + 175 + 185 + 195) = 8.15, over $0.06. Each seed's evaluations after
    # round 0 stand 10 above the seed before's, adding 0.01 x 4.5 x 10 / 0.06 = 7.5: the mean is seed 1's
    assert area["mean"]["value"] == pytest.approx(8.15 / 0.06 + 7.5)
    assert {(r["env"], r["label"], r["metric"]) for r in stats["best_of"]} == {
        (env, "good", m) for env in TASKS for m in ("late_return", "return_area", "final_return")}
    assert [agg["metric"] for agg in stats["across_tasks"]] == ["late_return", "return_area", "final_return"]


@pytest.mark.parametrize("drop, missing", [
    ({"runs": "final_return"}, "runs.csv lacks final_return"),
    ({"rounds": "eval_return_mean"},
     "runs.csv lacks late_return, start_return and rounds.csv has no eval_return_mean to derive them from"),
    ({"rounds": "spend_total_usd", "budget": 0.06},
     "runs.csv lacks late_return, start_return, return_area and rounds.csv has no spend_total_usd to derive "
     "return_area from"),
])
def test_a_report_without_the_columns_gets_one_line_naming_them(tmp_path, capsys, drop, missing):
    budget = drop.pop("budget", None)
    out = _report(tmp_path, spec_extra={"compare": "budget", "budget_usd": budget} if budget else None)
    for name, column in drop.items():
        path = out / f"{name}.csv"
        with path.open(newline="") as fh:
            rows = [{k: v for k, v in r.items() if k != column} for r in csv.DictReader(fh)]
        with path.open("w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    readme = (out / "README.md").read_text()
    assert main(["experiment", "report", str(out), "--reps", "200"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"nitro: error: {out}: cannot rebuild the statistics: {missing}"
    assert (out / "README.md").read_text() == readme and not (out / PROFILE_FILE).exists()


def test_the_machine_section_names_the_cpus_generation(monkeypatch):
    """Two hosts both called "AMD EPYC" ran the same work 2-3x apart, and AVX-512 changes PyTorch's
    kernels: a report names the family, the model and the vector unit, and an older report's
    machine (without them) still renders."""
    from nitro.experiments import machine

    monkeypatch.setattr(machine, "_first_cpu", lambda: {"model name": "AMD EPYC", "cpu family": "26", "model": "2",
                                                        "flags": "fpu sse avx2 avx512f avx512bw"})
    info = machine.machine_info()
    assert (info["cpu"], info["cpu_family"], info["cpu_model_number"], info["cpu_vector"]) == ("AMD EPYC", "26", "2",
                                                                                               "avx512")
    assert "AMD EPYC family 26 model 2 with avx512 (" in machine.machine_markdown(info)[2]
    older = {k: v for k, v in info.items() if k not in ("cpu_family", "cpu_model_number", "cpu_vector")}
    assert "AMD EPYC (" in machine.machine_markdown(older)[2]
