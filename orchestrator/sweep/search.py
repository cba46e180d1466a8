"""A searching sweep's proposals: Optuna (TPE, its pruners, its constraints) asked for each next point,
told how each ended, its study rebuilt from orch's records whenever the sweep runs.

SQLite stays the truth: the study lives in memory, made again from the sweep's points every time the file
runs (and, with warm_start, from earlier sweeps' runs), so a resumed search never runs a finished point
again and never depends on a file of the optimizer's. Each lane (a host, or a GPU set of one) asks for
its next point when it is free; a later stage waits until the earlier one has ended, then searches its
keys with the best point so far fixed.
"""

from __future__ import annotations

import json
import math
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..config.hosts import Host
from ..config.objective import Objective, best
from ..errors import OrchError
from ..store import Store
from ..store import sweeps as stored_sweeps
from ..store.record import RunRecord, Status
from . import db, outcome
from .plan import Plan, Point, label, point_key
from .policy import Action, Decision, Verdict
from .record import Fault, PointRow, PointStatus, SweepStatus
from .space import Dimension, Search, Stage

DUPLICATES_MAX = 100  # proposals in a row of points already tried: the space has nothing new left
FINISHED = (PointStatus.SUCCEEDED, PointStatus.PRUNED, PointStatus.INFEASIBLE, PointStatus.FAILED)
PRUNED_REASON = "pruned"
CRASH = "crash"  # the constraint a crash breaks (the others are named after the bounded metrics)
INFERRED = "inferred"  # a proposal next to a crash, told crashed without a run
AVOID_MAX = 50  # proposals in a row set aside as next to a crash, before one is run anyway
AVOID_RADIUS = 0.5  # how near a crash a proposal is passed over: half a range (a differing choice is 1 apart)
CAUSE = "cause"  # a crashed trial's cause, as outcome.py names it
SAME_CAUSE_DROPS = 2  # crashes of one cause with a choice (other settings differing) that drop the choice


def _optuna() -> Any:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    return optuna


def distribution(dim: Dimension) -> Any:
    d = _optuna().distributions
    if dim.choices is not None:
        return d.CategoricalDistribution(dim.choices)
    assert dim.low is not None and dim.high is not None
    if dim.integer:
        return d.IntDistribution(int(dim.low), int(dim.high), log=dim.log, step=int(dim.step or 1))
    return d.FloatDistribution(dim.low, dim.high, log=dim.log, step=dim.step)


def _position(dim: Dimension, value: Any) -> float | str:
    """Where a value lies in its range, 0 to 1 (on the log scale with log); a choice is itself."""
    if dim.choices is not None:
        return json.dumps(value)
    assert dim.low is not None and dim.high is not None
    if dim.high == dim.low:
        return 0.0
    if dim.log:
        return (math.log(value) - math.log(dim.low)) / (math.log(dim.high) - math.log(dim.low))
    return (value - dim.low) / (dim.high - dim.low)


def distance(space: dict[str, Dimension], a: dict[str, Any], b: dict[str, Any]) -> float:
    """How far apart two points of a space are: each range scaled to 0..1, a differing choice 1 apart."""
    total = 0.0
    for key, dim in space.items():
        pa, pb = _position(dim, a[key]), _position(dim, b[key])
        if isinstance(pa, str) or isinstance(pb, str):
            total += 0.0 if pa == pb else 1.0
        else:
            total += (pa - pb) ** 2
    return math.sqrt(total)


