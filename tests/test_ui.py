"""Issue 12 in a real browser: Prefect and MLflow as the place where a user watches, judges and
compares runs.

The session's Prefect + MLflow stack (tests/support/stack.py, shared with
tests/test_prefect_server.py): a real `prefect server` with its UI, `mlflow ui` over the runs'
store, the work pools and deployments made by the README's own commands, and a process worker;
headless Chromium (Debian's `chromium` package, driven by playwright's Python client; no browser
download) clicks through both UIs. Each step leaves a screenshot in a temporary folder;
``NITRO_SCREENSHOT_DIR=docs/screenshots`` writes them where docs/usage.md links them instead, to
refresh those.

* Prefect: open the deployment, start a Custom run through the form, see the round lines in Logs
  and the round table grow while the run is still running (the worker holds round 2 with
  an injected hang (tests/support/faults.py), so "before the run ends" is a fact, not a race), follow the link to
  the MLflow run; kill -9 the flow run's process in the middle of round 2, press Retry in the UI:
  the run completes, no subflow stays Running, and each artifact exists once.
* MLflow: the run list shows the headline metrics, the run's charts open with the Headline
  group and each of its charts draws its series (before the screenshot), the description's
  Prefect link opens the flow run, and Compare of two runs shows the plots.

Without Chromium or playwright the module is skipped with the reason.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from mlflow.tracking import MlflowClient

from tests.support import faults
from tests.support.servers import (
    REPO,
    create_flow_run,
    flow_runs_named,
    tail,
    wait_flow_run,
    wait_until,
)

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip("no Chromium here: install Debian's package (apt-get install chromium) to run the UI tests",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')")
expect = sync_api.expect
expect.set_options(timeout=60_000)  # same patience as UI_WAIT_MS: a slow, shared machine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

ROUNDS = 4
HANG_AT = 2  # the run holds this round (once) until the test kills its process
UI_WAIT_MS = 60_000  # the most any single page element may take to appear (a slow, shared machine)
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-default-apps", "--mute-audio"]


@dataclass
class Stack:
    prefect_ui: str
    api: str
    mlflow_ui: str
    tracking_uri: str
    config_path: Path  # the small run config the form points at; its home holds the planted hang
    deployment_id: str
    worker_log: Path
    tmp: Path


@pytest.fixture(scope="module")
def stack(prefect_stack, tmp_path_factory) -> Stack:
    tmp = tmp_path_factory.mktemp("ui")
    config = tmp / "run.yaml"
    config.write_text(
        f"home: {tmp / 'nitro-home'}\nsteps_per_actor: 128\nscaler:\n  fixed_actors: 2\nbackend:\n  workers: 2\n"
        f"detector:\n  subset_size: 64\neval:\n  every_rounds: 2\n  episodes: 2\ntracking:\n"
        f"  mlflow_uri: {prefect_stack.tracking_uri}\n")
    faults.plant(tmp / "nitro-home", hang_at=HANG_AT)
    dep = prefect_stack.deployment("nitro-train/local-actors")
    return Stack(prefect_stack.prefect_ui, prefect_stack.api, prefect_stack.mlflow_ui, prefect_stack.tracking_uri,
                 config, dep["id"], prefect_stack.worker_log, tmp)


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture()
def page(browser):
    context = browser.new_context(viewport={"width": 1600, "height": 1000})
    context.set_default_timeout(UI_WAIT_MS)
    page = context.new_page()
    try:
        yield page
    finally:
        context.close()


@pytest.fixture(scope="module")
def shot(tmp_path_factory):
    """``shot(page, name)`` saves the page as ``<name>.png``: in a temporary folder, or in
    NITRO_SCREENSHOT_DIR (relative to the repository) when it is set."""
    folder = REPO / os.environ["NITRO_SCREENSHOT_DIR"] if os.environ.get("NITRO_SCREENSHOT_DIR") \
        else tmp_path_factory.mktemp("screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return lambda page, name: page.screenshot(path=str(folder / f"{name}.png"))


# -- Prefect ---------------------------------------------------------------------------------------


def _form_field(page, name: str):
    """One parameter of Prefect's run form: the block under the label ``<name> (Optional)``."""
    label = page.locator("span.schema-form-property__label", has_text=re.compile(rf"^{re.escape(name)}\b"))
    return page.locator("div.schema-form-property", has=label).first


