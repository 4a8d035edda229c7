"""Every ``RemoteTargetModel`` option, where it can be set and how its value is read: one table.

A value comes from the first of these that sets it:

1. the constructor argument (anything but None);
2. the option's ``SPEC_SERVE_*`` environment variable;
3. under NeMo's EAGLE-3 recipe (spec_serve.integrations.nemo): NeMo's own variable for it
   (``NEMO_EAGLE_ENABLE_NCCL``), then the recipe's YAML key (``recipe_args.<key>``);
4. the default.

That is the CLI's order too (command line, environment, file). A value that does not parse fails with
one line naming where it came from and what is allowed. docs/client-options.md shows :data:`TABLE`
(``tests/client/test_client_options.py`` checks the two agree). Nothing else in the client reads the
environment for an option.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from spec_serve.protocol import digest
from spec_serve.protocol.commands import WireDtype
from spec_serve.telemetry.logs import event

log = logging.getLogger("spec_serve.client")

# Words a switch takes in the environment or YAML (any case); Python bools pass as themselves.
BOOL_WORDS: dict[str, Any] = {"1": True, "true": True, "yes": True, "on": True,
                              "0": False, "false": False, "no": False, "off": False}
# The values of `compact`: the one place they are listed (its parser, error and docs read them here).
# "auto": the worker picks per reply, compact when it leaves the worker's host (docs/reply-paths.md).
COMPACT_WORDS: dict[str, Any] = {**BOOL_WORDS, "auto": "auto"}
# The values of `wire_dtype`: "auto", the model's dtype (as vLLM's kv_cache_dtype="auto"), or a WireDtype.
WIRE_DTYPE_WORDS: dict[str, Any] = {"auto": "auto", **{d.value: d.value for d in WireDtype}}
# The block of NeMo's recipe YAML that holds spec-serve's own options: recipe_args.spec_serve.<option>.
YAML_SECTION = "spec_serve"
# Batches in flight before generate_batch_async blocks, unless set. A worker across hosts gets its next request
# only when a reply came back, and a reply's way back can outlast a forward on short rows: 4 keeps it computing
# (BENCHMARKS.md, "Training rows across hosts"). It bounds a caller's own loop; a synchronous caller has one.
PREFETCH_DEPTH = 4
# NeMo variables spec-serve cannot honour, and why: setting one fails at setup instead of being ignored.
NEMO_REFUSED_ENV = {
    "NEMO_EAGLE_NCCL_PORT": "it is NeMo's client-side NCCL rendezvous port; a spec-serve worker hosts each "
                            "binding's rendezvous on a port it picks (docs/nccl.md): unset NEMO_EAGLE_NCCL_PORT",
}


class Invalid(ValueError):
    """A parser's own account of what is wrong with a value (else the error line says what is allowed)."""


@dataclasses.dataclass(frozen=True)
class Parser:
    """Turns a value (a Python value, or the string an environment variable holds) into an option's value;
    ``allowed`` says in words what it accepts, for the error line."""

    convert: Callable[[Any], Any]
    allowed: str