def near_crash(study: Any, space: dict[str, Dimension], params: dict[str, Any]) -> bool:
    """Whether a proposal lies nearer a crash (for a cause of its settings) than any trial that ran, and
    within AVOID_RADIUS of it (so with the crash's choices, and a crash near the best only shades the
    border of its own region). TPE counts a crash as one more point outside the
    best, so with few trials it comes back to a crashing region about as often as to any mediocre one; and
    a crash costs a server start and teaches nothing new the second time."""
    ended = [t for t in study.get_trials(deepcopy=False) if t.state.is_finished() and t.state.name != "FAIL"
             and not t.user_attrs.get(INFERRED) and all(k in t.params for k in space)]
    crash = min((distance(space, t.params, params) for t in ended if t.constraints.get(CRASH, 0.0) > 0),
                default=math.inf)
    ran = min((distance(space, t.params, params) for t in ended if t.constraints.get(CRASH, 0.0) <= 0),
              default=math.inf)
    return crash < min(ran, AVOID_RADIUS)


def dropped(study: Any, space: dict[str, Dimension]) -> dict[str, set[str]]:
    """The choices not to propose again (per key, as `_position` spells them): a choice whose trials
    crashed and never ran, when either the crash's cause concerns that key alone among the searched keys
    (the KV cache too small, and the KV size the only searched key it hangs on), or SAME_CAUSE_DROPS of them
    crashed for the same cause (their other settings differed: the choice is the common factor). A choice
    that ran once is kept (other settings made it crash); so is every choice of a key when all would go."""
    trials = [t for t in study.get_trials(deepcopy=False) if t.state.is_finished() and t.state.name != "FAIL"
              and not t.user_attrs.get(INFERRED) and all(k in t.params for k in space)]
    crashes = [t for t in trials if t.constraints.get(CRASH, 0.0) > 0]
    found: dict[str, set[str]] = {}
    for key, dim in space.items():
        if dim.choices is None:
            continue
        ran = {_position(dim, t.params[key]) for t in trials if t.constraints.get(CRASH, 0.0) <= 0}
        gone = set()
        for choice in (_position(dim, c) for c in dim.choices):
            causes = [t.user_attrs.get(CAUSE) for t in crashes if _position(dim, t.params[key]) == choice]
            if choice in ran or not causes:
                continue
            alone = any(c and outcome.concerns(c, key) and not any(outcome.concerns(c, k) for k in space if k != key)
                        for c in causes)
            if alone or any(causes.count(c) >= SAME_CAUSE_DROPS for c in set(causes) if c):
                gone.add(str(choice))
        if gone and len(gone) < len(dim.choices):
            found[key] = gone
    return found


def has_dropped(gone: dict[str, set[str]], space: dict[str, Dimension], params: dict[str, Any]) -> bool:
    """Whether a proposal holds a choice `dropped` says not to propose again."""
    return any(str(_position(space[k], params[k])) in choices for k, choices in gone.items())


def suggest(trial: Any, key: str, dim: Dimension) -> Any:
    if dim.choices is not None:
        return trial.suggest_categorical(key, dim.choices)
    assert dim.low is not None and dim.high is not None
    if dim.integer:
        return trial.suggest_int(key, int(dim.low), int(dim.high), log=dim.log, step=int(dim.step or 1))
    return trial.suggest_float(key, dim.low, dim.high, log=dim.log, step=dim.step)


def new_study(search: Search, stage: int, objective: Objective) -> Any:
    """A stage's empty study: multivariate TPE (the keys of a server interact), its constant liar (lanes
    that ask while others run get different points), its random start scaled to the budget."""
    optuna = _optuna()
    seed = None if search.seed is None else search.seed + stage
    sampler = optuna.samplers.TPESampler(
        seed=seed, n_startup_trials=search.startup(stage), constant_liar=True, multivariate=True)
    direction = "maximize" if objective.goal == "max" else "minimize"
    return optuna.create_study(direction=direction, sampler=sampler, pruner=pruner(search, stage))


def pruner(search: Search, stage: int) -> Any:
    pruners = _optuna().pruners
    s, startup = search, search.startup(stage)
    return {
        "median": lambda: pruners.MedianPruner(n_startup_trials=startup, n_warmup_steps=s.warmup_steps),
        "percentile": lambda: pruners.PercentilePruner(25.0, n_startup_trials=startup,
                                                       n_warmup_steps=s.warmup_steps),
        "hyperband": lambda: pruners.HyperbandPruner(min_resource=max(1, s.warmup_steps)),
        "successive_halving": lambda: pruners.SuccessiveHalvingPruner(min_resource=max(1, s.warmup_steps)),
        "none": lambda: pruners.NopPruner(),
    }[s.pruner]()


