"""A run's receipt (store/receipts.py has its shape): begun before the launch from what orch knows, the
host's part looked at in the launch request itself (no extra round trip), completed at the end.

The validity gate's launch-time reasons are decided here too: a benchmark whose server was not ready when
it started, and a run that holds its GPUs whose GPUs were not clean when it launched.
"""

from __future__ import annotations

import json
import posixpath
import time
from typing import Any
from urllib.parse import urlsplit

from .. import __version__
from ..errors import OrchError
from ..host import agent
from ..host.gpu import GpuSnapshot
from ..host.hostjobs.common import FACTS
from ..host.hostjobs.gpus import GPU_FACTS
from ..playbook import SERVING_PHASES, RunContext, Prepared
from ..secret_env import is_secret, masked_argv, masked_command, masked_env
from ..store.record import Status
from .context import Run

CONFIG_FILES = ("config.json", "tokenizer_config.json", "generation_config.json")
# The distributions whose versions say what made an engine's numbers (read from the engine's own python).
PACKAGES = {"vllm": ("vllm", "torch", "transformers"), "sglang": ("sglang", "sgl-kernel", "torch", "transformers"),
            "speculators": ("speculators", "vllm", "torch", "transformers")}
OTHER_PACKAGES = ("torch", "transformers")
ENGINE_SEED = {"vllm": 0, "sglang": 1}  # each benchmark's default --seed
GPU_CHECK = "gpu_check"  # the GPU step's look, on the Job's receipt until the launch takes it


def gpus_checked(run: Run, snap: GpuSnapshot) -> None:
    """The GPU step's last look before the launch (the GPUs free, with their facts): the receipt's GPUs and
    its clean check, so the launch need not ask nvidia-smi again."""
    rows = [{k: row.get(k) for k in GPU_FACTS} for row in snap.facts or []]
    apps = [{"pid": str(p.pid), "gpu_uuid": g.uuid} for g in snap.gpus for p in g.processes]
    run.receipt = {GPU_CHECK: {"gpus": rows, "gpu_apps": apps,
                               **({"gpu_error": snap.facts_error} if snap.facts_error else {})}}


def begin(run: Run, view: RunContext[Any], prepared: Prepared, command: str, env: dict[str, str],
          patches: list[dict[str, Any]]) -> None:
    """What orch knows of the run's receipt before its launch (kept on the Job until the launch sees the host)."""
    spec = run.spec
    server = _server(run)
    # A benchmark's engine is its server's (its playbook names only the format it prints by default), and it
    # runs with the server's python unless told otherwise.
    served = ((server or {}).get("receipt") or {}).get("engine") or {}
    engine = served.get("name") or run.pb.log_engine(spec) or run.pb.engine
    bench = getattr(spec, "bench", None) or spec
    marked = [*run.host.secret_env, *spec.secret_env]
    # the command lines are masked as the environment is: a secret flag's value, a credential in a URL, and
    # any env secret's value written out on the line too
    known = [str(v) for k, v in env.items() if is_secret(k, v, marked)]
    server_argv = run.pb.engine_argv(spec)
    receipt: dict[str, Any] = {
        "orch": __version__, "host": run.host.name, "playbook": run.pb.name,
        "spec": _masked_spec(run.record.spec, known),  # as stored (its env masked), its command lines too
        "engine": {"name": engine, "version": prepared.engine_version,
                   "python": spec.python or served.get("python") or view.python},
        "patches": patches,
        "argv": masked_command(command, known),
        "server_argv": None if server_argv is None else masked_argv(server_argv, known),
        "env": masked_env(env, marked),
        "launched_at": time.time(),
    }
    if GPU_CHECK in run.receipt:  # kept for the launch (its GPUs already seen), never recorded as it is
        receipt[GPU_CHECK] = run.receipt[GPU_CHECK]
    if server is not None:
        receipt["server"] = server  # the model is the server's, in its receipt
    elif _model_path(spec) is not None:
        receipt["model"] = {"path": _model_path(spec)}
    if hasattr(bench, "num_prompts"):
        receipt["dataset"] = {
            "name": getattr(bench, "dataset", None) or "default", "num_prompts": bench.num_prompts,
            "input_len": getattr(bench, "input_len", None), "output_len": getattr(bench, "output_len", None),
            "seed": _seed(list(getattr(bench, "extra_args", [])), engine)}
        receipt["warmup"] = getattr(bench, "warmup", 0)
        receipt["repeats"] = getattr(bench, "repeats", 1)
    run.receipt = receipt


