import pytest

from orchestrator.config.spec import load, merge_sets, parse_value
from orchestrator.errors import SpecError
from playbooks.command import CommandSpec
from playbooks.extract_hidden_states import ExtractSpec


def test_set_values_are_toml_literals_else_strings():
    assert parse_value("[2,30,58]") == [2, 30, 58]
    assert parse_value("true") is True
    assert parse_value("4") == 4
    assert parse_value("/data/kimi") == "/data/kimi"
    assert parse_value("python -m x --y=1") == "python -m x --y=1"


def test_dotted_keys_reach_into_tables():
    merged = merge_sets({"env": {"A": "1"}}, ["env.B=2", "env.A=x y"])
    assert merged == {"env": {"A": "x y", "B": 2}}


def test_file_then_sets(tmp_path):
    f = tmp_path / "spec.toml"
    f.write_text('model = "/m"\nlayers = [1, 2]\nbatch_size = 2\n')
    spec = load(ExtractSpec, f, ["layers=[3,4]"])
    assert (spec.model, spec.layers, spec.batch_size) == ("/m", [3, 4], 2)


def test_all_invalid_fields_in_one_message_one_per_line():
    with pytest.raises(SpecError) as exc:
        load(ExtractSpec, None, ["batch_size=0", "dtype=int3", "colour=blue", "layers=x"])
    head, *lines = str(exc.value).splitlines()
    assert head == "invalid spec, 4 problems:"
    assert sorted(lines) == [
        "batch_size = 0 (--set): must be greater than 0",
        "colour = \"blue\" (--set): unknown key; not a key of this spec",
        "dtype = \"int3\" (--set): must be 'float32', 'bfloat16' or 'float16'",
        "layers = \"x\" (--set): must be a valid list (expected list of integer or none)",
    ]
    assert exc.value.exit_code == 2


def test_spec_errors_name_the_file_the_key_and_a_close_key(tmp_path):
    f = tmp_path / "spec.toml"
    f.write_text('cmdd = "python x.py"\ngpu = [0]\non_stall = "kil"\n')
    with pytest.raises(SpecError) as exc:
        load(CommandSpec, f, ["poll_min=-1"])
    lines = str(exc.value).splitlines()[1:]
    assert f'cmdd = "python x.py" ({f}): unknown key; did you mean \'cmd\'?' in lines
    assert f"gpu = [0] ({f}): unknown key; did you mean 'gpus'?" in lines
    assert f'on_stall = "kil" ({f}): must be \'warn\', \'kill\' or \'dump\'; did you mean \'kill\'?' in lines
    assert "poll_min = -1 (--set): must be greater than 0" in lines
    assert any(line.startswith("cmd: required (text") for line in lines)


def test_one_problem_is_one_line():
    with pytest.raises(SpecError) as exc:
        load(CommandSpec, None, ["cmd=true", "stall_factor=1"])
    assert str(exc.value) == "invalid spec: stall_factor = 1 (--set): must be greater than 1"


def test_command_needs_cmd_and_a_valid_regex():
    with pytest.raises(SpecError, match="cmd"):
        load(CommandSpec, None, [])
    with pytest.raises(SpecError, match="ready_pattern"):
        load(CommandSpec, None, ["cmd=true", "ready_pattern=(unclosed"])


def test_env_names_must_be_identifiers():
    with pytest.raises(SpecError, match="env"):
        load(CommandSpec, None, ["cmd=true", "env={'A;touch /tmp/x' = '1'}"])


def test_malformed_file(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("model = \n")
    with pytest.raises(SpecError, match="invalid TOML"):
        load(ExtractSpec, f, [])
    with pytest.raises(SpecError, match="not found"):
        load(ExtractSpec, tmp_path / "missing.toml", [])
    with pytest.raises(SpecError, match="key=value"):
        load(ExtractSpec, None, ["novalue"])


def test_text_fields_take_the_raw_text():
    spec = load(CommandSpec, None, ["cmd=true", "env.A=1", "env.B=[x]", "cwd=2024-01-01"])
    assert (spec.cmd, spec.env, spec.cwd) == ("true", {"A": "1", "B": "[x]"}, "2024-01-01")
    assert load(ExtractSpec, None, ["max_samples=3"]).max_samples == 3


def test_huge_numbers_are_a_clear_error_in_every_field(tmp_path):
    """A value that would overflow a wait (a timedelta, a sleep) is refused before anything starts."""
    with pytest.raises(SpecError) as exc:
        load(ExtractSpec, None, ["poll_min=1e300", "poll_max=1e10", "stall_factor=1e20", "gpus=[0, 5000]",
                                 "layers=[2, 100000000000000000000]", "batch_size=99999999999"])
    lines = sorted(str(exc.value).splitlines()[1:])
    assert exc.value.exit_code == 2 and len(lines) == 6, lines
    assert "poll_min = 1e+300 (--set): must be less than or equal to 86400" in lines
    assert "poll_max = 10000000000.0 (--set): must be less than or equal to 86400" in lines
    assert any(line.startswith("layers = ") and "too large" in line for line in lines), lines
    assert any(line.startswith("gpus = ") and "from 0 to 1023" in line for line in lines), lines


def test_huge_numbers_in_hosts_toml_are_a_clear_error(tmp_path):
    from orchestrator.config.hosts import Inventory
    from orchestrator.errors import UsageError

    (tmp_path / "hosts.toml").write_text("[hosts.gpu01]\npoll_min = 1e300\nunreachable_give_up_s = 1e10\n"
                                         "gpus = 100000\n")
    with pytest.raises(UsageError) as exc:
        Inventory.load(tmp_path / "hosts.toml", tmp_path)
    message = str(exc.value)
    assert exc.value.exit_code == 2 and "\n" not in message
    for field in ("poll_min", "unreachable_give_up_s", "gpus"):
        assert f"hosts.gpu01.{field}: " in message and "less than or equal" in message