def start(study: Any, space: dict[str, Dimension], spec: dict[str, Any]) -> None:
    """A search with no history tries first what a person would: the spec's values (the middle of a range
    the spec leaves open); Optuna's advice for known-good settings is to enqueue them."""
    if not study.trials:
        study.enqueue_trial({k: d.start(_dotted(spec, k)) for k, d in space.items()})


def ask(study: Any, space: dict[str, Dimension]) -> tuple[Any, dict[str, Any]]:
    """The optimizer's next proposal that neither has a dropped choice (`dropped`) nor lies next to a crash.
    One that does is not run: the optimizer is told it would crash (marked `inferred`, and no crash of its
    own for `near_crash` and `dropped`), so that its model moves away instead of proposing it again; up to
    AVOID_MAX in a row."""
    gone = dropped(study, space)
    for _ in range(AVOID_MAX):
        trial = study.ask()
        params = {k: suggest(trial, k, d) for k, d in space.items()}
        if not has_dropped(gone, space, params) and not near_crash(study, space, params):
            return trial, params
        trial.set_user_attr(INFERRED, True)
        trial.set_constraint(CRASH, math.inf)
        study.tell(trial, state=_optuna().trial.TrialState.PRUNED)
    trial = study.ask()
    return trial, {k: suggest(trial, k, d) for k, d in space.items()}


def tell(trial: Any, t: Told) -> None:
    optuna = _optuna()
    if t.cause:
        trial.set_user_attr(CAUSE, t.cause)
    for name, v in t.constraints.items():
        trial.set_constraint(name, v)
    state = getattr(optuna.trial.TrialState, t.state)
    trial.study.tell(trial, t.value if state is optuna.trial.TrialState.COMPLETE else None, state=state)


# what a finished point tells the optimizer ---------------------------------------------------------------
@dataclass(frozen=True)
class Told:
    """A finished point as the optimizer takes it: state (COMPLETE, PRUNED, FAIL), value, constraint values
    (`crash`, and one per bound: > 0 is infeasible), intermediate values (step -> value), a crash's cause."""

    state: str
    value: float | None
    constraints: dict[str, float]
    steps: dict[int, float]
    cause: str | None = None


def told(pt: PointRow, run: RunRecord | None, metrics: dict[str, float], series: list[float],
         objective: Objective, bounds: dict[str, Any]) -> Told:
    """What a finished point's record says to the optimizer."""
    steps = dict(enumerate(series))
    if pt.status is PointStatus.FAILED:
        if why := outcome.cause_of(pt.fault is Fault.JOB, pt.reason, run):
            return crashed(bounds, why)  # its region is infeasible
        return Told("FAIL", None, {}, {})
    value = outcome.value(metrics, objective.metric)
    if pt.status is PointStatus.PRUNED:  # a bound not yet measured is no violation
        return Told("PRUNED", None, {CRASH: 0.0, **{m: max(0.0, c.violation(metrics[m])) if m in metrics else 0.0
                                                    for m, c in bounds.items()}}, steps)
    if value is None or run is None or outcome.invalid(run):
        return Told("FAIL", None, {}, {})
    return Told("COMPLETE", value, {CRASH: 0.0, **dict(zip(bounds, outcome.violations(bounds, metrics)))}, steps)


def crashed(bounds: dict[str, Any], cause: str | None = None) -> Told:
    """A point the settings crashed (or the playbook refused): infeasible, with no value, and worse than any
    bound broken by a measured point. TPE ranks infeasible trials by their summed violations and, while
    none is feasible, models its best region on the least infeasible: a crash at 1.0 beside a latency 3
    times its bound would be that region, and the search would head for the crash."""
    return Told("PRUNED", None, {CRASH: math.inf, **{m: 0.0 for m in bounds}}, {}, cause)


