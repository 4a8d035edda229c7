"""Client options (spec_serve/client/options.py): one table, read from arguments, the environment, NeMo's
recipe YAML and NeMo's variables, in that order; a bad value is one line naming its source and what is
allowed; docs/client-options.md shows the same table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fakes.nemo_standin import ConfigNode
from spec_serve.client import RemoteTargetModel, options
from spec_serve.tools.launch import free_port

DOC = Path(__file__).resolve().parents[2] / "docs" / "client-options.md"
URL = "tcp://127.0.0.1:5555"


def _resolve(explicit=None, environ=None, yaml=None, nemo=False, **kwargs):
    config = ConfigNode(yaml) if yaml is not None else None
    return options.resolve({"broker_url": URL, **(explicit or {})}, environ=environ or {}, config=config,
                           nemo=nemo, **kwargs)


def test_an_argument_wins_over_the_environment_which_wins_over_the_yaml():
    yaml = {"remote_timeout": 30, "spec_serve": {"num_shards": 3, "compact": True, "verify": "off"}}
    environ = {"SPEC_SERVE_NUM_SHARDS": "2", "SPEC_SERVE_COMPACT": "false"}
    got = _resolve({"compact": True}, environ, yaml, nemo=True)
    assert (got["compact"], got.sources["compact"]) == (True, "compact=")
    assert (got["num_shards"], got.sources["num_shards"]) == (2, "SPEC_SERVE_NUM_SHARDS")
    assert (got["verify"], got.sources["verify"]) == ("off", "recipe_args.spec_serve.verify")
    assert (got["timeout"], got.sources["timeout"]) == (30.0, "recipe_args.remote_timeout")
    assert (got["prefetch_depth"], got.sources["prefetch_depth"]) == (4, "default")
    # NeMo's singular key, read when remote_urls is empty, as NeMo reads it.
    singular = _resolve({"broker_url": None}, {}, {"remote_urls": [], "remote_url": "tcp://b:5555"}, nemo=True)
    assert (singular["broker_url"], singular.sources["broker_url"]) == ("tcp://b:5555", "recipe_args.remote_url")
    # The YAML is NeMo's: a plain client never reads it.
    assert _resolve({}, {}, yaml)["num_shards"] == 1


def test_every_option_is_read_from_its_variable():
    """Each row of the table, set through its variable alone, reaches the resolved value."""
    values = {"SPEC_SERVE_CLIENT_BROKER": ("tcp://b:1", "tcp://b:1"), "SPEC_SERVE_SERVICE": ("llama", "llama"),
              "SPEC_SERVE_CLIENT_DEVICE": ("cpu", "cpu"), "SPEC_SERVE_TIMEOUT": ("7.5", 7.5),
              "SPEC_SERVE_MAX_RETRIES": ("0", 0), "SPEC_SERVE_PREFETCH_DEPTH": ("3", 3),
              "SPEC_SERVE_NUM_SHARDS": ("4", 4), "SPEC_SERVE_COMPACT": ("ON", True),
              "SPEC_SERVE_WIRE_DTYPE": ("FP8", "fp8"),
              "SPEC_SERVE_ENABLE_NCCL": ("yes", True), "SPEC_SERVE_NCCL_TIMEOUT": ("5", 5.0),
              "SPEC_SERVE_NCCL_RETRY_S": ("6", 6.0), "SPEC_SERVE_SAME_HOST_PLANE": ("0", False),
              "SPEC_SERVE_INSECURE_NETWORK": ("1", True),
              "SPEC_SERVE_VERIFY": ("sampled", "sampled"), "SPEC_SERVE_CONNECT_TIMEOUT": ("2", 2.0),
              "SPEC_SERVE_HEARTBEAT_INTERVAL": ("0.5", 0.5), "SPEC_SERVE_HEARTBEAT_LIVENESS": ("9", 9),
              "SPEC_SERVE_MAX_MESSAGE_BYTES": ("1024", 1024), "SPEC_SERVE_ADVERTISE_HOST": ("10.0.0.7", "10.0.0.7"),
              "SPEC_SERVE_CACHE": ("/data/cache", Path("/data/cache")), "SPEC_SERVE_CACHE_MAX_BYTES": ("5", 5),
              "SPEC_SERVE_CACHE_DTYPE": ("FP8", "fp8")}
    curve = {o.env for o in options.TABLE if o.name.startswith("curve")}  # test_curve_from_the_environment
    assert {o.env for o in options.TABLE} - curve == set(values)
    got = options.resolve({}, environ={k: raw for k, (raw, _) in values.items()})
    by_env = {o.env: o.name for o in options.TABLE}
    for env, (_, want) in values.items():
        name = by_env[env]
        value = got[name]
        assert (str(value) if name == "device" else value) == want, env
        assert got.sources[name] == env


def test_curve_from_the_environment(tmp_path):
    secret, server, workers = tmp_path / "client.key_secret", tmp_path / "broker.key", tmp_path / "workers"
    secret.write_text("x")
    server.write_text("x")
    workers.mkdir()
    environ = {"SPEC_SERVE_CURVE_SECRET_KEY": str(secret), "SPEC_SERVE_CURVE_SERVER_KEY": str(server),
               "SPEC_SERVE_CURVE_WORKER_KEYS_DIR": str(workers)}
    security = _resolve(environ=environ)["security"]
    assert (security.secret_key_file, security.server_key_file, security.worker_keys_dir) == (secret, server, workers)
    with pytest.raises(ValueError, match=r"^CURVE is on \(SPEC_SERVE_CURVE_SECRET_KEY\) but not set: "
                                         r"SPEC_SERVE_CURVE_WORKER_KEYS_DIR;"):
        _resolve(environ={k: v for k, v in environ.items() if "WORKER" not in k})
    explicit = object()  # an explicit security= wins over the variables
    assert _resolve({"security": explicit}, environ)["security"] is explicit


@pytest.mark.parametrize("source, value, message", [
    ("SPEC_SERVE_NUM_SHARDS", "two", "SPEC_SERVE_NUM_SHARDS='two' is not valid for num_shards: a whole number >= 1"),
    ("SPEC_SERVE_PREFETCH_DEPTH", "0", "SPEC_SERVE_PREFETCH_DEPTH='0' is not valid for prefetch_depth: a whole number"),
    ("SPEC_SERVE_COMPACT", "maybe", "SPEC_SERVE_COMPACT='maybe' is not valid for compact: one of 1, true, yes, on, 0"),
    ("SPEC_SERVE_VERIFY", "most", "SPEC_SERVE_VERIFY='most' is not valid for verify: one of all, sampled, off"),
    ("SPEC_SERVE_TIMEOUT", "-1", "SPEC_SERVE_TIMEOUT='-1' is not valid for timeout: a number > 0"),
    ("SPEC_SERVE_CLIENT_DEVICE", "gpu7", "SPEC_SERVE_CLIENT_DEVICE='gpu7' is not valid for device: a torch device"),
    ("SPEC_SERVE_CURVE_SECRET_KEY", "/no/such.key_secret", "is not valid for curve_secret_key: an existing file"),
    ("NEMO_EAGLE_ENABLE_NCCL", "2", "NEMO_EAGLE_ENABLE_NCCL='2' is not valid for enable_nccl: one of 1, true"),
    ("recipe_args.spec_serve.num_shards", 0, "recipe_args.spec_serve.num_shards=0 is not valid for num_shards"),
    ("recipe_args.remote_urls", ["http://server:8001"], "recipe_args.remote_urls=['http://server:8001'] is not valid "
                                                         "for broker_url: 'http://server:8001' is an HTTP URL"),
    ("recipe_args.remote_urls", ["tcp://a:5555", "tcp://b:5555"], "is not valid for broker_url: spec-serve connects "
                                                                   "to one broker frontend"),
    ("num_shards", 0, "num_shards=0 is not valid for num_shards: a whole number >= 1"),
    ("compact", "sometimes", "compact='sometimes' is not valid for compact: one of"),
])
def test_a_bad_value_is_one_line_naming_its_source(source, value, message):
    environ, yaml, explicit = {}, {}, {}
    if source.startswith("recipe_args."):
        key = source.split(".", 1)[1]
        yaml = {key: value} if "." not in key else {"spec_serve": {key.split(".")[1]: value}}
        explicit = {"broker_url": None}
    elif source.isupper():
        environ = {source: value}
    else:
        explicit = {source: value}
    with pytest.raises(ValueError) as info:
        _resolve(explicit, environ, yaml, nemo=True)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_compact_takes_the_words_of_its_one_list():
    allowed = options.BY_NAME["compact"].parser.allowed
    assert allowed == "one of " + ", ".join(options.COMPACT_WORDS)
    for word, value in options.COMPACT_WORDS.items():
        assert _resolve(environ={"SPEC_SERVE_COMPACT": word.upper()})["compact"] == value


def test_nemo_eagle_variables_are_honoured_or_refused_under_nemo(tmp_path):
    assert _resolve(environ={"NEMO_EAGLE_ENABLE_NCCL": "1"}, nemo=True)["enable_nccl"] is True
    assert _resolve(environ={"NEMO_EAGLE_ENABLE_NCCL": "0"}, nemo=True)["enable_nccl"] is False
    both = {"NEMO_EAGLE_ENABLE_NCCL": "1", "SPEC_SERVE_ENABLE_NCCL": "0"}
    assert _resolve(environ=both, nemo=True).sources["enable_nccl"] == "SPEC_SERVE_ENABLE_NCCL"
    # A plain RemoteTargetModel is not NeMo's: NeMo's variables do not reach it.
    assert _resolve(environ={"NEMO_EAGLE_ENABLE_NCCL": "1", "NEMO_EAGLE_NCCL_PORT": "9000"})["enable_nccl"] is False
    with pytest.raises(ValueError, match=r"^NEMO_EAGLE_NCCL_PORT='9000' cannot be honoured: .*unset "
                                         r"NEMO_EAGLE_NCCL_PORT$"):
        _resolve(environ={"NEMO_EAGLE_NCCL_PORT": "9000"}, nemo=True)
    for name in ("client.key_secret", "broker.key"):
        (tmp_path / name).write_text("x")
    curve = {"SPEC_SERVE_CURVE_SECRET_KEY": str(tmp_path / "client.key_secret"),
             "SPEC_SERVE_CURVE_SERVER_KEY": str(tmp_path / "broker.key"),
             "SPEC_SERVE_CURVE_WORKER_KEYS_DIR": str(tmp_path)}
    with pytest.raises(ValueError, match=r"^enable_nccl \(from NEMO_EAGLE_ENABLE_NCCL\) cannot be combined with "
                                         r"CURVE security \(from SPEC_SERVE_CURVE_SECRET_KEY\)"):
        _resolve(environ={**curve, "NEMO_EAGLE_ENABLE_NCCL": "1"}, nemo=True)


def test_a_cache_of_native_rows_refuses_an_fp8_wire(tmp_path):
    """Rows restored from FP8 are not the target's bits: a native cache would store them as if they were."""
    with pytest.raises(ValueError, match=r"^wire_dtype='fp8' \(from SPEC_SERVE_WIRE_DTYPE\) rounds the hidden states "
                                         r"the cache \(from cache\) would store as native rows.*set cache_dtype='fp8' "
                                         r"too, or wire_dtype='auto'$"):
        _resolve({"cache": str(tmp_path)}, environ={"SPEC_SERVE_WIRE_DTYPE": "fp8"})
    got = _resolve({"cache": str(tmp_path), "cache_dtype": "fp8"}, environ={"SPEC_SERVE_WIRE_DTYPE": "fp8"})
    assert (got["wire_dtype"], got["cache_dtype"]) == ("fp8", "fp8")


