"""``--config FILE.yaml`` on every spec-serve command: keys are flag names, the command line wins."""

from __future__ import annotations

import json

import click
import pytest
from click.testing import CliRunner

from spec_serve.tools.cli import main
from spec_serve.tools.cli_config import ConfigGroup


@click.group(cls=ConfigGroup)
def group():
    pass


@group.command()
@click.option("--max-batch-tokens", default=0, type=int, envvar="TEST_MBT")
@click.option("--aux-layer-ids", default=None)
@click.option("--broker", "broker_url", default="tcp://127.0.0.1:5556")
@click.option("--inexact-batching", is_flag=True)
def show(max_batch_tokens, aux_layer_ids, broker_url, inexact_batching):
    click.echo(json.dumps([max_batch_tokens, aux_layer_ids, broker_url, inexact_batching]))


def _run(args, env=None):
    return CliRunner().invoke(group, args, env=env or {})


def test_every_command_of_the_cli_takes_config():
    for name, command in main.commands.items():
        assert any(p.name == "config" for p in command.params), name


def test_file_values_dash_and_underscore_keys_and_lists(tmp_path):
    cfg = tmp_path / "w.yaml"
    cfg.write_text("max-batch-tokens: 4096\naux_layer_ids: [1, 15, 28]\nbroker: tcp://10.0.0.1:5556\n"
                   "inexact-batching: true\n")
    result = _run(["show", "--config", str(cfg)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == [4096, "1,15,28", "tcp://10.0.0.1:5556", True]


def test_command_line_then_env_then_file(tmp_path):
    cfg = tmp_path / "w.yaml"
    cfg.write_text("max-batch-tokens: 4096\n")
    assert json.loads(_run(["show", "--config", str(cfg), "--max-batch-tokens", "8"]).output)[0] == 8
    assert json.loads(_run(["show", "--config", str(cfg)], env={"TEST_MBT": "16"}).output)[0] == 16
    # The flag may come before --config: the file is read first anyway.
    assert json.loads(_run(["show", "--max-batch-tokens", "8", "--config", str(cfg)]).output)[0] == 8


def test_config_from_environment(tmp_path):
    cfg = tmp_path / "w.yaml"
    cfg.write_text("broker: tcp://10.0.0.2:5556\n")
    result = _run(["show"], env={"SPEC_SERVE_CONFIG": str(cfg)})
    assert json.loads(result.output)[2] == "tcp://10.0.0.2:5556"


@pytest.mark.parametrize("text, message", [
    ("max-batch-token: 4096\n", "'max-batch-token' is not a flag"),
    ("- 1\n- 2\n", "must hold a mapping"),
    ("a: [1\n", "not valid YAML"),
])
def test_bad_files_are_one_line_usage_errors(tmp_path, text, message):
    cfg = tmp_path / "w.yaml"
    cfg.write_text(text)
    result = _run(["show", "--config", str(cfg)])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
    if "not a flag" in message:
        assert "max-batch-tokens" in result.output  # the keys it does take


def test_missing_file_names_it(tmp_path):
    result = _run(["show", "--config", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2 and "nope.yaml" in result.output


def test_real_command_reads_its_flags_from_the_file(tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text("layers: 3\nvocab: 300\n")
    out = tmp_path / "tiny"
    result = CliRunner().invoke(main, ["make-tiny-target", str(out), "--config", str(cfg), "--layers", "2"])
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["vocab_size"]) == (2, 300)
