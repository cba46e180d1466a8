"""Secrets in a spec's `env`: the job gets the real value; the database, runs/<id>/, `orch status`, `compare`,
the dashboard's API, sweep records and reports, and a dry run show `***`; a run started again (rerun, the
dashboard's command) takes the value from orch's environment, and without it refuses in one line.

Real parts: the real CLI in its own processes, a real sshd host (the session fleet), real SQLite, real jobs.
"""

from __future__ import annotations

import json
import shlex
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from orchtest import FAST, Orch, fleet_toml
from test_ui import Dashboard

from orchestrator import secret_env
from orchestrator.store import Store
from orchestrator.ui import pages

TOKEN = "hf_S3CRET_0f1e2d"
CRED = "cred_S3CRET_9a8b"
SECRET_BITS = b"S3CRET"
# a job that hands back what it got, in a file outside every workspace (it prints nothing of it)
JOB = 'printf "%s|%s|%s" "$HF_TOKEN" "$MY_CRED" "$TOKENIZERS_PARALLELISM" > {out}; echo done'


def run_with_secrets(orch: Orch, out: Path, *extra: str) -> int:
    res = orch("run", "command", *FAST, *extra, "--set", f"env.HF_TOKEN={TOKEN}", "--set", f"env.MY_CRED={CRED}",
               "--set", 'secret_env=["MY_CRED"]', "--set", "env.TOKENIZERS_PARALLELISM=false",
               "--set", f"cmd={JOB.format(out=shlex.quote(str(out)))}")
    assert res.returncode == 0, res.stderr
    return max(r["id"] for r in orch.status())


def files_holding(root: Path, needle: bytes) -> list[Path]:
    """The files under root that hold `needle`, but for job scripts: on the local host the run dirs are in
    the workspace, and its job.sh is how the job gets its environment."""
    return [p for p in root.rglob("*") if p.is_file() and p.name != "job.sh" and needle in p.read_bytes()]


def test_the_job_gets_a_secret_and_nothing_orch_keeps_or_shows_holds_it(tmp_path: Path, ssh_fleet) -> None:
    orch = Orch(tmp_path / "ws", fleet_toml(ssh_fleet))
    out = tmp_path / "seen"
    run_id = run_with_secrets(orch, out, "--host", "test1")
    assert out.read_text() == f"{TOKEN}|{CRED}|false"  # the job had the real values
    doc = orch.status(run_id)
    job_script = Path(doc["remote_dir"]) / "job.sh"  # how the job got them, on its host: its owner's alone
    assert TOKEN in job_script.read_text() and job_script.stat().st_mode & 0o077 == 0
    # by its name (HF_TOKEN), or marked (MY_CRED); TOKENIZERS_PARALLELISM only starts with TOKEN
    assert doc["spec"]["env"] == {"HF_TOKEN": "***", "MY_CRED": "***", "TOKENIZERS_PARALLELISM": "false"}
    assert json.loads((orch.root / "runs" / str(run_id) / "spec.json").read_text())["spec"]["env"]["HF_TOKEN"] == "***"
    for args in (["status", str(run_id)], ["status", str(run_id), "--json"], ["status"],
                 ["compare", str(run_id), str(run_id), "--all"], ["compare", str(run_id), str(run_id), "--json"]):
        res = orch(*args, check=0)
        assert "S3CRET" not in res.stdout + res.stderr, args
    ui = Dashboard(orch)  # the real `orch ui`: what its run, runs and compare pages are given
    try:
        page = ui.get(f"/api/runs/{run_id}")
        assert page["spec"]["env"]["HF_TOKEN"] == "***" and "env.HF_TOKEN=***" in page["reproduce"]
        for path in (f"/api/runs/{run_id}", "/api/runs", f"/api/compare?ids={run_id},{run_id}&all=1"):
            assert "S3CRET" not in json.dumps(ui.get(path)), path
    finally:
        ui.stop()
    # nothing in the workspace: the database (its WAL too), spec.json, the log tail, events
    Store(orch.db).close()
    assert files_holding(orch.root, SECRET_BITS) == []
    res = orch("run", "command", "--host", "test1", "--set", f"env.HF_TOKEN={TOKEN}", "--set", "cmd=true",
               "--dry-run", check=0)
    assert "S3CRET" not in res.stdout and "HF_TOKEN='***'" in res.stdout.replace('"', "'"), res.stdout


