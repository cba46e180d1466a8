"""Sweep files and their plans: every point expanded and validated before anything starts, in process."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from orchestrator.config.workspace import Workspace
from orchestrator.errors import UsageError
from orchestrator.store import Store
from orchestrator.sweep import expand, label, list_sweeps, load, plan

HOSTS = "[hosts.a]\ntags = ['gpu']\n[hosts.b]\ntags = ['gpu']\n[hosts.c]\n"
HEAD = "name = 's'\nplaybook = 'command'\n"


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    (tmp_path / "hosts.toml").write_text(HOSTS)
    return Workspace(root=tmp_path, hosts_file=tmp_path / "hosts.toml")


def write(ws: Workspace, body: str) -> Path:
    path = ws.root / "s.toml"
    path.write_text(body)
    return path


def test_a_grid_with_includes_round_robin_over_tagged_hosts(ws: Workspace, store: Store) -> None:
    p = plan(ws, store, write(ws, HEAD + "tags = ['gpu']\nretries = 2\n[spec]\ncmd = 'true'\nenv = {K = 'v'}\n"
                              "[matrix]\npoll_min = [1, 2]\n'env.A' = ['x', 'y']\n"
                              "[[include]]\nenv = {A = 'x'}\npoll_min = 1\n[[include]]\nenv.A = 'z'\n"))
    assert [pt.diff for pt in p.points] == [
        {"poll_min": 1, "env.A": "x"}, {"poll_min": 1, "env.A": "y"}, {"poll_min": 2, "env.A": "x"},
        {"poll_min": 2, "env.A": "y"}, {"env.A": "z"}]  # the first include is already in the grid
    assert [pt.host for pt in p.points] == ["a", "b", "a", "b", "a"]
    assert (p.points[2].spec.poll_min, p.points[2].spec.env) == (2, {"K": "v", "A": "x"})
    assert p.points[4].spec.env == {"K": "v", "A": "z"}  # dotted keys reach into the base table
    assert p.file.retries == 2 and len(p.file_hash) == 64 and p.instance == ""
    assert p.points[4].label == "env.A=z" and label({}) == "base spec"
    assert list_sweeps(store) == []  # planning records nothing


def test_points_asking_for_gpus_get_their_own_lanes(ws: Workspace, store: Store) -> None:
    p = plan(ws, store, write(ws, HEAD + "hosts = ['c']\n[spec]\ncmd = 'true'\n[matrix]\ngpus = [[1, 0], [2]]\n"))
    assert [pt.lane for pt in p.points] == ["c:0,1", "c:2"]


def test_a_clusters_points_share_one_lane_bounded_by_max_parallel(ws: Workspace, store: Store) -> None:
    with open(ws.hosts_file, "a") as f:
        f.write("[hosts.k]\nscheduler = 'slurm'\ngpus = 8\nworkdir = '/shared'\n")
    p = plan(ws, store, write(ws, HEAD + "hosts = ['k']\nmax_parallel = 2\n[spec]\ncmd = 'true'\n"
                              "[matrix]\ngpus = [[1, 0], [2]]\n"))
    assert [pt.lane for pt in p.points] == ["k", "k"] and p.file.max_parallel == 2


@pytest.mark.parametrize("body, message", [
    ("name = 'x'\nplaybook = 'command'\n", "give either hosts = [...] or tags = [...]"),
    (HEAD + "hosts = ['a']\ntags = ['gpu']\n", "give either hosts"),
    (HEAD + "hosts = ['nope']\n[spec]\ncmd = 'true'\n", "unknown host"),
    (HEAD + "tags = ['h200']\n[spec]\ncmd = 'true'\n", "no host of the inventory has the tags h200"),
    (HEAD + "hosts = ['a']\n[matrix]\ncmd = 'true'\n", "matrix.cmd: expected a non-empty list"),
    (HEAD + "hosts = ['a']\n[matrix]\ncmd = []\n", "matrix.cmd: expected a non-empty list"),
    (HEAD + "hosts = ['a']\n[spec]\ncmd = 'true'\n[[include]]\n", "include[0]: an empty point"),
    ("name = 'x'\nplaybook = 'nope'\nhosts = ['a']\n", "unknown playbook"),
    (HEAD + "hosts = ['a']\nmax_parallel = 0\n", "max_parallel: Input should be greater than or equal to 1"),
    (HEAD + "hosts = ['a']\nretries = -1\n", "retries"),
    (HEAD + "hosts = ['a']\nsurprise = 1\n", "surprise"),
    ("name = 'bad name!'\nplaybook = 'command'\nhosts = ['a']\n", "name"),
    (HEAD + "hosts = ['a']\n[spec]\ncmd = 1\n", "point 0 (base spec)"),
    (HEAD + "hosts = ['a', 'b']\n[spec]\ncmd = 'true'\n[matrix]\nstall_factor = [2, 3, 0.5]\n",
     "point 2 (stall_factor=0.5)"),
    ("name = \n", "invalid TOML"),
])
def test_an_invalid_file_or_point_is_refused(ws: Workspace, store: Store, body: str, message: str) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        plan(ws, store, write(ws, body))
    assert list_sweeps(store) == []


def test_load_checks_the_file_alone(ws: Workspace) -> None:
    file = load(write(ws, HEAD + "hosts = ['anywhere']\n[matrix]\nx = [1, 2, 1]\n"))  # no inventory asked
    assert expand(file) == [{"x": 1}, {"x": 2}]
    with pytest.raises(UsageError, match="sweep file not found"):
        load(ws.root / "missing.toml")
