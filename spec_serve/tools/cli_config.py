"""``--config FILE.yaml`` for every ``spec-serve`` command (as ``vllm serve`` and SGLang have).

The file is a YAML mapping whose keys are the command's flag names, with dashes or underscores
(``max-batch-tokens: 4096`` or ``max_batch_tokens: 4096``); lists are accepted where a flag takes
comma-separated values (``aux-layer-ids: [1, 15, 28]``). Values go into click's ``default_map``, so
precedence is: command line, then the flag's ``SPEC_SERVE_*`` environment variable, then the file,
then the built-in default. An unknown key is a usage error that lists the keys the command takes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

CONFIG_ENVVAR = "SPEC_SERVE_CONFIG"


def _flag_names(command: click.Command) -> dict[str, click.Parameter]:
    """``{key: parameter}`` for each long flag of ``command``, keys with underscores."""
    names: dict[str, click.Parameter] = {}
    for param in command.params:
        if not isinstance(param, click.Option) or param.name == "config":
            continue
        for opt in (*param.opts, *param.secondary_opts):
            if opt.startswith("--"):
                names[opt[2:].replace("-", "_")] = param
    return names


def _value(param: click.Parameter, value: Any) -> Any:
    """A YAML value as the flag would have been given: lists joined for comma-separated flags."""
    if isinstance(value, (list, tuple)) and not param.multiple and param.nargs == 1:
        return ",".join(str(v) for v in value)
    return value


def load(ctx: click.Context, param: click.Parameter, path: str | None) -> str | None:
    """Eager callback of ``--config``: read the file into ``ctx.default_map`` before other flags."""
    if not path:
        return path
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise click.BadParameter(f"cannot read {path}: {e.strerror}", ctx, param) from None
    except yaml.YAMLError as e:
        raise click.BadParameter(f"{path} is not valid YAML: {e}", ctx, param) from None
    if data is None:
        return path
    if not isinstance(data, dict):
        raise click.BadParameter(f"{path} must hold a mapping of flag names to values", ctx, param)
    flags = _flag_names(ctx.command)
    defaults: dict[str, Any] = {}
    for key, value in data.items():
        flag = flags.get(str(key).replace("-", "_"))
        if flag is None:
            known = ", ".join(sorted(k.replace("_", "-") for k in flags))
            raise click.BadParameter(f"{path}: {key!r} is not a flag of `{ctx.command_path}`; known: {known}",
                                     ctx, param)
        defaults[flag.name] = _value(flag, value)
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return path


def config_option() -> click.Option:
    """The ``--config`` option, processed before every other flag of its command."""
    return click.Option(["--config"], type=click.Path(dir_okay=False), envvar=CONFIG_ENVVAR, is_eager=True,
                        expose_value=False, callback=load,
                        help="YAML file of flag values (keys: flag names, dashes or underscores); flags on the "
                             f"command line and their environment variables win [env {CONFIG_ENVVAR}].")


class ConfigGroup(click.Group):
    """A group whose every command, wherever defined, takes ``--config``."""

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        if not any(p.name == "config" for p in cmd.params):
            cmd.params.insert(0, config_option())
        super().add_command(cmd, name)