def facts_request(run: Run) -> dict[str, Any] | None:
    """What the launch request looks at on the host for the receipt; None when nothing was begun."""
    r = run.receipt
    if not r:
        return None
    engine = r["engine"]["name"]
    files = []
    path = (r.get("model") or {}).get("path")
    if isinstance(path, str) and path.startswith("/"):
        files = [posixpath.join(path, name) for name in CONFIG_FILES]
    asked: dict[str, Any] = {"python": r["engine"]["python"], "packages": list(PACKAGES.get(engine, OTHER_PACKAGES)),
                             "files": files}
    if GPU_CHECK in r:
        asked["gpus"] = False  # the GPU step's last look has them
    return asked


def launched(run: Run, facts: dict[str, Any] | None) -> None:
    """Record the receipt with what the launch saw on the host; the launch-time validity reasons with it."""
    r = run.receipt
    if not r:
        return
    checked = r.pop(GPU_CHECK, None)
    if facts is not None and checked is not None:
        facts = {**facts, **checked}
    if facts:
        _host_part(r, facts)
    run.store.complete_receipt(run.run_id, r)
    for reason in _invalid_at_launch(run, facts or {}):
        run.store.mark_invalid(run.run_id, reason)
        run.event("invalid", reason)


def _host_part(r: dict[str, Any], facts: dict[str, Any]) -> dict[str, Any]:
    """The receipt's part seen on the host (or a batch job's node): hostname, the engine's versions, the
    model's config hashes, the GPUs or the CPU."""
    r["hostname"] = facts.get("hostname")
    if facts.get("node"):
        r["node"] = facts["node"]
    seen = facts.get("engine") or {}
    versions = seen.get("packages") or {}
    r["engine"]["packages"] = versions
    r["engine"]["python_version"] = seen.get("python")
    if seen.get("error"):
        r["engine"]["error"] = seen["error"]
    if r["engine"].get("version") is None:
        r["engine"]["version"] = versions.get(r["engine"]["name"])
    if "model" in r:
        r["model"]["files"] = {posixpath.basename(p): h for p, h in (facts.get("files") or {}).items()
                               if h is not None}
    gpus = facts.get("gpus")
    r["hardware"] = {"gpus": [{k: v for k, v in g.items() if k != "uuid"} for g in gpus] if gpus else None,
                     "cpu": facts.get("cpu")}
    if facts.get("gpu_error"):
        r["hardware"]["gpu_error"] = facts["gpu_error"]
    return r


def node_facts(run: Run) -> dict[str, Any] | None:
    """What a batch job saw on its node when it started (its run dir's facts file), or None: not asked, not
    started, or unreadable."""
    try:
        text = agent.call(run.transport, "tail", path=posixpath.join(run.paths.control, FACTS), lines=1)["text"]
        facts = json.loads(text)
    except (OrchError, ValueError, KeyError):
        return None
    return facts if isinstance(facts, dict) else None


