"""The Stellaris aggregation rule (bound, trigger, weight) and the round's discrete-event schedule."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nitro.stellaris.aggregation import BoundState, s_max_from, should_apply, staleness_bound, staleness_weight
from nitro.stellaris.schedule import Application, GradientSchedule, LatencyModel, ScheduledJob, simulate

# -- aggregation ------------------------------------------------------------------------------------


def test_s_max_from_is_none_until_a_round_is_stale():
    assert s_max_from(0.0) is None
    assert s_max_from(-1.0) is None
    assert s_max_from(0.4) == 1
    assert s_max_from(4.7) == 5


def test_staleness_bound_decays_from_s_max_to_one():
    assert staleness_bound(1, 5, 0.9) == 5  # clip(int(5) + 1, 1, 5)
    assert staleness_bound(2, 5, 0.9) == 5  # int(4.5) + 1
    assert staleness_bound(10, 5, 0.9) == 2  # int(5 * 0.9**9 = 1.937) + 1
    assert staleness_bound(30, 5, 0.9) == 1  # int(0.236) + 1
    assert staleness_bound(1, 1, 0.9) == 1
    assert staleness_bound(7, None, 0.9) is None
    with pytest.raises(ValueError, match="t"):
        staleness_bound(0, 5, 0.9)


def test_bound_state_sets_s_max_once_and_round_trips():
    state = BoundState()
    assert state.bound(1) is None
    state.observe_round(0.0)
    assert state.s_max is None and state.bound(3) is None
    state.observe_round(4.2)
    assert state.s_max == 5
    state.observe_round(9.0)  # kept from the first stale round
    assert state.s_max == 5
    assert state.bound(1) == 5 and state.bound(10, decay=0.9) == 2
    assert BoundState.from_dict(json.loads(json.dumps(state.to_dict()))) == state
    assert BoundState.from_dict(BoundState().to_dict()) == BoundState()


def test_should_apply():
    assert should_apply([0], 0, 2)  # mean 0 <= 0
    assert not should_apply([2], 0, 2)  # mean 2 > 0, one pending < K
    assert should_apply([2, 0], 0, 2)  # mean 1 > 0 but |P| = K
    assert should_apply([3, 1], 2, 5)  # mean 2 <= 2
    assert not should_apply([3, 2], 2, 5)  # mean 2.5 > 2
    assert should_apply([100], None, 5)  # unbounded
    assert not should_apply([], None, 1)


def test_staleness_weight():
    assert [staleness_weight(s, "none") for s in (0, 1, 2, 8)] == [1.0] * 4
    weights = [staleness_weight(s, "inverse_power") for s in (0, 1, 2, 8)]
    assert weights == pytest.approx([1.0, 1.0, 0.7937, 0.5], abs=1e-4)
    assert staleness_weight(8, "inverse_power", kappa=1.0) == pytest.approx(0.125)
    with pytest.raises(ValueError, match="staleness"):
        staleness_weight(-1, "none")
    with pytest.raises(ValueError, match="rule"):
        staleness_weight(1, "linear")  # type: ignore[arg-type]


# -- schedule ---------------------------------------------------------------------------------------


def test_hand_worked_schedule_bound_0_trigger_k_2():
    """2 lanes, 5 jobs ready at 0, latencies 1, 3, 1.5, 1, 2; bound 0, trigger_k 2, apply_s 0.

    t=0    job 0 starts on lane 0 (v0), job 1 on lane 1 (v0); they end at 1.0 and 3.0.
    t=1.0  job 0 lands: s = 0-0 = 0, P=[0], mean 0 <= 0 -> apply (version 0 -> 1).
           job 2 starts on lane 0 and reads v1 (the application at exactly 1.0 counts); ends 2.5.
    t=2.5  job 2 lands: s = 1-1 = 0 -> apply (1 -> 2). Job 3 starts on lane 0 (v2); ends 3.5.
    t=3.0  job 1 lands: s = 2-0 = 2, P=[2], mean 2 > 0, |P| 1 < 2 -> wait.
           job 4 starts on lane 1 (v2); ends 5.0.
    t=3.5  job 3 lands: s = 2-2 = 0, P=[2, 0], |P| = 2 >= K -> apply jobs 1, 3 (2 -> 3).
    t=5.0  job 4 lands: s = 3-2 = 1, P=[1], mean 1 > 0 -> wait; the last job has landed, so P is
           applied anyway (3 -> 4). Makespan 5.0, mean staleness (0+2+0+0+1)/5 = 0.6.
    """
    schedule = simulate([0.0] * 5, [1.0, 3.0, 1.5, 1.0, 2.0], lanes=2, start_version=0, bound=0, trigger_k=2)
    assert schedule.jobs == (
        ScheduledJob(job=0, lane=0, start_s=0.0, end_s=1.0, snapshot_version=0),
        ScheduledJob(job=1, lane=1, start_s=0.0, end_s=3.0, snapshot_version=0),
        ScheduledJob(job=2, lane=0, start_s=1.0, end_s=2.5, snapshot_version=1),
        ScheduledJob(job=3, lane=0, start_s=2.5, end_s=3.5, snapshot_version=2),
        ScheduledJob(job=4, lane=1, start_s=3.0, end_s=5.0, snapshot_version=2),
    )
    assert schedule.applications == (
        Application(version=0, jobs=(0,), staleness=(0,)),
        Application(version=1, jobs=(2,), staleness=(0,)),
        Application(version=2, jobs=(1, 3), staleness=(2, 0)),
        Application(version=3, jobs=(4,), staleness=(1,)),
    )
    assert (schedule.start_version, schedule.final_version, schedule.makespan_s) == (0, 4, 5.0)
    assert [schedule.staleness_of(j) for j in range(5)] == [0, 2, 0, 0, 1]
    assert schedule.mean_staleness == pytest.approx(0.6)


def test_hand_worked_schedule_unbounded_applies_every_gradient_alone():
    """2 lanes, 4 jobs ready at 0, latencies 2, 1, 1, 1; bound None (every landing applies).

    t=0    job 0 on lane 0 (v0, ends 2), job 1 on lane 1 (v0, ends 1).
    t=1    job 1 lands: s=0, apply (0 -> 1). Job 2 starts on lane 1 (v1), ends 2.
    t=2    job 0 lands first (lower index): s = 1-0 = 1, apply (1 -> 2); then job 2: s = 2-1 = 1,
           apply (2 -> 3). Both lanes are free; job 3 takes lane 0 and reads v3, ends 3.
    t=3    job 3 lands: s=0, apply (3 -> 4).
    """
    schedule = simulate([0.0] * 4, [2.0, 1.0, 1.0, 1.0], lanes=2, start_version=0, bound=None, trigger_k=8)
    assert [(j.lane, j.start_s, j.snapshot_version) for j in schedule.jobs] == [
        (0, 0.0, 0), (1, 0.0, 0), (1, 1.0, 1), (0, 2.0, 3)]
    assert schedule.applications == (
        Application(version=0, jobs=(1,), staleness=(0,)),
        Application(version=1, jobs=(0,), staleness=(1,)),
        Application(version=2, jobs=(2,), staleness=(1,)),
        Application(version=3, jobs=(3,), staleness=(0,)),
    )
    assert schedule.final_version == 4 and schedule.makespan_s == 3.0


def test_one_lane_unbounded_is_synchronous():
    latencies = LatencyModel().draw([512] * 6, np.random.default_rng(0), [True] + [False] * 5)
    schedule = simulate([0.0] * 6, latencies, lanes=1, start_version=7, bound=None, trigger_k=4)
    assert [schedule.staleness_of(j) for j in range(6)] == [0] * 6
    assert [j.snapshot_version for j in schedule.jobs] == list(range(7, 13))
    assert [a.version for a in schedule.applications] == list(range(7, 13))
    assert schedule.final_version == 13 and schedule.mean_staleness == 0.0


def test_same_inputs_give_the_same_schedule():
    rng = np.random.default_rng(3)
    ready = sorted(rng.uniform(0, 0.5, size=20).tolist())
    latencies = LatencyModel().draw([256] * 20, rng, [False] * 20)
    runs = [simulate(ready, latencies, lanes=4, start_version=2, bound=1, trigger_k=3) for _ in range(2)]
    assert runs[0] == runs[1]
    assert sorted(j for a in runs[0].applications for j in a.jobs) == list(range(20))  # none dropped


def test_ready_times_delay_starts():
    schedule = simulate([0.0, 5.0], [1.0, 1.0], lanes=2, start_version=0, bound=None, trigger_k=1)
    assert [(j.lane, j.start_s, j.snapshot_version) for j in schedule.jobs] == [(0, 0.0, 0), (0, 5.0, 1)]
    assert schedule.makespan_s == 6.0


def test_a_job_waits_for_the_one_ahead_of_it():
    # Job 1 is not ready until 3; job 2 is ready at once but the queue is FIFO, so it starts at 3 too.
    schedule = simulate([0.0, 3.0, 0.0], [1.0, 1.0, 1.0], lanes=3, start_version=0, bound=None, trigger_k=1)
    assert [j.start_s for j in schedule.jobs] == [0.0, 3.0, 3.0]
    assert [j.lane for j in schedule.jobs] == [0, 0, 1]


def test_apply_time_hides_an_application_from_a_job_that_starts_before_it_ends():
    # Job 0 lands at 1 and its application ends at 1.5; job 1 starts at 1 and still reads v0.
    schedule = simulate([0.0, 0.0], [1.0, 1.0], lanes=1, start_version=0, bound=None, trigger_k=1, apply_s=0.5)
    assert [j.snapshot_version for j in schedule.jobs] == [0, 0]
    assert schedule.staleness_of(1) == 1
    assert schedule.makespan_s == 2.5


def test_landings_while_the_server_is_busy_form_one_group():
    # 3 lanes, latencies 1, 1.2, 1.4, apply_s 0.5, unbounded: job 0 lands at 1 and is applied alone
    # (busy until 1.5); jobs 1 and 2 land at 1.2 and 1.4 while it is busy, and at 1.5 the server takes
    # both at v1 (staleness 1 each), checks the trigger once and applies them as one group (ends at 2).
    schedule = simulate([0.0] * 3, [1.0, 1.2, 1.4], lanes=3, start_version=0, bound=None, trigger_k=9, apply_s=0.5)
    assert schedule.applications == (Application(version=0, jobs=(0,), staleness=(0,)),
                                     Application(version=1, jobs=(1, 2), staleness=(1, 1)))
    assert schedule.makespan_s == 2.0


def test_a_busy_server_checks_the_trigger_once_for_what_waited():
    # bound 0, trigger_k 3, apply_s 0.5; one lane per job, latencies 1, 1.1, 1.2, 3.
    # t=1: job 0 lands fresh (s=0), applied alone, busy until 1.5. Jobs 1 and 2 (read v0) wait and
    # are taken at 1.5 at v1: s=1 each, mean 1 > 0 and 2 < 3, so they stay pending. Job 3 (v0) lands
    # at 3 with s=1: three pending, |P| = 3 >= K, applied together.
    schedule = simulate([0.0] * 4, [1.0, 1.1, 1.2, 3.0], lanes=4, start_version=0, bound=0, trigger_k=3, apply_s=0.5)
    assert schedule.applications == (Application(version=0, jobs=(0,), staleness=(0,)),
                                      Application(version=1, jobs=(1, 2, 3), staleness=(1, 1, 1)))


def test_no_jobs():
    schedule = simulate([], [], lanes=2, start_version=4, bound=None, trigger_k=1)
    assert schedule == GradientSchedule(jobs=(), applications=(), start_version=4, final_version=4, makespan_s=0.0)
    assert schedule.mean_staleness == 0.0


def test_json_round_trip():
    schedule = simulate([0.0] * 5, [1.0, 3.0, 1.5, 1.0, 2.0], lanes=2, start_version=3, bound=0, trigger_k=2)
    assert GradientSchedule.from_dict(json.loads(json.dumps(schedule.to_dict()))) == schedule


@pytest.mark.parametrize(("kwargs", "name"), [
    (dict(ready_s=[0.0, 0.0], latency_s=[1.0]), "latency_s"),
    (dict(lanes=0), "lanes"),
    (dict(trigger_k=0), "trigger_k"),
    (dict(latency_s=[1.0, -0.1]), "latency_s"),
])
def test_invalid_inputs_name_the_argument(kwargs, name):
    args = dict(ready_s=[0.0, 0.0], latency_s=[1.0, 1.0], lanes=1, start_version=0, bound=None, trigger_k=1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        simulate(args.pop("ready_s"), args.pop("latency_s"), **args)


def test_latency_model_draw():
    exact = LatencyModel(jitter=0.0).draw([0, 1000], np.random.default_rng(0), [True, False])
    assert exact == pytest.approx([0.25, 0.02 + 2e-5 * 1000], abs=1e-12)
    model = LatencyModel()
    first = model.draw([100] * 8, np.random.default_rng(5), [False] * 8)
    assert first == model.draw([100] * 8, np.random.default_rng(5), [False] * 8)
    assert len(set(first)) == 8 and all(x > 0 for x in first)
    with pytest.raises(ValueError, match="cold"):
        model.draw([1, 2], np.random.default_rng(0), [True])