def _whole(minimum: int) -> Parser:
    def convert(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError
        number = int(value)
        if number < minimum:
            raise ValueError
        return number
    return Parser(convert, f"a whole number >= {minimum}")


def _positive(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError
    number = float(value)
    if not number > 0:
        raise ValueError
    return number


def _words(words: Mapping[str, Any]) -> Parser:
    """A parser for a fixed set of words (any case); Python values are matched by their lower-case name."""
    def convert(value: Any) -> Any:
        key = str(value).strip().lower()
        if key not in words:
            raise ValueError
        return words[key]
    return Parser(convert, "one of " + ", ".join(words))


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError
    return value.strip()


def _device(value: Any) -> Any:
    import torch

    return value if isinstance(value, torch.device) else torch.device(_text(value))


def _existing(kind: str) -> Parser:
    def convert(value: Any) -> Path:
        path = Path(_text(str(value)))
        if not (path.is_dir() if kind == "directory" else path.is_file()):
            raise ValueError
        return path
    return Parser(convert, f"an existing {kind}")


def _broker(value: Any) -> str:
    """A broker frontend URL; NeMo's ``remote_urls`` list must hold exactly one (duplicates allowed)."""
    from spec_serve.protocol.commands import CLIENT_PORT_HINT, FRONTEND_PORT
    from spec_serve.transport.sockets import check_connect_url

    given = list(dict.fromkeys(value)) if isinstance(value, (list, tuple)) else [value]
    if len(given) != 1:
        raise Invalid(f"spec-serve connects to one broker frontend (its workers register there), got {len(given)} "
                      "URLs; NeMo's recipe: remote_urls: ['tcp://BROKER:5555']")
    try:
        return check_connect_url(given[0], CLIENT_PORT_HINT, FRONTEND_PORT)
    except ValueError as e:
        raise Invalid(str(e)) from None


BROKER = Parser(_broker, "a ZeroMQ URL of the broker's frontend, e.g. tcp://BROKER:5555")
TEXT = Parser(_text, "a non-empty string")
POSITIVE = Parser(_positive, "a number > 0")
SWITCH = _words(BOOL_WORDS)


@dataclasses.dataclass(frozen=True)
class Option:
    """One row of :data:`TABLE`. ``name``: the keyword of RemoteTargetModel (``curve_*``: the fields of its
    ``security``); ``yaml``: its keys under NeMo's ``recipe_args`` (the first present wins; empty: NeMo
    sets it itself); ``nemo_env``: NeMo's own variable for it."""

    name: str
    env: str
    parser: Parser
    default: Any
    yaml: tuple[str, ...]
    doc: str
    nemo_env: str | None = None


def _section(name: str) -> tuple[str, ...]:
    return (f"{YAML_SECTION}.{name}",)


TABLE: tuple[Option, ...] = (
    Option("broker_url", "SPEC_SERVE_CLIENT_BROKER", BROKER, None, ("remote_urls", "remote_url"),
           "the broker's frontend (required)"),
    Option("service", "SPEC_SERVE_SERVICE", TEXT, "default", _section("service"), "the target's service name"),
    Option("device", "SPEC_SERVE_CLIENT_DEVICE", Parser(_device, "a torch device, e.g. cuda:0 or cpu"), "cpu", (),
           "where results land (NeMo passes its own)"),
    Option("timeout", "SPEC_SERVE_TIMEOUT", POSITIVE, 120.0, ("remote_timeout",), "seconds a request may take"),
    Option("max_retries", "SPEC_SERVE_MAX_RETRIES", _whole(0), 3, ("remote_max_retries",),
           "re-sends of a request lost with a worker or the broker"),
    Option("prefetch_depth", "SPEC_SERVE_PREFETCH_DEPTH", _whole(1), PREFETCH_DEPTH, _section("prefetch_depth"),
           "batches in flight before generate_batch_async blocks"),
    Option("num_shards", "SPEC_SERVE_NUM_SHARDS", _whole(1), 1, _section("num_shards"),
           "workers one batch is split across, by rows"),
    Option("compact", "SPEC_SERVE_COMPACT", _words(COMPACT_WORDS), "auto", _section("compact"),
           "ship hidden state + argmax, rebuild target_probs on the client: auto (when the reply leaves "
           "the worker's host), always or never (docs/reply-paths.md)"),
    Option("wire_dtype", "SPEC_SERVE_WIRE_DTYPE", _words(WIRE_DTYPE_WORDS), "auto", _section("wire_dtype"),
           "hidden states in the model dtype (auto) or fp8: float8_e4m3 with a scale per token, restored to "
           "the model dtype here; half the hidden-state bytes, within docs/equality.md's stated error"),
    Option("enable_nccl", "SPEC_SERVE_ENABLE_NCCL", SWITCH, False, _section("enable_nccl"),
           "bind a worker and receive over a private NCCL pair (docs/nccl.md)", nemo_env="NEMO_EAGLE_ENABLE_NCCL"),
    Option("nccl_timeout", "SPEC_SERVE_NCCL_TIMEOUT", POSITIVE, 30.0, _section("nccl_timeout"),
           "bound on binding, group formation and each transfer"),
    Option("nccl_retry_s", "SPEC_SERVE_NCCL_RETRY_S", POSITIVE, 30.0, _section("nccl_retry_s"),
           "frames this long after a failed bind before the next"),
    Option("insecure_network", "SPEC_SERVE_INSECURE_NETWORK", SWITCH, False, _section("insecure_network"),
           "let enable_nccl's rendezvous listen beyond loopback unauthenticated (protected mode)"),
    Option("same_host_plane", "SPEC_SERVE_SAME_HOST_PLANE", SWITCH, True, _section("same_host_plane"),
           "take replies of a same-host worker through shared memory / CUDA IPC"),
    Option("verify", digest.VERIFY_ENV, _words({m: m for m in digest.VERIFY_MODES}), "all", _section("verify"),
           "end-to-end digest check of reply bytes"),
    Option("connect_timeout", "SPEC_SERVE_CONNECT_TIMEOUT", POSITIVE, 30.0, _section("connect_timeout"),
           "seconds to hear from a broker before BrokerUnreachable"),
    Option("heartbeat_interval", "SPEC_SERVE_HEARTBEAT_INTERVAL", POSITIVE, 1.0, _section("heartbeat_interval"),
           "seconds between heartbeats"),
    Option("liveness", "SPEC_SERVE_HEARTBEAT_LIVENESS", _whole(1), 4, _section("liveness"),
           "missed heartbeats before the broker counts as lost"),
    Option("max_message_bytes", "SPEC_SERVE_MAX_MESSAGE_BYTES", _whole(1), 8 << 30, _section("max_message_bytes"),
           "largest reply taken"),
    Option("advertise_host", "SPEC_SERVE_ADVERTISE_HOST", TEXT, None, _section("advertise_host"),
           "address workers reach this client's data socket at (default: the route to the broker)"),
    Option("cache", "SPEC_SERVE_CACHE", Parser(lambda v: Path(_text(str(v))), "a directory path"), None,
           _section("cache"), "a supervision cache directory, local or shared by many ranks: rows are read "
           "from it, and what misses is fetched and stored (docs/cache.md)"),
    Option("cache_max_bytes", "SPEC_SERVE_CACHE_MAX_BYTES", _whole(0), 0, _section("cache_max_bytes"),
           "the cache's size bound, oldest segments evicted first (0: none)"),
    Option("cache_dtype", "SPEC_SERVE_CACHE_DTYPE", _words({"native": "native", "fp8": "fp8"}), "native",
           _section("cache_dtype"), "how the cache stores hidden states: native (bit-equal) or fp8 (half the bytes)"),
    Option("curve_secret_key", "SPEC_SERVE_CURVE_SECRET_KEY", _existing("file"), None, _section("curve_secret_key"),
           "CURVE: this client's secret key file (security=)"),
    Option("curve_server_key", "SPEC_SERVE_CURVE_SERVER_KEY", _existing("file"), None, _section("curve_server_key"),
           "CURVE: the broker's public key file"),
    Option("curve_worker_keys_dir", "SPEC_SERVE_CURVE_WORKER_KEYS_DIR", _existing("directory"), None,
           _section("curve_worker_keys_dir"), "CURVE: public keys of the workers whose replies are admitted"),
)
BY_NAME = {option.name: option for option in TABLE}
_CURVE = ("curve_secret_key", "curve_server_key", "curve_worker_keys_dir")


@dataclasses.dataclass(frozen=True)
class ClientOptions:
    """Resolved options: ``values`` by option name (``security`` in place of the ``curve_*`` rows) and,
    for each, where it came from (``sources``: ``num_shards=`` for the argument, ``SPEC_SERVE_NUM_SHARDS``,
    ``recipe_args.spec_serve.num_shards`` or ``default``)."""

    values: dict[str, Any]
    sources: dict[str, str]

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def client_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``RemoteTargetModel`` (``broker_url`` first), every one explicit."""
        return dict(self.values)


def resolve(explicit: Mapping[str, Any], *, config: Any = None, nemo: bool = False,
            environ: Mapping[str, str] | None = None) -> ClientOptions:
    """Every option's value and source (see the module docstring for the order).

    ``explicit``: constructor arguments, None meaning unset (``security``: a ``Security``, which then wins
    over the ``curve_*`` rows); ``config``: NeMo's ``recipe_args`` (anything with ``.get(key)``, or a dict),
    read only with ``nemo``. ``ValueError``, one line, for a value that does not parse or options that conflict.
    """
    environ = os.environ if environ is None else environ
    if nemo:
        _refuse_nemo_env(environ)
        _check_section(config)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for option in TABLE:
        source, raw = _first_set(option, explicit, config if nemo else None, nemo, environ)
        if source is None:
            values[option.name] = option.default
            sources[option.name] = "default"
            continue
        values[option.name] = _parse(option, source, raw)
        sources[option.name] = source
    if values["broker_url"] is None:
        raise ValueError("no broker URL: pass RemoteTargetModel(broker_url) or set SPEC_SERVE_CLIENT_BROKER (NeMo's "
                         "recipe: recipe_args.remote_urls: ['tcp://BROKER:5555'])")
    _assemble_security(values, sources, explicit.get("security"))
    _check_conflicts(values, sources)
    _log_chosen(values, sources)
    return ClientOptions(values, sources)


def _first_set(option: Option, explicit: Mapping[str, Any], config: Any, nemo: bool,
               environ: Mapping[str, str]) -> tuple[str | None, Any]:
    """``(source, raw value)`` of the first source that sets ``option``, or ``(None, None)``."""
    if explicit.get(option.name) is not None:
        return f"{option.name}=", explicit[option.name]
    if environ.get(option.env, "") != "":
        return option.env, environ[option.env]
    if nemo and option.nemo_env is not None and environ.get(option.nemo_env, "") != "":
        return option.nemo_env, environ[option.nemo_env]
    for key in option.yaml if config is not None else ():
        value = _lookup(config, key)
        if value is not None and not (isinstance(value, (str, list, tuple)) and len(value) == 0):
            return f"recipe_args.{key}", value  # as NeMo reads remote_urls: empty means unset
    return None, None


def _parse(option: Option, source: str, raw: Any) -> Any:
    try:
        return option.parser.convert(raw)
    except (ValueError, TypeError, RuntimeError) as e:
        shown = f"{source}{raw!r}" if source.endswith("=") else f"{source}={raw!r}"
        why = str(e) if isinstance(e, Invalid) else option.parser.allowed
        raise ValueError(f"{shown} is not valid for {option.name}: {why}") from None


def _lookup(config: Any, dotted: str) -> Any:
    node = config
    for part in dotted.split("."):
        getter = getattr(node, "get", None)
        if getter is None:
            return None
        node = getter(part, None)
    return node


def _section_keys(config: Any) -> list[str]:
    section = _lookup(config, YAML_SECTION) if config is not None else None
    if section is None:
        return []
    if hasattr(section, "to_dict"):  # NeMo's ConfigNode
        section = section.to_dict()
    if not isinstance(section, Mapping):
        raise ValueError(f"recipe_args.{YAML_SECTION} must be a mapping of spec-serve options, got {section!r}")
    return [str(k) for k in section]


def _check_section(config: Any) -> None:
    """A typo in the YAML fails at setup rather than leaving an option at its default."""
    known = {key.split(".", 1)[1] for option in TABLE for key in option.yaml if key.startswith(YAML_SECTION + ".")}
    unknown = sorted(set(_section_keys(config)) - known)
    if unknown:
        raise ValueError(f"recipe_args.{YAML_SECTION} has unknown keys {unknown}; known: {sorted(known)} "
                         "(docs/client-options.md)")


def _refuse_nemo_env(environ: Mapping[str, str]) -> None:
    for name, reason in NEMO_REFUSED_ENV.items():
        if environ.get(name, "") != "":
            raise ValueError(f"{name}={environ[name]!r} cannot be honoured: {reason}")


def _assemble_security(values: dict[str, Any], sources: dict[str, str], explicit: Any) -> None:
    """``security``: the explicit ``Security``, else one built from the ``curve_*`` rows (all three, or none)."""
    curve = {name: values.pop(name) for name in _CURVE}
    curve_sources = {name: sources.pop(name) for name in _CURVE}
    if explicit is not None:
        values["security"], sources["security"] = explicit, "security="
        return
    given = [name for name in _CURVE if curve[name] is not None]
    if not given:
        values["security"], sources["security"] = None, "default"
        return
    missing = [BY_NAME[name].env for name in _CURVE if curve[name] is None]
    if missing:
        raise ValueError(f"CURVE is on ({curve_sources[given[0]]}) but not set: {', '.join(missing)}; a client "
                         f"needs its secret key, the broker's public key and the workers' public keys")
    from spec_serve.transport.sockets import Security

    values["security"] = Security(curve["curve_secret_key"], server_key_file=curve["curve_server_key"],
                                  worker_keys_dir=curve["curve_worker_keys_dir"])
    sources["security"] = curve_sources["curve_secret_key"]


def _check_conflicts(values: Mapping[str, Any], sources: Mapping[str, str]) -> None:
    if values["enable_nccl"] and values["security"] is not None:
        raise ValueError(f"enable_nccl (from {_shown(sources['enable_nccl'])}) cannot be combined with CURVE security "
                         f"(from {_shown(sources['security'])}): the NCCL rendezvous (TCPStore, gloo/NCCL "
                         "connections) is not authenticated; turn NCCL off and frames travel over CURVE")
    if values["cache"] is not None and values["wire_dtype"] == WireDtype.FP8.value and values["cache_dtype"] != "fp8":
        raise ValueError(f"wire_dtype='fp8' (from {_shown(sources['wire_dtype'])}) rounds the hidden states the "
                         f"cache (from {_shown(sources['cache'])}) would store as {values['cache_dtype']} rows, which "
                         "promise the target's bits: set cache_dtype='fp8' too, or wire_dtype='auto'")


def _shown(source: str) -> str:
    return source.rstrip("=")


def _log_chosen(values: Mapping[str, Any], sources: Mapping[str, str]) -> None:
    """One INFO line with what came from the environment or the recipe (not the constructor, not defaults)."""
    chosen = {name: f"{values[name]}({source})" for name, source in sources.items()
              if source != "default" and not source.endswith("=")}
    if chosen:
        event(log, logging.INFO, "client.options", **chosen)