class Searcher:
    """The optimizer of one searching sweep, shared by its lanes (every call holds one lock)."""

    def __init__(self, store: Store, p: Plan, sweep_id: int, echo: Callable[[str], None]):
        assert p.search is not None and p.file.objective is not None
        self.store, self.plan, self.sweep_id, self.echo = store, p, sweep_id, echo
        self.search: Search = p.search
        self.objective: Objective = p.file.objective
        self.cond = threading.Condition()
        self.stage = 0
        self.studies: dict[int, Any] = {}
        self.live: dict[int, Any] = {}  # point index -> its Optuna trial while it runs
        self.reported: dict[int, int] = {}  # point index -> samples reported as intermediate values
        self.pruned: dict[int, str] = {}  # point index -> why the pruner stopped it
        self.again: list[PointRow] = []  # points an earlier controller left unfinished: run before new ones
        self.exhausted: set[int] = set()  # stages whose space has no untried point left
        self.stopped = False
        self._load()

    # the study, from the records ------------------------------------------------------------------
    def _study(self, stage: int) -> Any:
        if stage not in self.studies:
            self.studies[stage] = new_study(self.search, stage, self.objective)
        return self.studies[stage]

    def _add(self, stage: int, params: dict[str, Any], t: Told, attrs: dict[str, Any]) -> None:
        """A finished trial, from the records, into the stage's study."""
        optuna = _optuna()
        dims = self.search.stages[stage].space
        if any(k not in params or not dims[k].contains(params[k]) for k in dims):
            return  # outside this space (an earlier sweep's point): nothing to learn here
        state = getattr(optuna.trial.TrialState, t.state)
        trial = optuna.trial.create_trial(
            state=state, value=t.value if state is optuna.trial.TrialState.COMPLETE else None,
            params={k: params[k] for k in dims}, distributions={k: distribution(d) for k, d in dims.items()},
            intermediate_values=t.steps if state is not optuna.trial.TrialState.FAIL else None,
            user_attrs={**attrs, **({CAUSE: t.cause} if t.cause else {})}, constraints=t.constraints or None)
        self._study(stage).add_trial(trial)

    def _load(self) -> None:
        """The studies rebuilt from this sweep's finished points (and earlier sweeps', with warm_start);
        its unfinished points queued to run first."""
        if self.search.warm_start:
            n = self._warm_start()
            if n:
                self.echo(f"warm start: {n} point(s) of earlier sweeps")
        for pt in db.points(self.store, self.sweep_id):
            stage = self.search.stage_of(pt.diff)
            self.stage = max(self.stage, stage)
            pt = self._pruned_before(pt)
            if pt.status in FINISHED:
                self._add(stage, pt.diff, self._told(pt), {"point": pt.index})
            else:
                self.again.append(pt)

    def _pruned_before(self, pt: PointRow) -> PointRow:
        """A point whose controller died while it stopped the point's run as a loser: pruned, as decided."""
        run = self.store.get_run(pt.run_id) if pt.run_id else None
        if (pt.status is PointStatus.QUEUED and run is not None and run.status is Status.CANCELLED
                and (run.reason or "").startswith(PRUNED_REASON)):
            db.settle_point(self.store, self.sweep_id, pt.index, PointStatus.PRUNED, reason=run.reason)
            return db.point(self.store, self.sweep_id, pt.index)
        return pt

    def _told(self, pt: PointRow) -> Told:
        run = self.store.get_run(pt.run_id) if pt.run_id else None
        metrics = outcome.measured(self.store, run) if run is not None else {}
        series = [v for _, v, _ in self.store.metric_series(pt.run_id, self.objective.metric)] if pt.run_id else []
        return told(pt, run, metrics, series, self.objective, self.plan.constraints)

    def _warm_start(self) -> int:
        """Earlier sweeps of this playbook on the same model and the same kind of host (its tags), with the
        same objective: each of their finished runs, its spec's values at the first stage's keys."""
        mine = _kind(self.plan.file.spec, sorted({t for h in self.plan.hosts for t in h.tags}))
        added = 0
        for row in stored_sweeps.of_playbook(self.store, self.plan.file.playbook, self.sweep_id):
            doc = row["doc"] or {}
            if (doc.get("objective") or {}).get("metric") != self.objective.metric:
                continue
            for pt in db.points(self.store, row["id"]):
                if pt.status not in FINISHED or not pt.run_id:
                    continue
                run = self.store.get_run(pt.run_id)
                tags = sorted({t for h in self.plan.hosts if h.name == run.host for t in h.tags}) or \
                    sorted(set(doc.get("tags") or []))
                if _kind(run.spec, tags) != mine:
                    continue
                params = {k: _dotted(run.spec, k) for k in self.search.stages[0].space}
                before = len(self._study(0).trials)
                self._add(0, params, self._told(pt), {"warm_start": row["id"]})
                added += len(self._study(0).trials) - before
        return added

    # proposing -------------------------------------------------------------------------------------
    def lane(self, host: Host, gpus: list[int] | None) -> Iterator[Point]:
        """The points one lane runs, one at a time: left-over points first, then proposals, until the
        search is over (or cancelled)."""
        while (pt := self.next(host, gpus)) is not None:
            yield pt

    def next(self, host: Host, gpus: list[int] | None) -> Point | None:
        with self.cond:
            while not self.stopped:
                if db.sweep(self.store, self.sweep_id).status is SweepStatus.CANCELLED:
                    return None  # `sweep cancel`: no new point; what is left is run when the file runs again
                # a left-over point whose run still goes is its host's lane's; any other, any lane's
                mine = [p for p in self.again if (p.host, p.gpus) == (host.name, gpus) or not self._live(p)]
                if mine:
                    return self._rerun(mine[0], host, gpus)
                stage = self.search.stages[self.stage]
                rows = [p for p in db.points(self.store, self.sweep_id) if self.search.stage_of(p.diff) == self.stage]
                if len(rows) < stage.trials and self.stage not in self.exhausted:
                    pt = self._propose(stage, rows, host, gpus)
                    if pt is not None:
                        return pt
                    continue  # an invalid proposal was recorded as such: ask again
                if self.again or any(p.status not in FINISHED and p.status is not PointStatus.CANCELLED for p in rows):
                    self.cond.wait(0.5)  # this stage's last points still run: the next one needs their best
                    continue
                if self.stage + 1 >= len(self.search.stages):
                    return None
                self.stage += 1
                self.echo(f"stage {self.stage}: {', '.join(self.search.stages[self.stage].space)} with "
                          f"{label(self._fixed()) if self._fixed() else 'the base spec'} fixed")
            return None

    def _live(self, row: PointRow) -> bool:
        run = self.store.get_run(row.run_id) if row.run_id else None
        return run is not None and not run.status.terminal

    def _fixed(self) -> dict[str, Any]:
        """What the current stage keeps fixed: the best point of the earlier stages (as its points recorded)."""
        keys = set(self.search.stages[self.stage].space)
        rows = db.points(self.store, self.sweep_id)
        for p in rows:
            if self.search.stage_of(p.diff) == self.stage:
                return {k: v for k, v in p.diff.items() if k not in keys}
        done = [(p, outcome.measured(self.store, self.store.get_run(p.run_id))) for p in rows
                if p.status is PointStatus.SUCCEEDED and p.run_id and self.search.stage_of(p.diff) < self.stage]
        found = best(self.objective, done)
        return {} if found is None else {k: v for k, v in found[0].diff.items() if k not in keys}

    def _propose(self, stage: Stage, rows: list[PointRow], host: Host, gpus: list[int] | None) -> Point | None:
        study = self._study(self.stage)
        fixed = self._fixed() if self.stage else {}
        tried = {p.key: p for p in rows}
        if not rows:
            start(study, stage.space, self.plan.file.spec)
        for _ in range(DUPLICATES_MAX):
            trial, params = ask(study, stage.space)
            diff = {**fixed, **params}
            seen = tried.get(point_key(diff))
            if seen is None:
                return self._new(trial, diff, host, gpus)
            # proposed again: it is not run again; the optimizer learns what it came to (or that it runs)
            if seen.status in FINISHED:
                self._tell(trial, self._told(seen))
            else:
                study.tell(trial, state=_optuna().trial.TrialState.FAIL)
        self.echo(f"stage {self.stage}: {DUPLICATES_MAX} proposals in a row were points already tried; it ends here")
        self.exhausted.add(self.stage)
        return None

    def _new(self, trial: Any, diff: dict[str, Any], host: Host, gpus: list[int] | None) -> Point | None:
        index = len(db.points(self.store, self.sweep_id))
        stored_sweeps.add_point(self.store, self.sweep_id, {
            "index": index, "point": point_key(diff), "host": host.name, "gpus": gpus,
            "status": PointStatus.QUEUED.value})
        try:
            pt = self.plan.point(index, diff, host, gpus)
            from .. import runflow

            runflow.check(self.store, self.plan.playbook, pt.spec, host)
        except OrchError as exc:  # settings the playbook refuses: a config error, learnt without a run
            # (the job's fault, as a crash is: the same file never runs it again)
            db.settle_point(self.store, self.sweep_id, index, PointStatus.FAILED,
                            reason=f"{outcome.CONFIG_ERROR}: {exc}", fault=Fault.JOB)
            self._tell(trial, crashed(self.plan.constraints, outcome.CONFIG_ERROR))
            self.echo(f"point {index} ({label(diff)}): refused before it ran: {exc}")
            return None
        self.live[index] = trial
        return pt

    def _rerun(self, row: PointRow, host: Host, gpus: list[int] | None) -> Point:
        """A point an earlier controller left unfinished, on this lane (its run, if still going, is watched
        again by the lane of its own host: left-over points go to their host's lane first)."""
        self.again.remove(row)
        if (row.host, row.gpus) != (host.name, gpus):
            stored_sweeps.set_point_host(self.store, self.sweep_id, row.index, host.name, gpus)
        study = self._study(self.search.stage_of(row.diff))
        dims = self.search.stages[self.search.stage_of(row.diff)].space
        study.enqueue_trial({k: row.diff[k] for k in dims}, skip_if_exists=False)
        self.live[row.index] = study.ask({k: distribution(d) for k, d in dims.items()})
        return self.plan.point(row.index, row.diff, host, gpus)

    # while a point runs: its live samples ---------------------------------------------------------------
    def watch(self, store: Store, pt: Point, run: RunRecord) -> str | None:
        """Report the objective's new samples as intermediate values; why to stop the run, when the pruner
        says it is a loser (once)."""
        with self.cond:
            trial = self.live.get(pt.index)
            if trial is None or pt.index in self.pruned or run.status is not Status.RUNNING:
                return None
            series = [v for _, v, _ in store.metric_series(run.id, self.objective.metric)]
            # sample by sample, the pruner asked after each: where a loser is stopped depends on its values,
            # not on how many samples one reading happened to bring
            for step in range(self.reported.get(pt.index, 0), len(series)):
                trial.report(series[step], step)
                self.reported[pt.index] = step + 1
                if trial.should_prune():
                    why = (f"{PRUNED_REASON} at sample {step + 1}: {self.objective.metric}={series[step]:g} "
                           f"({self.search.pruner} pruner)")
                    self.pruned[pt.index] = why
                    return why
            return None

    # after a point ended ---------------------------------------------------------------------------------
    def judge(self, store: Store, pt: Point, verdict: Verdict, run_id: int | None, decision: Decision) -> \
            tuple[Decision, str | None]:
        """What the search makes of a point's end: pruned, infeasible by a bound, no value, or the crash's
        cause. Returns the decision to record and its reason (None: the attempt's own)."""
        if pt.index in self.pruned and verdict is Verdict.CANCELLED:
            return Decision(Action.DONE, PointStatus.PRUNED), self.pruned[pt.index]
        if run_id is None:
            return decision, None
        run = store.get_run(run_id)
        if outcome.invalid(run):  # its benchmark's own checks refused it: no value, and no rerun either
            return Decision(Action.FAIL, PointStatus.FAILED, Fault.JOB), f"invalid: {run.invalid}"
        if decision.status is PointStatus.SUCCEEDED:
            metrics = outcome.measured(store, run)
            if outcome.value(metrics, self.objective.metric) is None:
                return (Decision(Action.FAIL, PointStatus.FAILED, Fault.JOB),
                        f"no value: the run recorded no {self.objective.metric}")
            broke = outcome.broken(self.plan.constraints, metrics)
            if broke:
                return Decision(Action.DONE, PointStatus.INFEASIBLE), "infeasible: " + "; ".join(broke)
        if decision.fault is Fault.JOB and (why := outcome.cause(run)):
            return decision, f"{why}: {run.reason or 'failed'}"
        return decision, None

    def ended(self, pt: Point) -> None:
        """The point's end is recorded (or it goes back to the queue): tell the optimizer, wake the lanes."""
        with self.cond:
            row = db.point(self.store, self.sweep_id, pt.index)
            trial = self.live.get(pt.index)
            if trial is not None and row.status in (*FINISHED, PointStatus.CANCELLED):
                t = self._told(row) if row.status is not PointStatus.CANCELLED else Told("FAIL", None, {}, {})
                for step in range(self.reported.get(pt.index, 0), len(t.steps)):
                    trial.report(t.steps[step], step)
                self._tell(trial, t)
                del self.live[pt.index]
            self.cond.notify_all()

    def _tell(self, trial: Any, t: Told) -> None:
        tell(trial, t)

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()