def test_an_unknown_yaml_key_is_refused():
    with pytest.raises(ValueError, match=r"recipe_args.spec_serve has unknown keys \['num_shard'\]; known: "):
        _resolve(yaml={"spec_serve": {"num_shard": 2}}, nemo=True)


def test_remote_target_model_takes_its_options_from_the_environment(monkeypatch):
    """No broker needed: the constructor resolves and starts its I/O thread; nothing is sent until used."""
    for name, value in {"SPEC_SERVE_NUM_SHARDS": "2", "SPEC_SERVE_COMPACT": "1", "SPEC_SERVE_PREFETCH_DEPTH": "3",
                        "SPEC_SERVE_VERIFY": "sampled", "SPEC_SERVE_TIMEOUT": "9", "SPEC_SERVE_SERVICE": "llama",
                        "SPEC_SERVE_SAME_HOST_PLANE": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SPEC_SERVE_CLIENT_BROKER", f"tcp://127.0.0.1:{free_port()}")
    with RemoteTargetModel() as client:
        assert (client.num_shards, client.compact, client.prefetch_depth, client.verify, client.timeout,
                client.service) == (2, True, 3, "sampled", 9.0, "llama")
        plane = client._io.paths.named("plane") if client._io.paths is not None else None
        assert plane is not None and plane.offer("generate") is None  # the plane is off: nothing offered
    with RemoteTargetModel(num_shards=1, compact=False, timeout=4) as client:  # arguments win
        assert (client.num_shards, client.compact, client.timeout) == (1, False, 4.0)
    monkeypatch.setenv("SPEC_SERVE_NUM_SHARDS", "-2")
    with pytest.raises(ValueError, match="^SPEC_SERVE_NUM_SHARDS='-2' is not valid for num_shards"):
        RemoteTargetModel()


def _doc_table() -> str:
    rows = ["| option | environment | NeMo recipe YAML (`recipe_args.`) | default | what it sets |",
            "|---|---|---|---|---|"]
    for o in options.TABLE:
        env = f"`{o.env}`" + (f" (NeMo: `{o.nemo_env}`)" if o.nemo_env else "")
        yaml = ", ".join(f"`{k}`" for k in o.yaml) or "set by NeMo"
        default = "required" if o.name == "broker_url" else "none" if o.default is None else f"`{o.default!r}`"
        rows.append(f"| `{o.name}` | {env} | {yaml} | {default} | {o.doc} |")
    return "\n".join(rows)


def test_the_docs_show_the_table():
    text = DOC.read_text()
    assert _doc_table() in text, "docs/client-options.md: regenerate the table from tests/client/test_client_options.py"
    for word in [*options.COMPACT_WORDS, *options.WIRE_DTYPE_WORDS]:
        assert re.search(rf"`{word}`", text), word
    for name in options.NEMO_REFUSED_ENV:
        assert name in text