def _engine_processes(flow_run_id: str) -> list[tuple[int, str]]:
    """(pid, command line) of every process of this flow run: the worker starts it with
    PREFECT__FLOW_RUN_ID in its environment, and its children (actor workers) inherit it."""
    found = []
    marker = f"PREFECT__FLOW_RUN_ID={flow_run_id}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if marker in (proc / "environ").read_bytes().split(b"\0"):
                found.append((int(proc.name), (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
        except OSError:
            continue
    return found


def _artifacts_of(client: httpx.Client, flow_run_id: str) -> list[dict]:
    resp = client.post("/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})
    resp.raise_for_status()
    return resp.json()


def test_prefect_ui_start_watch_follow_and_retry(stack: Stack, page, shot):
    # 1. the deployment: every parameter with its default and type
    page.goto(f"{stack.prefect_ui}/deployments/deployment/{stack.deployment_id}")
    page.locator("li.p-tab", has_text="Parameters").click()
    row = page.locator("tr", has=page.get_by_text("steps_per_actor", exact=True))
    expect(row.get_by_role("cell", name="0", exact=True)).to_be_visible()  # 0: the preset's value for the env
    expect(row).to_contain_text("integer")
    shot(page, "prefect-1-deployment-parameters")

    # 2. Run > Custom run, through the form
    page.get_by_role("button", name=re.compile(r"^\s*Run\b")).click()
    page.get_by_text("Custom run", exact=True).click()
    expect(page.get_by_text("Gymnasium environment to train on", exact=False)).to_be_visible()
    expect(_form_field(page, "overrides")).to_contain_text("key=value")
    _form_field(page, "rounds").locator("input").fill(str(ROUNDS))
    # Prefect's select opens from the keyboard; a synthetic click only focuses it in headless Chromium
    _form_field(page, "scaler").locator("button.p-select-button__control").press("ArrowDown")
    page.get_by_role("option", name="fixed", exact=True).click()
    _form_field(page, "config_path").locator("input, textarea").fill(str(stack.config_path))
    overrides = _form_field(page, "overrides")
    overrides.get_by_role("button", name=re.compile("Add item")).click()
    overrides.locator("input, textarea").last.fill("eval.episodes=2")
    # Leave the field before submitting: its blur can re-lay the form out under a click on Submit
    # (in two of three fresh-clone CI runs, Submit created no run; the cause is not proven).
    overrides.locator("input, textarea").last.press("Tab")
    shot(page, "prefect-2-custom-run-form")
    submit = page.get_by_role("button", name="Submit")
    answers: list[str] = []  # the page's calls to the API that are not reads, and their answers
    in_flight: set = set()  # the page's calls that have no answer yet

    def asked(request) -> None:
        if "/api/" in request.url and not re.search(r"/(filter|count|history|read)$", request.url) \
                and request.method != "GET":
            in_flight.add(request)

    def told(request, what: str) -> None:
        if request in in_flight:
            in_flight.discard(request)
            answers.append(f"{request.method} {request.url.split('/api', 1)[-1]}: {what}")

    page.on("request", asked)
    page.on("requestfinished", lambda r: told(r, str(r.response().status if r.response() else "no answer")))
    page.on("requestfailed", lambda r: told(r, f"failed ({r.failure})"))
    page.on("console", lambda m: answers.append(f"console: {m.text[:200]}") if m.type == "error" else None)
    with httpx.Client(base_url=stack.api, timeout=30) as client:
        def runs() -> list:  # the deployment's runs from this form (the stack's other tests use it too)
            body = {"deployments": {"id": {"any_": [stack.deployment_id]}}}
            runs = client.post("/flow_runs/filter", json=body).json()
            return [r for r in runs if r["parameters"].get("config_path") == str(stack.config_path)]

        # Submit as a user does: press it, and again while the form is still there, nothing it sent is
        # still waiting for an answer, and no run came of it. On loaded CI hosts a press has created no
        # run more than once (once a second press did not either); the failure message gives the
        # page's calls and their answers, so that a next failure says why.
        for _ in range(5):
            submit.click()
            for _ in range(45):
                page.wait_for_timeout(1000)  # the page's events reach the handlers above while it waits
                if not in_flight and (runs() or not submit.is_visible()):
                    break
            if in_flight or runs() or not submit.is_visible():
                break
        try:  # the UI's own round trip (create, then back to the Runs tab) can be slow on a loaded host
            [submitted] = wait_until(runs, 120, "the submitted flow run", stack.worker_log, every_s=1)
        except pytest.fail.Exception as exc:
            shot(page, "prefect-2-submit-failed")
            shown = page.locator(".p-toast, [role=alert], .p-message").all_inner_texts()
            pytest.fail(f"{exc}\npage: {page.url}\nshown: {shown}\nthe form still shown: {submit.is_visible()}"
                        f"\nthe page's requests: {answers}")
    # Prefect goes back to the deployment's Runs tab after Submit; the new run is listed there
    page.wait_for_url(re.compile(r"/deployments/deployment/[0-9a-f-]{36}\?tab=Runs"), timeout=180_000)
    flow_run_id = submitted["id"]
    # The tab lists a new run when its list next polls the API; on a loaded host that has taken over a
    # minute (fresh-clone CI), so a user who does not see it yet reloads, as this does every 30 s.
    link = page.get_by_role("link", name=submitted["name"]).first
    for _ in range(6):
        try:
            link.wait_for(timeout=30_000)
            break
        except sync_api.TimeoutError:
            page.reload()
    link.click()
    page.wait_for_url(re.compile(rf"/runs/flow-run/{flow_run_id}"))
    run_id = "run-" + flow_run_id.replace("-", "")[:12]  # flows.training.default_run_id

    with httpx.Client(base_url=stack.api, timeout=30) as client:
        fr = client.get(f"/flow_runs/{flow_run_id}").json()
        assert fr["parameters"]["rounds"] == ROUNDS and fr["parameters"]["scaler"] == "fixed"
        assert fr["parameters"]["overrides"] == ["eval.episodes=2"]
        flow_run_name = fr["name"]

        # the run reaches the held round: rounds 0 and 1 are done, round 2 is running
        def holding() -> bool:
            held = flow_runs_named(client, f"{run_id}-round-{HANG_AT}")
            return (
                bool(held)
                and held[0]["state"]["type"] == "RUNNING"
                and "holding round" in tail(stack.worker_log, 20000)
            )

        wait_until(holding, 420, f"round {HANG_AT} running", stack.worker_log, every_s=2)

        # 3. Logs: one line per finished round, numbered from 0
        page.reload()
        page.locator("li.p-tab", has_text="Logs").click()
        for k in range(HANG_AT):
            expect(page.get_by_text(re.compile(rf"^round {k} of 0\.\.{ROUNDS - 1}: actors=2 "))).to_be_visible()
        page.get_by_text(re.compile(rf"^round {HANG_AT - 1} of ")).scroll_into_view_if_needed()
        shot(page, "prefect-3-logs")

        # 4. the round table, live: two rows while the run is still running
        page.locator("li.p-tab", has_text="Artifacts").click()
        expect(page.get_by_text(f"nitro-progress-{run_id}")).to_be_visible()
        page.get_by_text(f"nitro-rounds-{run_id}", exact=True).click()
        table = page.locator("table")
        expect(table.locator("tbody tr")).to_have_count(HANG_AT)
        expect(table).to_contain_text("eval_return_mean")
        assert client.get(f"/flow_runs/{flow_run_id}").json()["state"]["type"] == "RUNNING"
        shot(page, "prefect-4-live-round-table")

        # 5. the link to MLflow sits on the flow run (not a task) and opens the MLflow run
        page.go_back()
        page.locator("li.p-tab", has_text="Artifacts").click()
        expect(page.get_by_text("Flow run", exact=True)).to_be_visible()
        page.get_by_text(f"nitro-mlflow-{run_id}", exact=True).click()
        link = page.locator(f'a[href^="{stack.mlflow_ui}/#/experiments/"][href*="/runs/"]').first
        expect(link).to_have_text(flow_run_name)
        shot(page, "prefect-5-mlflow-link")
        if link.get_attribute("target") == "_blank":
            with page.context.expect_page() as opened:
                link.click()
            mlflow_page = opened.value
        else:
            link.click()
            mlflow_page = page
        expect(mlflow_page.get_by_role("heading", name=flow_run_name)).to_be_visible()
        expect(mlflow_page.get_by_text(run_id).first).to_be_visible()
        shot(mlflow_page, "prefect-6-mlflow-run")
        if mlflow_page is not page:
            mlflow_page.close()

        # 6. kill -9 in the middle of round 2 ...
        processes = _engine_processes(flow_run_id)
        engine = [pid for pid, cmd in processes if "prefect.engine" in cmd]
        assert len(engine) == 1, processes
        os.kill(engine[0], signal.SIGKILL)
        crashed = wait_flow_run(client, flow_run_id, {"CRASHED"}, 120, stack.worker_log)
        assert "-9" in (crashed["state"]["message"] or ""), crashed["state"]
        for pid, _ in _engine_processes(flow_run_id):  # what the dead process left behind: ours to end
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        orphan = flow_runs_named(client, f"{run_id}-round-{HANG_AT}")
        assert [r["state"]["type"] for r in orphan] == ["RUNNING"], "the killed round should look Running now"

        # ... then the UI's Retry
        page.goto(f"{stack.prefect_ui}/runs/flow-run/{flow_run_id}")
        page.get_by_role("button", name=re.compile(r"^\s*Retry")).first.click()
        page.get_by_role("dialog").get_by_role("button", name="Retry", exact=True).click()
        # the UI sets the new state after the click returns: until then the run still reads Crashed
        wait_until(lambda: client.get(f"/flow_runs/{flow_run_id}").json()["state"]["type"] != "CRASHED", 60,
                   "the UI's Retry taking the run out of Crashed")
        done = wait_flow_run(client, flow_run_id, {"COMPLETED"}, 420, stack.worker_log)
        assert done["run_count"] == 2
        page.reload()
        page.locator("li.p-tab", has_text="Subflow Runs").click()
        expect(page.get_by_text(f"{run_id}-round-{ROUNDS - 1}").first).to_be_visible()
        shot(page, "prefect-7-after-retry")

        # no subflow or task stays Running; the killed round is Crashed and ran again
        rounds = {k: sorted(r["state"]["type"] for r in flow_runs_named(client, f"{run_id}-round-{k}"))
                  for k in range(ROUNDS)}
        assert rounds == {0: ["COMPLETED"], 1: ["COMPLETED"], HANG_AT: ["COMPLETED", "CRASHED"],
                          3: ["COMPLETED"]}, rounds
        # Task-run states reach the server as events that its task-run recorder writes in batches,
        # so the last tasks' final states may land a few seconds after the flow run's own.
        flow_ids = [flow_run_id] + [
            r["id"] for k in range(ROUNDS) for r in flow_runs_named(client, f"{run_id}-round-{k}")
        ]

        def unfinished_task_runs() -> list[dict]:
            return client.post("/task_runs/filter", json={
                "flow_runs": {"id": {"any_": flow_ids}},
                "task_runs": {"state": {"type": {"any_": ["RUNNING", "PENDING"]}}}}).json()

        wait_until(lambda: not unfinished_task_runs(), 60, "every task run leaves RUNNING/PENDING", stack.worker_log)
        running = unfinished_task_runs()
        assert running == [], [(t["name"], t["state"]["type"]) for t in running]
        # one artifact of each kind, holding the final state
        artifacts = _artifacts_of(client, flow_run_id)
        assert sorted(a["key"] for a in artifacts) == sorted(
            f"nitro-{kind}-{run_id}" for kind in ("mlflow", "progress", "rounds"))
        assert all(a["task_run_id"] is None for a in artifacts)
        by_kind = {a["type"]: a for a in artifacts}
        assert by_kind["progress"]["data"] == 100
        assert [row["round"] for row in json.loads(by_kind["table"]["data"])] == list(range(ROUNDS))

    # MLflow: one run for the whole thing, named after the flow run, finished, with the policy model
    mlflow = MlflowClient(tracking_uri=stack.tracking_uri)
    [run] = [r for r in mlflow.search_runs([e.experiment_id for e in mlflow.search_experiments()])
             if r.data.tags.get("nitro.run_id") == run_id]
    assert run.info.status == "FINISHED" and run.info.run_name == flow_run_name
    assert run.data.tags["prefect.flow_run_url"] == f"{stack.prefect_ui}/runs/flow-run/{flow_run_id}"
    assert len(run.outputs.model_outputs) == 1


# -- MLflow ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_finished_runs(stack: Stack) -> list[dict]:
    """Two short runs through the deployment (seeds 0 and 1), one after the other; their MLflow runs.
    Their home is not the one with the planted hang."""
    runs = []
    with httpx.Client(base_url=stack.api, timeout=30) as client:
        for seed in (0, 1):
            params = {"rounds": 2, "scaler": "fixed", "seed": seed, "config_path": str(stack.config_path),
                      "overrides": [f"home={stack.tmp / 'finished-runs'}"]}
            resp = create_flow_run(client, stack.deployment_id, params)
            assert resp.status_code == 201, resp.text
            fr = wait_flow_run(client, resp.json()["id"], {"COMPLETED"}, 420, stack.worker_log)
            runs.append(fr)
    mlflow = MlflowClient(tracking_uri=stack.tracking_uri)
    experiment = mlflow.get_experiment_by_name("nitro")
    by_flow_run = {r.data.tags.get("prefect.flow_run_id"): r for r in mlflow.search_runs([experiment.experiment_id])}
    return [{"flow_run": fr, "mlflow_run": by_flow_run[fr["id"]], "experiment_id": experiment.experiment_id}
            for fr in runs]


def _close_assistant(page) -> None:
    """MLflow 3.17 opens its assistant panel next to everything; close it for room."""
    close = page.locator('[data-component-id="mlflow.assistant.chat_panel.close"]')
    if close.count():
        close.click()
        expect(close).to_have_count(0)


# The charts of the first chart group (the Headline) and how many have drawn their series: a
# line, or a marker where a series has one point. A chart loads its metric history after the page
# renders and shows a spinner, no plot, until it arrives.
_DRAWN_CHARTS_JS = """() => {
    const grid = document.querySelector('[data-testid="draggable-chart-cards-grid"]');
    const cards = grid ? [...grid.querySelectorAll('[data-testid="experiment-view-compare-runs-card"]')] : [];
    const drawn = cards.filter(card => [...card.querySelectorAll(
        '.js-plotly-plot .scatterlayer .trace path.js-line, .js-plotly-plot .scatterlayer .trace path.point')]
        .some(path => (path.getAttribute('d') || '').length > 2 && path.getBBox().width + path.getBBox().height > 0));
    return [cards.length, drawn.length];
}"""


def _wait_for_drawn_charts(page, n: int) -> tuple[int, int]:
    """Wait (at most UI_WAIT_MS) until the first chart group's ``n`` charts have each drawn a
    series; returns (charts, charts drawn) as the page has them then."""
    try:
        page.wait_for_function(f"n => {{ const [cards, drawn] = ({_DRAWN_CHARTS_JS})(); "
                               "return cards === n && drawn === n; }", arg=n, timeout=UI_WAIT_MS)
    except sync_api.TimeoutError:
        pass  # the caller's assertion says how many had drawn
    return tuple(page.evaluate(_DRAWN_CHARTS_JS))


def test_mlflow_ui_headline_first_links_back_and_compares_plots(stack: Stack, two_finished_runs, page, shot):
    first, _second = two_finished_runs
    experiment_id = first["experiment_id"]
    names = [r["mlflow_run"].info.run_name for r in two_finished_runs]
    assert names == [r["flow_run"]["name"] for r in two_finished_runs]  # MLflow runs carry the flow runs' names

    # 1. the run list from the experiment link: model-training mode, headline metrics as columns
    page.goto(f"{stack.mlflow_ui}/#/experiments/{experiment_id}/runs?viewStateShareKey=nitro"
              "&workflowType=machine_learning")
    for name in names:
        expect(page.get_by_role("link", name=name, exact=True)).to_be_visible()
    _close_assistant(page)
    expect(page.get_by_text("Model training", exact=True)).to_be_visible()
    expect(page.get_by_text("Headline/eval_return_mean").first).to_be_attached()
    expect(page.get_by_text("Headline/spend_total_usd").first).to_be_attached()
    shot(page, "mlflow-1-run-list")

    # 2. the run's charts: the Headline group comes first
    run = first["mlflow_run"]
    page.goto(f"{stack.mlflow_ui}/#/experiments/{experiment_id}/runs/{run.info.run_id}/model-metrics"
              "?workflowType=machine_learning")
    # each chart group's header: its name and, in a sibling element, "(count)"
    sections = page.locator('[data-testid="experiment-view-compare-runs-section-header"]')
    expect(sections.first).to_contain_text(re.compile(r"\(\d+\)"))
    titles = [" ".join(t.split()) for t in sections.all_inner_texts()]
    assert titles[0].startswith("Headline (") and any(t.startswith("ppo (") for t in titles), titles
    expect(page.get_by_text("eval_return_mean", exact=True).first).to_be_visible()
    _close_assistant(page)
    # each chart loads its metric history after the page renders: shoot once every Headline chart has drawn
    headline = int(re.match(r"Headline \((\d+)\)", titles[0])[1])
    charts, drawn = _wait_for_drawn_charts(page, headline)
    assert (charts, drawn) == (headline, headline), f"{drawn} of {charts} Headline charts drawn, {headline} expected"
    shot(page, "mlflow-2-headline-charts")

    # 3. the description links back to the Prefect flow run, and the link opens it
    page.goto(f"{stack.mlflow_ui}/#/experiments/{experiment_id}/runs/{run.info.run_id}?workflowType=machine_learning")
    back = page.locator(f'a[href="{stack.prefect_ui}/runs/flow-run/{first["flow_run"]["id"]}"]')
    expect(back).to_have_text(first["flow_run"]["name"])
    back.scroll_into_view_if_needed()
    _close_assistant(page)
    shot(page, "mlflow-3-prefect-link")
    with page.context.expect_page() as opened:
        back.click(modifiers=["Control"]) if back.get_attribute("target") != "_blank" else back.click()
    prefect_page = opened.value
    prefect_page.wait_for_load_state()
    expect(prefect_page.get_by_text(first["flow_run"]["name"]).first).to_be_visible()
    expect(prefect_page.get_by_text("Completed").first).to_be_visible()
    prefect_page.close()

    # 4. Compare: the plots are common artifacts, shown side by side
    ids = ",".join(f'"{r["mlflow_run"].info.run_id}"' for r in two_finished_runs)
    page.goto(f'{stack.mlflow_ui}/#/compare-runs?runs=[{ids}]&experiments=["{experiment_id}"]')
    expect(page.get_by_text("No common artifacts to display.")).to_have_count(0)
    node = page.locator('[data-testid="artifact-tree-node"][artifact-name="return.png"]')
    expect(node).to_be_attached()
    for plot in ("actors.png", "spend.png"):
        expect(page.locator(f'[data-testid="artifact-tree-node"][artifact-name="{plot}"]')).to_be_attached()
    _close_assistant(page)
    node.scroll_into_view_if_needed()
    node.dispatch_event("click")
    # one shown per run (the page may keep hidden copies of an image, e.g. for a zoom view)
    previews = page.locator('img[src*="return.png"]:visible, img[src^="blob:"]:visible')
    expect(previews).to_have_count(2)
    expect(previews.first).to_be_visible()
    page.wait_for_timeout(1000)  # let both images paint before the screenshot
    shot(page, "mlflow-4-compare-plots")
