"""The host side (orchestrator/host/hostjobs): a stdlib package of small modules, its shared constants and
helpers defined once across orchestrator/, shipped as one archive whose bytes depend on its sources alone."""

from __future__ import annotations

import ast
import hashlib
import shutil
import sys
from pathlib import Path

from orchestrator.host import hostprogram
from orchestrator.host.hostjobs import boot

ORCH = Path(__file__).resolve().parents[2] / "orchestrator"
HOSTJOBS = ORCH / "host" / "hostjobs"
SHARED_NAMES = ("CONTROL", "JOB_MARK", "RUN_MARK", "BOOTSTRAP", "SOURCES_RUN", "LOCK_WAIT_S", "TAIL_BYTES", "TAIL_MARK",
                "READ_MAX")
SHARED_HELPERS = ("run_mark", "workspace_of", "write_whole", "read_small", "claim_run_dir", "Refusal")
SHARED_TEXTS = (".orch", "ORCH_JOB", "ORCH_RUN")


def trees() -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text(), str(p)) for p in sorted(ORCH.rglob("*.py"))}


def test_each_shared_constant_has_one_definition_across_orchestrator() -> None:
    """A shared name is given a value once; everywhere else it is imported (or named from the module)."""
    defined: dict[str, list[str]] = {}
    texts: dict[str, list[str]] = {}
    for path, tree in trees().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and not isinstance(node.value, (ast.Attribute, ast.Name)):
                for target in node.targets:
                    if isinstance(target, ast.Name) and target.id in SHARED_NAMES:
                        defined.setdefault(target.id, []).append(path.name)
            if isinstance(node, ast.Constant) and node.value in SHARED_TEXTS:
                texts.setdefault(node.value, []).append(path.name)
    assert {k: len(v) for k, v in defined.items()} == dict.fromkeys(SHARED_NAMES, 1), defined
    assert {k: len(v) for k, v in texts.items()} == dict.fromkeys(SHARED_TEXTS, 1), texts


def test_each_shared_helper_has_one_definition_across_orchestrator() -> None:
    defined = [(fn.name, path.name) for path, tree in trees().items() for fn in ast.walk(tree)
               if isinstance(fn, ast.FunctionDef | ast.ClassDef) and fn.name in SHARED_HELPERS]
    assert sorted(name for name, _ in defined) == sorted(SHARED_HELPERS), defined


def calls_in(fn: ast.AST) -> set[str]:
    """`module.name` of each call in `fn` made through a module's name (`os.open`)."""
    return {f"{c.func.value.id}.{c.func.attr}" for c in ast.walk(fn) if isinstance(c, ast.Call)
            and isinstance(c.func, ast.Attribute) and isinstance(c.func.value, ast.Name)}


def test_one_helper_reads_a_small_file() -> None:
    """A control or lease file is read by common.read_small alone (never through a link, never waiting on a
    fifo); the others call it."""
    readers = [f"{path.relative_to(ORCH)}:{fn.name}" for path, tree in trees().items() for fn in ast.walk(tree)
               if isinstance(fn, ast.FunctionDef) and {"os.open", "os.read"} <= calls_in(fn)]
    assert readers == ["host/hostjobs/common.py:read_small"]


def test_one_claim_makes_a_run_dir_its_runs() -> None:
    """rundirs.claim_run_dir alone makes a run dir (the strict walk: every folder this user's, none a link)
    and writes its token; the launch, the batch submit and the lease take all call it."""
    makers, callers = [], set()
    for path, tree in trees().items():
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef):
                continue
            for call in ast.walk(fn):
                if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
                    continue
                if call.func.id == "open_run" and any(k.arg == "create" for k in call.keywords):
                    makers.append(f"{path.relative_to(ORCH)}:{fn.name}")
                if call.func.id == "claim_run_dir":
                    callers.add(path.name)
    assert makers == ["host/hostjobs/rundirs.py:claim_run_dir"]
    assert callers == {"jobs.py", "slurm.py", "leases.py"}