def complete(run: Run, reverted: list[str]) -> None:
    """The receipt's end: how the run ended, whether it is valid, and which patch sets were reverted; a batch
    job's, the part its node showed it (the launch only submitted it)."""
    record = run.refresh()
    if record.receipt is None:
        return  # never launched, or launched by an orch that kept no receipt
    patches = [{**p, "reverted": p.get("name") in reverted} for p in record.receipt.get("patches") or []]
    parts: dict[str, Any] = {"patches": patches, "ended_at": record.ended_at, "status": record.status.value,
                             "invalid": record.invalid}
    if run.executor.queues and "hostname" not in record.receipt:
        facts = node_facts(run)
        if facts is not None:
            seen = _host_part({"engine": dict(record.receipt.get("engine") or {}),
                               **({"model": dict(record.receipt["model"])} if "model" in record.receipt else {})}, facts)
            parts.update(seen)
    run.store.complete_receipt(run.run_id, parts)


def _masked_spec(value: Any, known: list[str]) -> Any:
    """The spec's command lines (`cmd`, `extra_args`, a bench's) with their secrets masked as the job's are."""
    if isinstance(value, dict):
        return {k: _masked_spec(v, known) for k, v in value.items()}
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return masked_argv(value, known)
    if isinstance(value, list):
        return [_masked_spec(v, known) for v in value]
    return masked_command(value, known) if isinstance(value, str) else value


def _model_path(spec: Any) -> str | None:
    model = getattr(spec, "model", None)
    return model if isinstance(model, str) else None


def _seed(extra_args: list[str], engine: str | None) -> int | str | None:
    """The benchmark's --seed as given in its extra arguments, else its engine's default."""
    for i, arg in enumerate(extra_args):
        if arg == "--seed" and i + 1 < len(extra_args):
            return extra_args[i + 1]
        if arg.startswith("--seed="):
            return arg.split("=", 1)[1]
    return ENGINE_SEED.get(engine or "")


def _server(run: Run) -> dict[str, Any] | None:
    """A benchmark's server run: its id, whether it was ready when the benchmark started, and its receipt.
    A benchmark given a URL has the server run that serves it, when one of this workspace does (a server
    on the same host and port, running): a nightly benchmark of an endpoint names what its server changed."""
    server_id = getattr(run.spec, "server", None)
    if not isinstance(server_id, int):
        server_id = _serving(run, getattr(run.spec, "url", None))
    if server_id is None:
        return None
    try:
        record = run.store.get_run(server_id)
    except OrchError:
        return {"run": server_id, "ready_at_launch": False, "receipt": None}
    ready = record.status is Status.RUNNING and record.phase in SERVING_PHASES
    return {"run": server_id, "ready_at_launch": ready, "receipt": record.receipt}


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _serving(run: Run, url: Any) -> int | None:
    """The ready server run of this workspace on the benchmark's host that answers at `url` (its port on the
    host's loopback or address); None when none does, or several claim it."""
    if not isinstance(url, str):
        return None
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    if parts.hostname not in (*LOOPBACK, run.host.address):
        return None
    found = [r.id for r in run.store.list_runs(limit=1000, statuses=[Status.RUNNING.value], host=run.host.name)
             if r.id != run.run_id and r.spec.get("port") == port and r.phase in SERVING_PHASES]
    return found[0] if len(found) == 1 else None


def _invalid_at_launch(run: Run, facts: dict[str, Any]) -> list[str]:
    reasons = []
    server = run.receipt.get("server")
    if server is not None and not server["ready_at_launch"]:
        reasons.append(f"its server (run {server['run']}) was not ready when it started")
    if run.holds_host and facts.get("gpu_apps"):
        uuids = {g.get("uuid"): g.get("index") for g in facts.get("gpus") or []}
        mine = None if run.spec.gpus is None else {str(i) for i in run.spec.gpus}
        busy = sorted({f"{a.get('pid')} on GPU {uuids.get(a.get('gpu_uuid'), '?')}" for a in facts["gpu_apps"]
                       if mine is None or uuids.get(a.get("gpu_uuid")) in mine})
        if busy:
            reasons.append("its GPUs were not clean at launch: process " + ", ".join(busy))
    return reasons