def _dotted(values: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        if not isinstance(values, dict) or part not in values:
            return None
        values = values[part]
    if key.startswith("env.") and isinstance(values, str):
        try:
            return json.loads(values)
        except ValueError:
            return values
    return values


def _kind(spec: dict[str, Any], tags: list[str]) -> tuple[str, str, tuple[str, ...]]:
    """What makes earlier runs comparable: the model, the engine, the kind of host (its tags)."""
    return (str(spec.get("model")), str(spec.get("engine") or spec.get("image")), tuple(tags))


IMPORTANCE_MIN = 5  # succeeded points of a stage before its keys' importances mean anything


def importances(search: Search, objective: Objective, points: list[dict[str, Any]]) -> dict[str, float] | None:
    """Which keys mattered (Optuna's importance evaluator over each stage's succeeded points, each stage's
    shares summing to 1); None until a stage has IMPORTANCE_MIN of them."""
    optuna = _optuna()
    found: dict[str, float] = {}
    for n, stage in enumerate(search.stages):
        done = [p for p in points if p["status"] == "succeeded" and p["objective"] is not None
                and search.stage_of(p["point"]) == n and all(stage.space[k].contains(p["point"].get(k))
                                                             for k in stage.space)]
        if len(done) < IMPORTANCE_MIN:
            continue
        study = optuna.create_study(direction="maximize" if objective.goal == "max" else "minimize")
        dists = {k: distribution(d) for k, d in stage.space.items()}
        study.add_trials([optuna.trial.create_trial(value=p["objective"], params={k: p["point"][k] for k in dists},
                                                    distributions=dists) for p in done])
        try:
            found.update(optuna.importance.get_param_importances(study))
        except (ValueError, RuntimeError, ZeroDivisionError):
            continue  # every point alike in some key, or too few to tell: no importance for this stage
    return found or None
