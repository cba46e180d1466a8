"""`train-draft`: speculators' EAGLE-3 training on an extract run's hidden states, over the real sshd fleet.

scripts/train.py is a tests-only stand-in (tests/fakes/speculators_emulator/scripts/train.py) with the real
script's arguments and log lines.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from orchtest import FAST
from sshd import free_port

from orchestrator.config.hosts import Host
from orchestrator.errors import UsageError
from orchestrator.store.record import RunRecord, Status
from playbooks.train_draft import TrainDraftSpec, hidden_states_dir, target_layers, train_argv, train_command

SCRIPTS = Path(__file__).parent / "fakes" / "speculators_emulator" / "scripts"
PROMPTS = Path(__file__).parents[1] / "playbooks" / "data" / "prompts.jsonl"
MODEL = "/models/Llama-3.1-8B-Instruct"


def sets(**values: object) -> list[str]:
    return [a for k, v in values.items() for a in ("--set", f"{k}={v if isinstance(v, str) else json.dumps(v)}")]


def test_trains_on_an_extract_run_with_loss_and_progress(orch):
    assert orch("run", "extract-hidden-states", "--host", "test1", *FAST,
                *sets(backend="speculators", scripts_dir=str(SCRIPTS), model=MODEL, speculators_version="0.3.0",
                      dataset=str(PROMPTS), max_samples=6, batch_size=2), timeout=180).returncode == 0
    res = orch("run", "train-draft", "--host", "test1", *FAST,
               *sets(scripts_dir=str(SCRIPTS), verifier=MODEL, from_run=1, speculators_version="0.4.0",
                     epochs=2, lr=3e-4, total_seq_len=4096), timeout=180)
    assert res.returncode == 0, res.stderr
    doc = orch.status(2)
    assert doc["status"] == "succeeded" and doc["exit_code"] == 0
    assert doc["progress"]["label"] == "epoch" and doc["progress"]["done"] == doc["progress"]["total"] == 2
    m = doc["metrics"]
    assert 0 < m["train/loss"] < m["train/loss_2"] * 3 and m["lr"] == pytest.approx(3e-4)
    assert m["checkpoints"] == 2 and m["output_mb"] > 0
    extract = Path(orch.status(1)["remote_dir"]) / "hidden_states"
    outputs = json.loads((orch.root / "runs" / "2" / "outputs.json").read_text())
    assert outputs["hidden_states"] == str(extract)
    assert outputs["last_checkpoint"] == str(Path(doc["remote_dir"]) / "checkpoints" / "1")
    log = (Path(doc["remote_dir"]) / "log").read_text()
    assert f"--data-path {extract}" in (Path(doc["remote_dir"]) / "job.sh").read_text()
    assert log.count("train/loss=") == 6  # 3 steps (6 samples / 2) per epoch


def test_speculators_0_7_trains_on_the_layers_the_extract_run_took(orch, tmp_path):
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    prepared.joinpath("data.jsonl").write_text("".join(json.dumps({"input_ids": list(range(3, 9 + i))}) + "\n"
                                                       for i in range(4)))
    assert orch("run", "extract-hidden-states", "--host", "test1", *FAST,
                *sets(backend="speculators", scripts_dir=str(SCRIPTS), model=MODEL, speculators_version="0.5.0",
                      dataset=str(prepared), layers=[1, 3], port=free_port("127.0.0.1")), timeout=180).returncode == 0
    train = [*FAST, "--set", "env.SPECULATORS_EMULATOR_TRAIN_VERSION=0.7.0",
             *sets(scripts_dir=str(SCRIPTS), verifier=MODEL, speculators_version="0.7.0", epochs=1)]
    res = orch("run", "train-draft", "--host", "test1", *train, "--set", "from_run=1", timeout=180)
    assert res.returncode == 0, res.stderr
    doc = orch.status(2)
    assert doc["status"] == "succeeded" and doc["metrics"]["checkpoints"] == 1
    job = (Path(doc["remote_dir"]) / "job.sh").read_text()
    assert f"--data-path {prepared} " in job and "--target-layer-ids 1 3" in job
    # the same hidden states by path: the layers are the spec's; without them train.py assumes three
    hidden = Path(orch.status(1)["remote_dir"]) / "hidden_states"
    by_path = [*train, *sets(hidden_states=str(hidden), data_path=str(prepared))]
    assert orch("run", "train-draft", "--host", "test1", *by_path, *sets(layers=[1, 3]), timeout=180).returncode == 0
    assert orch("run", "train-draft", "--host", "test1", *by_path, timeout=180).returncode == 1
    assert "shape mismatch" in orch.status(4)["error"]["message"]


def test_no_samples_fails_the_run(orch, tmp_path):
    (tmp_path / "empty").mkdir()
    res = orch("run", "train-draft", "--host", "test1", *FAST,
               *sets(scripts_dir=str(SCRIPTS), verifier=MODEL, hidden_states=str(tmp_path / "empty"),
                     speculators_version="0.4.0"), timeout=180)
    assert res.returncode != 0
    doc = orch.status(1)
    assert doc["status"] == "failed" and "no training samples" in json.dumps(doc["error"])


def test_from_run_must_be_a_succeeded_speculators_extract_on_the_host(orch):
    res = orch("run", "train-draft", "--host", "test1", *FAST,
               *sets(scripts_dir=str(SCRIPTS), verifier=MODEL, from_run=7), timeout=60)
    assert res.returncode != 0 and "from_run: no run 7" in res.stderr


def run_of(**kw: object) -> RunRecord:
    base = {"id": 3, "playbook": "extract-hidden-states", "host": "h", "status": Status.SUCCEEDED,
            "spec": {"backend": "speculators", "output_dir": "/hs", "dataset": "/prep"}, "remote_dir": "/r/3"}
    return RunRecord(**{**base, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize(("run", "message"), [
    (run_of(playbook="serve-eagle3"), "is not an extract-hidden-states run"),
    (run_of(spec={"backend": "hf"}), "with backend speculators"),
    (run_of(host="other"), "is not on h"),
    (run_of(status=Status.FAILED), "did not succeed"),
    (run_of(spec={"backend": "speculators", "output_dir": "/hs", "include_last_layer": False}),
     r"left out the verifier's last layer \(include_last_layer = false\)"),
])
def test_from_run_refusals(run, message):
    spec = TrainDraftSpec(scripts_dir="/s", verifier="/m", from_run=3)
    with pytest.raises(UsageError, match=message):
        hidden_states_dir(lambda _id: run, spec, Host(name="h"))


def test_from_run_resolves_the_output_dir():
    spec = TrainDraftSpec(scripts_dir="/s", verifier="/m", from_run=3)
    assert hidden_states_dir(lambda _id: run_of(), spec, Host(name="h")) == "/hs"
    default = run_of(spec={"backend": "speculators", "output_dir": None})
    assert hidden_states_dir(lambda _id: default, spec, Host(name="h")) == "/r/3/hidden_states"


def test_arguments_of_each_version():
    spec = TrainDraftSpec(scripts_dir="/s", verifier="/m", hidden_states="/hs", epochs=3, lr=1e-4,
                          extra_args=["--ttt-steps", "4"])
    assert train_argv(spec, "py", "0.4.0", "/hs", None, "/out") == [
        "py", "/s/train.py", "--verifier-name-or-path", "/m", "--data-path", "/hs", "--save-path", "/out",
        "--epochs", "3", "--lr", "0.0001", "--ttt-steps", "4"]
    assert train_argv(spec, "py", "0.6.0", "/hs", "/prep", "/out")[4:10] == [
        "--data-path", "/prep", "--hidden-states-path", "/hs", "--on-missing", "warn"]
    with pytest.raises(UsageError, match="needs data_path"):
        train_argv(spec, "py", "0.5.0", "/hs", None, "/out")
    for version in ("0.5.0", "0.7.0", "0.7.0.1", "0.8.0"):  # 0.7+'s config resolver takes the same flags
        assert train_argv(spec, "py", version, "/hs", "/prep", "/out", [2, 9])[4:12] == [
            "--data-path", "/prep", "--hidden-states-path", "/hs", "--on-missing", "warn", "--target-layer-ids", "2"]
    # 0.9 has no scripts/: the package's trainer, the same flags, scripts_dir not needed
    for given in (spec, spec.model_copy(update={"scripts_dir": None})):
        assert train_argv(given, "py", "0.9.0", "/hs", "/prep", "/out", [2, 9]) == [
            "py", "-m", "speculators.train", "--verifier-name-or-path", "/m", "--data-path", "/prep",
            "--hidden-states-path", "/hs", "--on-missing", "warn", "--target-layer-ids", "2", "9",
            "--save-path", "/out", "--epochs", "3", "--lr", "0.0001", "--ttt-steps", "4"]
    assert train_command(train_argv(spec, "py", "0.9.0", "/hs", "/prep", "/out"), 2).startswith(
        "py -m torch.distributed.run ")
    assert " --nproc-per-node gpu -m speculators.train --verifier-name-or-path /m" in train_command(
        train_argv(spec, "py", "0.9.0", "/hs", "/prep", "/out"), 2)
    assert "--target-layer-ids" not in train_argv(spec, "py", "0.4.0", "/hs", None, "/out", [2, 9])


def test_target_layers_come_from_the_extract_run_or_the_spec():
    spec = TrainDraftSpec(scripts_dir="/s", verifier="/m", from_run=3)
    took = run_of(spec={"backend": "speculators", "output_dir": "/hs", "layers": [4, 8, 12]})
    assert target_layers(lambda _id: took, spec, Host(name="h")) == [4, 8, 12]
    assert target_layers(lambda _id: run_of(), spec, Host(name="h")) is None  # the scripts' default on both sides
    by_path = TrainDraftSpec(scripts_dir="/s", verifier="/m", hidden_states="/hs", layers=[5, 6])
    assert target_layers(lambda _id: took, by_path, Host(name="h")) == [5, 6]


@pytest.mark.parametrize("values", [
    {}, {"from_run": 1, "hidden_states": "/hs"}, {"hidden_states": " "}, {"hidden_states": "/h", "on_missing": "x"},
    {"from_run": 1, "layers": [2, 3]}, {"hidden_states": "/h", "layers": [2, 2]}, {"hidden_states": "/h", "layers": []},
])
def test_bad_specs(values):
    with pytest.raises(ValueError):
        TrainDraftSpec.model_validate({"scripts_dir": "/s", "verifier": "/m", **values})