def test_a_run_started_again_takes_the_secret_from_orchs_environment(tmp_path: Path) -> None:
    orch = Orch(tmp_path / "ws")
    first = run_with_secrets(orch, tmp_path / "first")
    # without the values in orch's environment: one line, exit 2, no run, never `***` sent to a job
    for name in ("HF_TOKEN", "MY_CRED"):
        orch.env.pop(name, None)
    res = orch("rerun", str(first))
    assert res.returncode == 2 and res.stderr.startswith("orch: ") and res.stderr.count("\n") == 1, res.stderr
    assert "env.HF_TOKEN" in res.stderr and "env.MY_CRED" in res.stderr and "export HF_TOKEN" in res.stderr
    assert [r["id"] for r in orch.status()] == [first]
    # with them: the job gets what orch's environment holds now
    orch.env.update(HF_TOKEN="hf_from_env", MY_CRED="cred_from_env")
    res = orch("rerun", str(first), "--set", f"cmd={JOB.format(out=shlex.quote(str(tmp_path / 'again')))}")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "again").read_text() == "hf_from_env|cred_from_env|false"
    # the dashboard's "command that starts it again", as a person pastes it into a shell
    store = Store(orch.db)
    command = pages.reproduce(store.get_run(first)).replace(str(tmp_path / "first"), str(tmp_path / "pasted"))
    res = subprocess.run([sys.executable, "-m", "orchestrator", *shlex.split(command)[1:]], env=orch.env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, (command, res.stderr)
    assert (tmp_path / "pasted").read_text() == "hf_from_env|cred_from_env|false"
    orch.env.pop("HF_TOKEN")
    res = subprocess.run([sys.executable, "-m", "orchestrator", *shlex.split(command)[1:]], env=orch.env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 2 and "env.HF_TOKEN" in res.stderr, res.stderr
    assert len(orch.status()) == 3
    store.close()
    assert files_holding(orch.root, b"_from_env") == []


SWEEP = """name = "grid"
playbook = "command"
hosts = ["local"]
[spec]
poll_min = 0.05
poll_max = 0.3
cmd = 'printf "%s" "$HF_TOKEN" > {out}-$N'
env = {{ HF_TOKEN = "{token}" }}
[matrix]
"env.N" = ["1", "2"]
"""


def test_a_sweeps_secret_reaches_its_jobs_and_stays_out_of_its_records_and_report(tmp_path: Path) -> None:
    orch = Orch(tmp_path / "ws")
    out = tmp_path / "seen"
    (orch.root / "grid.toml").write_text(SWEEP.format(out=out, token=TOKEN))
    res = orch("sweep", "run", str(orch.root / "grid.toml"), timeout=180)
    assert res.returncode == 0, res.stderr
    assert [Path(f"{out}-{n}").read_text() for n in ("1", "2")] == [TOKEN, TOKEN]
    res = orch("sweep", "report", "1", check=0)
    for args in (["sweep", "status", "1"], ["sweep", "status", "1", "--json"]):
        assert "S3CRET" not in orch(*args, check=0).stdout
    (doc,) = sqlite3.connect(orch.db).execute("SELECT doc FROM sweeps").fetchone()
    assert json.loads(doc)["spec"]["env"] == {"HF_TOKEN": "***"}
    Store(orch.db).close()
    assert files_holding(orch.root, SECRET_BITS) == [orch.root / "grid.toml"]  # the user's own file only


@pytest.mark.parametrize("matrix", ['"env.HF_TOKEN" = ["a", "b"]', 'env = [{ N = "1" }, { WANDB_API_KEY = "k" }]'])
def test_a_secret_cannot_be_swept(tmp_path: Path, matrix: str) -> None:
    orch = Orch(tmp_path / "ws")
    text = SWEEP.format(out=tmp_path / "x", token=TOKEN).replace('"env.N" = ["1", "2"]', matrix)
    (orch.root / "grid.toml").write_text(text)
    res = orch("sweep", "run", str(orch.root / "grid.toml"))
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "a secret cannot be swept" in res.stderr, res.stderr
    assert not orch.db.exists() or not sqlite3.connect(orch.db).execute("SELECT 1 FROM runs").fetchall()


def test_secret_names(tmp_path: Path) -> None:
    for name in ("HF_TOKEN", "hf_token", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY",
                 "AWS_ACCESS_KEY_ID", "PGPASSWORD", "DB_PASSWD", "OPENAI_APIKEY", "CLIENT_SECRETS", "GH_TOKENS", "APIKEY2"):
        assert secret_env.looks_secret(name), name
    for name in ("TOKENIZERS_PARALLELISM", "KEYBOARD", "CUDA_VISIBLE_DEVICES", "HF_HOME", "NCCL_DEBUG", "SECRETARY",
                 "MAX_TOKENS", "MAX_NEW_TOKENS", "NUM_KEYS", "PREFILL_TOKENS"):  # counts
        assert not secret_env.looks_secret(name), name
    assert secret_env.masked_env({"HF_TOKEN": "", "X": "1", "Y": "2"}, ["Y"]) == {"HF_TOKEN": "", "X": "1", "Y": "***"}


def test_the_common_short_names_and_urls_with_a_password_are_secrets_and_paths_to_them_are_not() -> None:
    for name in ("GITHUB_PAT", "GH_PAT", "DB_PASS", "SMTP_PASS", "MYSQL_PWD", "SSH_PASSPHRASE"):
        assert secret_env.looks_secret(name), name
    # where a secret is, not the secret; words that only end like a short one
    for name in ("HF_TOKEN_PATH", "SSL_KEY_FILE", "GOOGLE_API_KEY_FILE", "SECRETS_DIR", "TORCH_COMPAT", "NCCL_BYPASS",
                 "COMPASS", "PWD", "OLDPWD", "PATH"):
        assert not secret_env.looks_secret(name), name
    env = {"DATABASE_URL": "postgres://u:pw_S3CRET@db.example:5432/x", "BROKER": "amqp://:S3CRET@mq/",
           "ARGS": "--db=mysql://root:S3CRET@127.0.0.1/x --fast", "HOOK": "https://hooks.example/x?token=S3CRET&a=1",
           "SIGNED": "https://bucket.example/o?X-Amz-Signature=1&api-key=S3CRET",
           "PLAIN_URL": "https://huggingface.co/org/model", "PORTED": "http://host:8080/path@v2",
           "GIT": "ssh://git@github.com/org/repo", "EMPTY_QUERY": "https://h.example/?token=",
           "INDEX": "https://ghp_S3CRET@github.com/org/repo.git"}
    assert secret_env.masked_env(env) == {
        **env, "DATABASE_URL": "***", "BROKER": "***", "ARGS": "***", "HOOK": "***", "SIGNED": "***", "INDEX": "***"}


def test_specs_stored_before_masking_are_masked_when_the_database_opens(tmp_path: Path) -> None:
    from sqlite_utils import Database

    path = tmp_path / "orch.db"
    old = Store.__new__(Store)
    old.path, old.conn = path, sqlite3.connect(path, isolation_level=None)
    old.db = Database(old.conn)
    old.migrate(stop_before="m017_env_secrets_masked")
    # specs long enough to spill into overflow pages: the masked ones leave the old pages free, not readable
    spec = {"cmd": "x" * 20000, "env": {"HF_TOKEN": TOKEN, "MY_CRED": CRED, "N": "1"}, "secret_env": ["MY_CRED"]}
    for _ in range(3):
        old.conn.execute("INSERT INTO runs (playbook, host, status, spec, created_at) VALUES ('command', 'local',"
                         " 'succeeded', ?, 1.0)", (json.dumps(spec),))
    old.conn.execute("INSERT INTO runs (playbook, host, status, spec, created_at) VALUES ('command', 'local',"
                     " 'failed', 'not json', 1.0)")
    old.conn.execute("INSERT INTO sweeps (name, file_hash, instance, path, playbook, doc, status, created_at) VALUES"
                     " ('g', 'h', '', '/g.toml', 'command', ?, 'succeeded', 1.0)",
                     (json.dumps({"name": "g", "spec": {"env": {"WANDB_API_KEY": "k_S3CRET"}}}),))
    old.conn.close()
    store = Store(path)
    assert store.get_run(1).spec["env"] == {"HF_TOKEN": "***", "MY_CRED": "***", "N": "1"}
    assert json.loads(store.conn.execute("SELECT doc FROM sweeps").fetchone()[0])["spec"]["env"] == {
        "WANDB_API_KEY": "***"}
    assert store.conn.execute("SELECT spec FROM runs WHERE id = 4").fetchone()[0] == "not json"
    store.close()
    assert SECRET_BITS not in path.read_bytes()


def test_specs_stored_under_the_narrower_rule_are_masked_by_the_wider_one_when_the_database_opens(
        tmp_path: Path) -> None:
    from sqlite_utils import Database

    path = tmp_path / "orch.db"
    old = Store.__new__(Store)
    old.path, old.conn = path, sqlite3.connect(path, isolation_level=None)
    old.db = Database(old.conn)
    old.migrate(stop_before="m021_env_secrets_masked_wider")
    spec = {"cmd": "x", "env": {"GITHUB_PAT": "ghp_S3CRET", "DATABASE_URL": "postgres://u:S3CRET@h/db",
                                "HF_TOKEN_PATH": "/etc/token", "N": "1"}}
    old.conn.execute("INSERT INTO runs (playbook, host, status, spec, created_at) VALUES ('command', 'local',"
                     " 'succeeded', ?, 1.0)", (json.dumps(spec),))
    old.conn.close()
    store = Store(path)
    assert store.get_run(1).spec["env"] == {"GITHUB_PAT": "***", "DATABASE_URL": "***", "HF_TOKEN_PATH": "/etc/token",
                                            "N": "1"}
    store.close()
    assert SECRET_BITS not in path.read_bytes()


def test_the_workspace_is_its_owners_alone_whatever_the_umask_and_the_job_keeps_the_users(tmp_path: Path) -> None:
    """Under umask 000 the database, its -wal and -shm, runs/, runs/<id>/, spec.json, the log tail, the
    watcher's log and lock, a pull: none readable by anyone else; the job itself gets the user's umask."""
    host_dir = tmp_path / "host"
    orch = Orch(tmp_path / "ws", f'[hosts.local]\nworkdir = "{host_dir}"\n')
    (orch.root / "hosts.toml").chmod(0o600)  # the test's own file
    seen = tmp_path / "job-umask"

    def orch_open(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "orchestrator", *args], env=orch.env, capture_output=True,
                              text=True, timeout=120, check=False, umask=0)

    res = orch_open("run", "command", *FAST, "--set", f"cmd=umask > {shlex.quote(str(seen))}; echo out > result.txt")
    assert res.returncode == 0, res.stderr
    assert orch_open("status").returncode == 0 and orch_open("pull", "1").returncode == 0
    made = sorted(p for p in orch.root.rglob("*"))
    assert orch.db in made and orch.root / "runs" / "1" / "spec.json" in made
    assert orch.root / "runs" / "1" / "pulled" / "result.txt" in made
    shared = [f"{p.stat().st_mode & 0o777:o} {p}" for p in made if p.stat().st_mode & 0o077]
    assert shared == []
    assert seen.read_text().strip() == "0000"  # the job: the user's umask, not orch's