def test_one_helper_writes_a_file_whole() -> None:
    """A fresh file renamed into place is written by common.write_whole alone (the others call it)."""
    writers = []
    for path, tree in trees().items():
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef):
                calls = calls_in(fn)
                if calls & {"os.replace", "os.rename"} and calls & {"os.open", "tempfile.mkstemp"}:
                    writers.append(f"{path.relative_to(ORCH)}:{fn.name}")
    assert writers == ["host/hostjobs/common.py:write_whole"]


def test_the_host_side_is_small_stdlib_modules() -> None:
    for path in sorted(HOSTJOBS.glob("*.py")):
        assert len(path.read_text().splitlines()) < 600, path.name
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            assert all(n.split(".")[0] in sys.stdlib_module_names for n in names), (path.name, names)


def test_the_archive_depends_on_the_sources_alone(tmp_path: Path) -> None:
    """The same sources give the same bytes, whenever and wherever they were copied; another source,
    another digest."""
    first = boot.archive()
    copy = tmp_path / "hostjobs"
    shutil.copytree(HOSTJOBS, copy, ignore=shutil.ignore_patterns("__pycache__"))
    for p in copy.iterdir():
        p.touch()  # other times: not in the archive
    assert boot.archive(str(copy)) == first == hostprogram.archive()
    assert hashlib.sha256(first).hexdigest() == hostprogram.digest()
    (copy / "common.py").write_text((copy / "common.py").read_text() + "\n")
    assert boot.archive(str(copy)) != first


def test_the_agent_starts_its_wrappers_through_orchs_own_bootstrap(monkeypatch) -> None:
    """From the archive, a job's wrapper is the same archive again, through the same bootstrap orch starts
    the agent with (the bytes checked again); from the sources, the package as it is here."""
    from orchestrator.host.hostjobs import jobs

    monkeypatch.setattr(jobs, "ORCH_ARCHIVE", ("/w/runs/hostjobs/hostjobs-1.zip", "ab" * 32), raising=False)
    assert jobs.self_command("wrap", "--detach") == [
        sys.executable, "-I", "-c", hostprogram.BOOTSTRAP, "/w/runs/hostjobs/hostjobs-1.zip", "ab" * 32,
        "wrap", "--detach"]
    assert jobs.own_digest() == "ab" * 32
    monkeypatch.delattr(jobs, "ORCH_ARCHIVE")
    assert jobs.self_command("wrap") == [sys.executable, "-I", "-c", hostprogram.SOURCES_RUN, hostprogram.TOP, "wrap"]
    assert jobs.own_digest() == hostprogram.digest()


def test_a_wrapper_leaving_is_answered_as_gone_and_any_other_process_is_refused(tmp_path: Path, monkeypatch) -> None:
    """A wrapper that wrote its exit code lives on a moment without its memory (its environment, where the run's
    mark is, reads empty) before it is a zombie: a launch of the same run then finds the job over, as it would a
    moment later. A process that stays without the mark is never taken for the run's wrapper."""
    import itertools

    from orchestrator.host.hostjobs import rundirs

    root = tmp_path / "work" / "runs" / "3"
    (root / ".orch").mkdir(parents=True)
    (root / ".orch" / "token").write_text("t3")
    (root / ".orch" / "pid").write_text("4242 777\n")
    monkeypatch.setattr(rundirs, "_marked", lambda pid, mark: False)  # no environment to read
    looks = itertools.count()
    monkeypatch.setattr(rundirs, "live_start", lambda pid: "777" if next(looks) < 3 else None)  # then gone
    assert rundirs.find(str(root)) == {"pid": 4242, "start": "777"}

    monkeypatch.setattr(rundirs, "live_start", lambda pid: "777")  # it stays: another process
    monkeypatch.setattr(rundirs, "WRAPPER_LEAVING_S", 0.2)
    assert rundirs.find(str(root)) is None
