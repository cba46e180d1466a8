"""The CLI as a person and a script meet it: discovery, spec errors, piped output and JSON shapes,
the end-of-run summary, filters, the local log fallback, rerun/rm/gc, and a folder that is no workspace."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from orchtest import FAST, Orch

ROOT = Path(__file__).parent.parent


def test_playbooks_and_their_spec_keys(tmp_path):
    orch = Orch(tmp_path / "ws")
    listed = orch("playbooks", check=0).stdout.splitlines()
    assert listed[0].split("\t") == ["name", "engine", "summary"]
    names = [line.split("\t")[0] for line in listed[1:]]
    assert names == ["bench-serving", "command", "extract-hidden-states", "serve-bench", "serve-bench-vllm",
                     "serve-eagle3", "serve-vllm", "train-draft"]
    shown = orch("run", "command", "--help", check=0).stdout
    rows = {line.split("\t")[0]: line.split("\t")[1:] for line in shown.splitlines() if "\t" in line}
    assert rows["cmd"][:2] == ["text (length >= 1)", "required"]
    assert rows["stall_factor"] == ["number (> 1, <= 1000)", "5.0", "stalled after this many usual gaps"]
    assert rows["on_stall"][0] == 'one of "warn", "kill", "dump"'
    assert "<bool>" not in shown and "<str>" not in shown
    # every key of every playbook, as JSON
    docs = json.loads(orch("playbooks", "--json", check=0).stdout)
    extract = next(d for d in docs if d["name"] == "extract-hidden-states")
    assert {"key": "max_length", "type": "integer", "default": 256, "required": False, "bounds": "> 0, <= 100000000",
            "description": "hf only"} in extract["fields"]
    assert orch("--version", check=0).stdout.strip().startswith("orch 0.")


def test_spec_errors_name_the_file_key_value_and_a_close_key(tmp_path):
    orch = Orch(tmp_path / "ws")
    spec = tmp_path / "job.toml"
    spec.write_text('cmdd = "python x.py"\ngpu = [0]\n')
    res = orch("run", "command", "-f", str(spec), "--set", "stall_factor=0")
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        "orch: invalid spec, 4 problems:",
        "  stall_factor = 0 (--set): must be greater than 1",
        "  cmd: required (text: command line, run by bash in the run dir unless cwd is set), not given",
        f"  cmdd = \"python x.py\" ({spec}): unknown key; did you mean 'cmd'?",
        f"  gpu = [0] ({spec}): unknown key; did you mean 'gpus'?",
    ]
    assert not (orch.root / "runs" / "1").exists()


def test_end_of_run_summary(tmp_path):
    orch = Orch(tmp_path / "ws")
    ok = orch("run", "command", "--set", "cmd=echo done", *FAST, check=0).stderr.splitlines()
    assert ok[-3].startswith("run 1 succeeded in ") and ok[-3].endswith(" s")
    assert ok[-2:] == [f"  run dir: local:{orch.root / 'runs' / '1'}", "  next: orch status 1"]
    bad = orch("run", "command", "--set", "cmd=echo loading; .venv/bin/python -c 1", *FAST)
    assert bad.returncode == 1
    lines = bad.stderr.splitlines()
    assert lines[-4:-2] == ["run 2 failed: exit code 127", "  | loading"]
    assert ".venv/bin/python: No such file or directory" in lines[-2] and lines[-1] == "  next: orch logs 2"
    summary = json.loads(orch("watch", "2", "--json").stdout)
    assert summary["status"] == "failed" and summary["cause"] == "exit code 127"
    assert summary["next"] == ["orch logs 2"] and summary["log_lines"][-1] == lines[-2].removeprefix("  | ")


def test_a_failure_says_what_to_try_in_the_summary_and_in_status(tmp_path):
    from orchestrator.logparse.hints import SIGNATURES

    missing = next(s for s in SIGNATURES if s.name == "missing_module")
    orch = Orch(tmp_path / "ws")
    bad = orch("run", "command", "--set", "cmd=python3 -c 'import orch_no_such_module'", *FAST)
    assert bad.returncode == 1
    lines = bad.stderr.splitlines()
    tried = [line for line in lines if line.startswith("  try: ")]
    assert tried == [f"  try: {missing.hint} (source: {missing.source})"]
    assert lines.index(tried[0]) == lines.index(next(x for x in lines if x.startswith("run 1 failed"))) + 1
    summary = json.loads(orch("watch", "1", "--json").stdout)
    assert summary["hint"] == tried[0].removeprefix("  try: ")
    status = json.loads(orch("status", "1", "--json").stdout)
    assert status["error"]["kind"] == "import_error" and status["error"]["hint"] == summary["hint"]
    assert f"  try: {summary['hint']}" in orch("status", "1").stdout.splitlines()
    ok = json.loads(orch("run", "command", "--set", "cmd=echo fine", *FAST, "--json").stdout)
    assert ok["status"] == "succeeded" and ok["hint"] is None


def test_piped_output_is_never_cut_and_json_shapes(tmp_path):
    orch = Orch(tmp_path / "ws")
    patches = orch("patch", "list", check=0).stdout
    assert any(line.split("\t")[0] == "sglang-eagle3-hidden-debug" for line in patches.splitlines())
    cmd = "python3 -c 'print(\"x\" * 300)'  # " + "a long comment " * 10
    orch("run", "command", "--set", f"cmd={cmd}", *FAST, check=0)
    orch("run", "command", "--set", "cmd=false", *FAST)
    table = orch("status", check=0).stdout.splitlines()
    assert len(table) == 3 and all(len(line.split("\t")) == 13 for line in table)
    doc = orch.status(1)
    assert doc["created_at_iso"].endswith("+00:00") and abs(doc["created_at"] - time.time()) < 120
    assert isinstance(doc["duration_s"], float) and doc["events"][0]["ts_iso"]
    # filters, and a limited listing says so (on stderr: stdout stays data)
    failed = orch("status", "--status", "failed", "--json", check=0)
    assert [d["id"] for d in json.loads(failed.stdout)] == [2]
    assert [d["id"] for d in orch.status()] == [2, 1]
    assert orch("status", "--host", "nowhere", "--json", check=0).stdout.strip() == "[]"
    limited = orch("status", "-n", "1", check=0)
    assert "showing 1 of 2 runs" in limited.stderr and len(limited.stdout.splitlines()) == 2
    gpus = json.loads(orch("gpus", "--json", check=0).stdout)
    assert set(gpus["local"]) >= {"name", "ok", "error", "nvidia_smi", "gpus"}


def test_inspect_log_progress_is_the_status_progress(tmp_path):
    orch = Orch(tmp_path / "ws")
    log = tmp_path / "log"
    log.write_bytes(b"Loading safetensors checkpoint shards:  50% Completed | 6/12 [00:03<00:03,  2.00it/s]\n")
    found = json.loads(orch("inspect-log", str(log), "--json", check=0).stdout)
    assert found["progress"]["done"] == 6 and found["progress"]["total"] == 12
    assert isinstance(found["progress"]["total"], int)
    assert list(found["progress"]) == ["label", "done", "total", "percent", "rate_per_s", "eta_s", "elapsed_s"]


def test_logs_fall_back_to_the_local_tail_when_the_host_is_down(orch, ssh_fleet_restarts):
    res = orch("run", "command", "--host", "test1", "--set", "cmd=echo from-the-job", *FAST)
    assert res.returncode == 0, res.stderr
    assert orch("logs", "1", check=0).stdout == "from-the-job\n"
    ssh_fleet_restarts.server(1).stop()
    down = orch("logs", "1", "--json")
    assert down.returncode == 0, down.stderr
    doc = json.loads(down.stdout)
    assert doc["source"] == "local" and doc["lines"] == ["from-the-job"]
    assert "connection refused at 127.0.0." in doc["note"] and "log.tail" in doc["note"]
    assert "attempt" not in down.stderr  # under --json stderr keeps to the one note
    # without --json each retry says what failed and which attempt it was
    plain = orch("logs", "1")
    retries = [line for line in plain.stderr.splitlines() if "retrying in" in line]
    assert [line.split("(attempt ")[1].split(")")[0] for line in retries] == ["1 of 4", "2 of 4", "3 of 4"]
    assert all(line.startswith("orch: ") and "connection refused at 127.0.0." in line for line in retries)
    assert plain.stdout == "from-the-job\n"


def test_rerun_rm_and_gc(orch, tmp_path):
    assert orch("run", "command", "--host", "test1", "--set", "cmd=echo one", *FAST).returncode == 0
    res = orch("rerun", "1", "--set", "cmd=echo two", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["id"] == 2
    assert orch.status(2)["spec"]["cmd"] == "echo two" and orch.status(2)["host"] == "test1"
    assert orch("logs", "2", check=0).stdout == "two\n"
    running = orch("run", "command", "--host", "test1", "--set", "cmd=sleep 30", "--detach", *FAST, check=0)
    assert running.stdout.strip() == "3"
    refused = orch("rm", "3")
    assert refused.returncode == 2 and "cancel it first" in refused.stderr
    orch("cancel", "3", "--grace", "1", check=0)
    remote1 = Path(orch.status(3)["remote_dir"]).parent  # <workdir>/runs/<workspace key>
    assert remote1.parent == tmp_path / "remote1" / "runs" and sorted(os.listdir(remote1)) == ["1", "2", "3"]
    gone = orch("rm", "3", "--json", check=0)
    assert json.loads(gone.stdout) == [{"id": 3, "removed": True, "remote": f"removed test1:{remote1 / '3'}"}]
    assert sorted(os.listdir(remote1)) == ["1", "2"] and not (orch.root / "runs" / "3").exists()
    assert orch("gc", "--older-than", "1h", "--json", check=0).stdout.strip() == "[]"
    time.sleep(1.1)
    listed = json.loads(orch("gc", "--older-than", "1s", "--dry-run", "--json", check=0).stdout)
    assert [r["id"] for r in listed] == [1, 2] and sorted(os.listdir(remote1)) == ["1", "2"]
    orch("gc", "--older-than", "1s", check=0)
    assert orch.status() == [] and os.listdir(remote1) == []
    assert orch("rm", "1").returncode == 2  # gone: an unknown run
    assert orch("gc", "--older-than", "soon").returncode == 2


def test_read_commands_outside_a_workspace_create_nothing(tmp_path):
    empty = tmp_path / "nowhere"
    empty.mkdir()
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("ORCH_HOME", None)
    for args in (["status"], ["status", "--json"], ["sweep", "status"], ["gpus"]):
        res = subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=empty, env=env,
                             capture_output=True, text=True, timeout=60, check=False)
        assert res.returncode == 0, res.stderr
        if args[0] != "gpus":
            assert f"{empty / 'runs' / 'orch.db'} does not exist (the workspace is the current directory" in res.stderr
    res = subprocess.run([sys.executable, "-m", "orchestrator", "logs", "1"], cwd=empty, env=env,
                         capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 2 and "no run 1" in res.stderr
    assert os.listdir(empty) == []


def test_the_shipped_inventory_checks_out_of_the_box(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    shutil.copy(ROOT / "hosts.toml", ws / "hosts.toml")
    orch = Orch.__new__(Orch)
    orch.root, orch.env = ws, {**os.environ, "ORCH_HOME": str(ws), "COLUMNS": "200"}
    hosts = json.loads(orch("hosts", "--check", "--json", check=0).stdout)
    assert [(h["name"], h["ok"]) for h in hosts] == [("local", True)]


def test_names_tags_and_notes_and_the_filters_on_them(tmp_path):
    orch = Orch(tmp_path / "ws")
    res = orch("run", "command", "--set", "cmd=true", "--name", "fp8 baseline", "--tag", "fp8", "--tag", "base",
               "--tag", "fp8", "--note", "first try", *FAST)
    assert res.returncode == 0, res.stderr
    orch("run", "command", "--set", "cmd=true", *FAST, check=0)
    doc = orch.status(1)
    assert (doc["name"], doc["tags"], doc["note"]) == ("fp8 baseline", ["fp8", "base"], "first try")
    assert orch.status(2)["tags"] == [] and orch.status(2)["name"] is None
    rows = [line.split("\t") for line in orch("status", check=0).stdout.splitlines()]
    assert rows[0][:3] == ["id", "name", "playbook"] and rows[2][:2] == ["1", "fp8 baseline"]
    assert [d["id"] for d in json.loads(orch("status", "--tag", "fp8", "--json", check=0).stdout)] == [1]
    # added later; a tag already there stays once
    assert json.loads(orch("tag", "2", "fp8", "late", "--json", check=0).stdout)["tags"] == ["fp8", "late"]
    orch("tag", "2", "late", check=0)
    orch("note", "1", "second thought", check=0)
    assert orch.status(1)["note"] == "first try\nsecond thought" and orch.status(2)["tags"] == ["fp8", "late"]
    assert [d["id"] for d in json.loads(orch("status", "--tag", "fp8", "--json", check=0).stdout)] == [2, 1]
    assert "note: second thought" in orch("status", "1", check=0).stdout
    assert orch("tag", "9", "x").returncode == 2 and not (orch.root / "runs" / "9").exists()
    # --rerun takes its own labels; a run's labels are not copied
    assert json.loads(orch("rerun", "1", "--name", "again", "--detach", "--json").stdout)["name"] == "again"


def test_logs_all_and_pull_copy_the_whole_run_dir(orch, tmp_path):
    # a log of several chunks, with bytes that are no UTF-8
    cmd = "cmd=head -c 2500000 /dev/zero | tr '\\0' x; printf '\\n\\377\\376 end\\n'; echo out > result.txt"
    assert orch("run", "command", "--host", "test1", "--set", cmd, *FAST).returncode == 0
    remote = Path(orch.status(1)["remote_dir"])
    res = subprocess.run([sys.executable, "-m", "orchestrator", "logs", "1", "--all"], env=orch.env,
                         capture_output=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout == (remote / "log").read_bytes() and len(res.stdout) > 2_500_000
    assert res.stdout.endswith(b"\n\xff\xfe end\n")
    pulled = orch("pull", "1", "--json")
    assert pulled.returncode == 0, pulled.stderr
    doc = json.loads(pulled.stdout)
    into = orch.root / "runs" / "1" / "pulled"
    assert doc["to"] == str(into) and doc["files"] == len([p for p in remote.rglob("*") if p.is_file()])
    assert (into / "log").read_bytes() == (remote / "log").read_bytes()
    assert (into / "result.txt").read_text() == "out\n"
    too_big = orch("pull", "1", "--to", str(tmp_path / "small"), "--max-size", "1M")
    assert too_big.returncode == 2 and "more than --max-size 1.0 MiB" in too_big.stderr
    assert not (tmp_path / "small").exists()
    elsewhere = orch("pull", "1", "--to", str(tmp_path / "mine"), check=0)
    assert elsewhere.stdout.strip() == str(tmp_path / "mine") and (tmp_path / "mine" / "result.txt").is_file()


def test_pull_copies_a_big_run_dir_byte_for_byte_and_follows_no_symlink(orch, tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"outside the run dir")
    cmd = (f"cmd=head -c 5000000 /dev/urandom > big.bin; ln -s {secret} link; ln -s /dev/zero zeros; "
           "mkdir -p sub/deeper && echo deep > sub/deeper/f; printf 'last words, no newline'")
    assert orch("run", "command", "--host", "test1", "--set", cmd, *FAST).returncode == 0
    remote = Path(orch.status(1)["remote_dir"])
    # the whole log, its last line without a newline
    res = subprocess.run([sys.executable, "-m", "orchestrator", "logs", "1", "--all"], env=orch.env,
                         capture_output=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout == (remote / "log").read_bytes() and res.stdout.endswith(b"last words, no newline")
    # above --max-size: refused whole, nothing copied
    too_big = orch("pull", "1", "--to", str(tmp_path / "small"), "--max-size", "4M")
    assert too_big.returncode == 2 and "more than --max-size 4.0 MiB" in too_big.stderr
    assert not (tmp_path / "small").exists()
    pulled = orch("pull", "1", "--to", str(tmp_path / "here"), "--json")
    assert pulled.returncode == 0, pulled.stderr
    assert pulled.stderr == ""  # off a terminal: no bar
    into = tmp_path / "here"
    plain = sorted(str(p.relative_to(remote)) for p in remote.rglob("*") if p.is_file() and not p.is_symlink())
    assert sorted(str(p.relative_to(into)) for p in into.rglob("*") if not p.is_dir()) == plain
    assert (into / "big.bin").read_bytes() == (remote / "big.bin").read_bytes()
    assert (into / "sub" / "deeper" / "f").read_text() == "deep\n"
    assert not (into / "link").exists() and not (into / "link").is_symlink() and not (into / "zeros").exists()
    doc = json.loads(pulled.stdout)
    assert (doc["files"], doc["bytes"]) == (len(plain), sum((remote / p).stat().st_size for p in plain))


def test_pull_keeps_the_hosts_modes_and_makes_nothing_others_can_read(orch, tmp_path):
    cmd = ("cmd=echo a > shared.txt && chmod 640 shared.txt && echo b > open.txt && chmod 604 open.txt && "
           "printf 'echo hi\\n' > tool.sh && chmod 755 tool.sh")
    assert orch("run", "command", "--host", "test1", "--set", "env.HF_TOKEN=hf_S3CRET", "--set", cmd,
                *FAST).returncode == 0
    remote = Path(orch.status(1)["remote_dir"])
    assert (remote / "job.sh").stat().st_mode & 0o777 == 0o600  # the token inside: the host keeps it owner-only
    into = tmp_path / "here"
    for _ in range(2):  # again over the first copy, whose modes were changed meanwhile
        assert orch("pull", "1", "--to", str(into)).returncode == 0
        modes = {p.name: p.stat().st_mode & 0o777 for p in into.rglob("*") if p.is_file()}
        assert "hf_S3CRET" in (into / "job.sh").read_text()
        assert modes["job.sh"] == 0o600 and modes["tool.sh"] == 0o700  # the owner's bits: still executable
        assert modes["shared.txt"] == modes["open.txt"] == 0o600  # others could read them there: no one else here
        assert not [name for name, mode in modes.items() if mode & 0o077], modes
        for p in into.rglob("*"):
            p.chmod(0o777 if p.is_dir() else 0o666)


def test_pull_shows_a_bar_on_a_terminal_and_none_with_json(orch, tmp_path):
    import pty
    import select

    assert orch("run", "command", "--host", "test1", "--set", "cmd=head -c 3000000 /dev/zero > out.bin",
                *FAST).returncode == 0

    def stderr_on_a_terminal(*args: str) -> tuple[bytes, bytes]:
        leader, follower = pty.openpty()
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator", *args], env=orch.env,
                                stdout=subprocess.PIPE, stderr=follower, stdin=subprocess.DEVNULL)
        os.close(follower)
        shown = b""
        try:
            while True:
                if select.select([leader], [], [], 0.5)[0]:
                    try:
                        chunk = os.read(leader, 65536)
                    except OSError:  # EIO: the process closed the terminal
                        break
                    if not chunk:
                        break
                    shown += chunk
                elif proc.poll() is not None:
                    break
        finally:
            os.close(leader)
            out = proc.communicate(timeout=120)[0]
        assert proc.returncode == 0, shown
        return out, shown

    out, shown = stderr_on_a_terminal("pull", "1", "--to", str(tmp_path / "a"))
    assert b"pull run 1" in shown and b"MiB" in shown and out.decode().strip() == str(tmp_path / "a")
    out, shown = stderr_on_a_terminal("pull", "1", "--to", str(tmp_path / "b"), "--json")
    assert b"pull run 1" not in shown and json.loads(out)["bytes"] > 3_000_000


def test_ssh_opens_the_run_dir_on_its_host(orch, tmp_path, ssh_fleet):
    import shlex

    assert orch("run", "command", "--host", "test1", "--set", "cmd=echo hi > mark", *FAST).returncode == 0
    entry = ssh_fleet.host_entry(1)
    remote = Path(orch.status(1)["remote_dir"])
    printed = orch("ssh", "1", "--print", check=0).stdout.strip()
    assert shlex.split(printed) == [
        "ssh", "-t", "-p", str(entry["port"]), "-i", entry["identity_file"],
        "-o", f'UserKnownHostsFile=~/.ssh/known_hosts "{entry["known_hosts"]}"', "-o", "ConnectTimeout=10",
        "--", f"{entry['user']}@{entry['address']}", f"cd {shlex.quote(str(remote))} && exec $SHELL -l"]
    there = orch("ssh", "1", "--command", "pwd; cat mark")
    assert there.returncode == 0, there.stderr
    assert there.stdout.splitlines() == [str(remote), "hi"]
    local = orch("run", "command", "--set", "cmd=true", *FAST, check=0)
    assert local.returncode == 0
    on_here = orch("ssh", "2", "--print")
    assert on_here.returncode == 2 and f"cd {orch.root / 'runs' / '2'}" in on_here.stderr


def test_patch_status_keeps_to_runs_in_the_workspace(tmp_path):
    orch = Orch(tmp_path / "ws")
    res = orch("patch", "status", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == []
    # the host's python is asked by its agent, run from orch's sources here: nothing placed, nothing made
    assert sorted(os.listdir(orch.root)) == ["hosts.toml"]


def test_a_prompt_command_says_the_same_in_the_tests_process_as_in_its_own(tmp_path):
    """Orch runs `logs`, `status` and the like in the test's process: their output and exit codes are
    those of `python -m orchestrator`."""
    orch = Orch(tmp_path / "ws")
    orch("run", "command", "--set", "cmd=printf 'one\\ttab\\r\\nwide é\\n'", *FAST, check=0)
    for args in (("logs", "1"), ("logs", "1", "--json"), ("status", "nope"), ("tag", "9", "x"), ("playbooks",),
                 ("status", "--host", "nowhere", "--json"), ("hosts", "--json"), ("logs", "1", "-n", "x")):
        here, there = orch(*args), orch(*args, new_process=True)
        assert (here.returncode, here.stdout, here.stderr) == (there.returncode, there.stdout, there.stderr), args
