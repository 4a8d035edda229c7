"""The deploy files people copy (examples/deploy/, issue 23 item 4): Kubernetes, Slurm and systemd.

Each file is parsed: every spec-serve flag it passes must exist in the CLI, every SPEC_SERVE_* variable
must be one spec-serve reads, the grace an orchestrator gives must cover the worker's --drain-timeout,
and the Kubernetes objects must hang together (selectors, ports, probes, volumes, GPU requests). Then
the same commands run on loopback: the Slurm script itself, with stand-ins for srun and scontrol
(tests/fakes/slurm: Slurm cannot run here), and the Kubernetes and systemd commands with paths, ports and
the device swapped for this host's; each answers a CURVE client bit for bit and stops on SIGTERM as its
orchestrator would stop it, with status 0.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import zygote
from cluster_util import FAST_ENV, Reference, assert_equal_batches, kill, wait_until
from spec_serve.client.api import RemoteTargetModel
from spec_serve.tools.cli import main
from spec_serve.transport.sockets import Security, free_port, keygen

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "examples" / "deploy"
K8S_BROKER, K8S_WORKER = DEPLOY / "kubernetes" / "broker.yaml", DEPLOY / "kubernetes" / "worker.yaml"
K8S_AUTOSCALER = DEPLOY / "kubernetes" / "worker-autoscaler.yaml"
SBATCH = DEPLOY / "slurm" / "spec-serve.sbatch"
BROKER_UNIT = DEPLOY / "systemd" / "spec-serve-broker.service"
WORKER_UNIT = DEPLOY / "systemd" / "spec-serve-worker@.service"
FAKE_SLURM = Path(__file__).resolve().parents[1] / "fakes" / "slurm"
SLURM_KILL_WAIT_S = 30  # Slurm's default KillWait: SIGKILL this long after SIGTERM
# Variables spec-serve does not define that the files may set.
OTHER_ENV = {"HF_HUB_OFFLINE", "HF_HOME", "CUDA_VISIBLE_DEVICES", "NCCL_SOCKET_IFNAME"}


# --------------------------------------------------------------------------- what the CLI takes


def cli_flags(command: str) -> set[str]:
    """The long flags ``spec-serve COMMAND`` takes."""
    params = main.commands[command].params
    return {opt for p in params for opt in (*p.opts, *p.secondary_opts) if opt.startswith("--")} | {"--help"}


def spec_serve_variables() -> set[str]:
    """Every SPEC_SERVE_* variable spec-serve reads: its flags' and the tunables its modules read."""
    names = {e for cmd in main.commands.values() for p in cmd.params
             for e in ([p.envvar] if isinstance(p.envvar, str) else p.envvar or [])}
    for path in (ROOT / "spec_serve").rglob("*.py"):
        names |= set(re.findall(r'"(SPEC_SERVE_[A-Z0-9_]+)"', path.read_text()))
    return names


def check_command(argv: list[str], where: str) -> list[str]:
    """Problems with one ``spec-serve COMMAND ARGS`` line: an unknown command or flag."""
    assert Path(argv[0]).name == "spec-serve", (where, argv)
    if argv[1] not in main.commands:
        return [f"{where}: no command spec-serve {argv[1]}"]
    flags = cli_flags(argv[1])
    return [f"{where}: spec-serve {argv[1]} has no {flag}" for flag in
            (a.split("=", 1)[0] for a in argv[2:] if a.startswith("--")) if flag not in flags]


def check_variables(names: set[str], where: str) -> list[str]:
    known = spec_serve_variables()
    return [f"{where}: spec-serve reads no {name}" for name in sorted(names)
            if name not in known and name not in OTHER_ENV]


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


# ------------------------------------------------------------------------------- the files


def k8s_objects(path: Path) -> dict[str, dict]:
    return {f"{doc['kind']}/{doc['metadata']['name']}": doc for doc in yaml.safe_load_all(path.read_text())}


def k8s_container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def k8s_argv(container: dict) -> list[str]:
    return [*container["command"], *container["args"]]


def k8s_env(container: dict) -> dict[str, str]:
    """Its variables; one from the Downward API (``resourceFieldRef``) as kubelet sets it from the resources."""
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
            continue
        ref = e["valueFrom"]["resourceFieldRef"]
        assert ref["containerName"] == container["name"] and ref.get("divisor", "1") == "1", e
        kind, _, resource = ref["resource"].partition(".")
        env[e["name"]] = str(math.ceil(float(container["resources"][kind][resource])))
    return env


def unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """A systemd unit: {section: {key: [values]}} (a key may repeat, e.g. Environment)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def unit_argv(path: Path, instance: str = "0") -> list[str]:
    (exec_start,) = unit(path)["Service"]["ExecStart"]
    return shlex.split(exec_start.replace("%i", instance))


def unit_env(path: Path) -> dict[str, str]:
    return dict(item.split("=", 1) for item in unit(path)["Service"].get("Environment", []))


def sbatch_steps() -> list[tuple[list[str], list[str]]]:
    """The sbatch script's srun steps: (srun's options, the spec-serve command line, inside `bash -c` too)."""
    text = SBATCH.read_text().replace("\\\n", " ")
    steps = []
    for line in text.splitlines():
        if not line.startswith("srun "):
            continue
        tokens = shlex.split(line.rstrip("& "))
        command = tokens.index("bash") if "bash" in tokens else tokens.index("spec-serve")
        options = [t for t in tokens[1:command] if t.startswith("--")]
        if "bash" in tokens:
            tokens = shlex.split(tokens[tokens.index("-c") + 1])
        steps.append((options, tokens[tokens.index("spec-serve"):]))
    return steps


def sbatch_commands() -> list[list[str]]:
    """The spec-serve command lines of the sbatch script's srun steps."""
    return [argv for _, argv in sbatch_steps()]


def sbatch_default(name: str) -> str:
    return re.search(rf"^{name}=\$\{{{name}:-([^}}]+)\}}", SBATCH.read_text(), re.M).group(1)


# ---------------------------------------------------------------------------- parse and check


def test_every_flag_and_variable_the_deploy_files_pass_exists():
    problems = []
    for path in (K8S_BROKER, K8S_WORKER):
        for name, obj in k8s_objects(path).items():
            if obj["kind"] == "Deployment":
                container = k8s_container(obj)
                problems += check_command(k8s_argv(container), f"{path.name} {name}")
                problems += check_variables(set(k8s_env(container)), f"{path.name} {name}")
    for path in (BROKER_UNIT, WORKER_UNIT):
        problems += check_command(unit_argv(path), path.name) + check_variables(set(unit_env(path)), path.name)
    commands = sbatch_commands()
    assert [c[1] for c in commands] == ["broker", "worker"]
    for argv in commands:
        problems += check_command(argv, f"{SBATCH.name} {argv[1]}")
    exported = set(re.findall(r"\b(SPEC_SERVE_[A-Z0-9_]+)", SBATCH.read_text()))
    problems += check_variables(exported, SBATCH.name)
    assert problems == []
    # ...and a misspelt one would have been caught.
    assert check_command(["spec-serve", "worker", "--drain-timeuot", "3"], "t") == ["t: spec-serve worker has no "
                                                                                   "--drain-timeuot"]
    assert check_variables({"SPEC_SERVE_DRAIN_TIMOUT"}, "t") == ["t: spec-serve reads no SPEC_SERVE_DRAIN_TIMOUT"]


def test_slurm_workers_get_their_cpus_and_as_many_threads():
    """Issue 39 item 6: each worker task is given its CPUs by srun itself (a step does not inherit the job's
    --cpus-per-task since Slurm 22.05: each task would get one core) and runs as many math threads
    (--threads), the same variable, whose default is the job's --cpus-per-task."""
    (_, broker), (options, worker) = sbatch_steps()
    cpus = dict(o.split("=", 1) for o in options if "=" in o).get("--cpus-per-task")
    assert cpus == "$CPUS_PER_WORKER", options
    assert flag_value(worker, "--threads") == cpus, worker
    per_task = re.search(r"^#SBATCH --cpus-per-task=(\d+)$", SBATCH.read_text(), re.M).group(1)
    assert sbatch_default("CPUS_PER_WORKER") == "${SLURM_CPUS_PER_TASK:-" + per_task
    assert re.search(r"^export .*\bCPUS_PER_WORKER\b", SBATCH.read_text(), re.M)  # read inside bash -c


def test_kubernetes_workers_run_as_many_threads_as_cpus_they_request():
    """Issue 39 item 6: a pod sees no other worker's process, so the default share would be every core of
    the node; each worker runs as many math threads as the CPUs its pod requests (the Downward API)."""
    worker = k8s_container(k8s_objects(K8S_WORKER)["Deployment/spec-serve-worker"])
    assert k8s_env(worker)["SPEC_SERVE_THREADS"] == str(worker["resources"]["requests"]["cpu"])
    assert "--threads" not in k8s_argv(worker)  # the variable is the one source


def test_grace_periods_cover_the_drain():
    """An orchestrator's SIGKILL comes after the worker's drain could have ended (docs/deploy.md)."""
    worker = k8s_objects(K8S_WORKER)["Deployment/spec-serve-worker"]
    drain = float(flag_value(k8s_argv(k8s_container(worker)), "--drain-timeout"))
    assert worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= drain + 5
    stop = float(unit(WORKER_UNIT)["Service"]["TimeoutStopSec"][0])
    assert stop >= float(flag_value(unit_argv(WORKER_UNIT), "--drain-timeout")) + 5
    assert unit(WORKER_UNIT)["Service"]["KillSignal"] == ["SIGTERM"]
    assert float(sbatch_default("DRAIN_TIMEOUT")) + 5 <= SLURM_KILL_WAIT_S
    assert "#SBATCH --signal=TERM@" in SBATCH.read_text()


def test_kubernetes_objects_hang_together():
    """Selectors match their pods, the Services reach the broker's ports, probes ask /health (the broker's
    readiness: /ready) on the port the process serves it on (bound beyond loopback: kubelet probes the pod),
    each worker asks a GPU, every mounted volume exists, and the workers reach a Service's worker port."""
    objects = {**k8s_objects(K8S_BROKER), **k8s_objects(K8S_WORKER)}
    for name in ("Deployment/spec-serve-broker", "Deployment/spec-serve-worker"):
        spec = objects[name]["spec"]
        labels = spec["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items(), name
        pod = spec["template"]["spec"]
        container = k8s_container(objects[name])
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert {m["name"] for m in container["volumeMounts"]} <= {v["name"] for v in pod["volumes"]}, name
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe in container:
                check = container[probe].get("httpGet") or container[probe]["tcpSocket"]
                assert check["port"] in ports, (name, probe)
                path = "/ready" if (name, probe) == ("Deployment/spec-serve-broker", "readinessProbe") else "/health"
                assert container[probe].get("httpGet", {"path": path})["path"] == path, (name, probe)
        argv = k8s_argv(container)
        assert str(ports["http"]) == flag_value(argv, "--http-port") and flag_value(argv, "--http-host") == "0.0.0.0"
    broker_labels = objects["Deployment/spec-serve-broker"]["spec"]["template"]["metadata"]["labels"]
    broker = k8s_container(objects["Deployment/spec-serve-broker"])
    broker_ports = {p["name"]: p["containerPort"] for p in broker["ports"]}
    services = [obj for obj in objects.values() if obj["kind"] == "Service"]
    for service in services:
        assert service["spec"]["selector"].items() <= broker_labels.items()
        assert all(p["targetPort"] in broker_ports for p in service["spec"]["ports"])
    argv = k8s_argv(broker)
    assert flag_value(argv, "--frontend").endswith(f":{broker_ports['clients']}")
    assert flag_value(argv, "--backend").endswith(f":{broker_ports['workers']}")
    worker = k8s_container(objects["Deployment/spec-serve-worker"])
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert k8s_env(worker)["SPEC_SERVE_BROKER"] in {
        f"tcp://{s['metadata']['name']}:{p['port']}" for s in services for p in s["spec"]["ports"]
        if p["targetPort"] == "workers"}
    assert "startupProbe" in worker and "readinessProbe" in worker


# A readiness path of the broker's that waits for workers: /ready, and /health or /ready of one service.
_WAITS_FOR_WORKERS = re.compile(r"^/ready|[?&]service=")


def k8s_manifests(root: Path = DEPLOY) -> list[dict]:
    """Every Kubernetes object of every manifest under ``root`` (any file, any kind)."""
    return [doc for path in sorted([*root.rglob("*.yaml"), *root.rglob("*.yml")])
            for doc in yaml.safe_load_all(path.read_text()) if isinstance(doc, dict) and "kind" in doc]


def _pod_templates(objects: list[dict]) -> list[tuple[str, dict, dict]]:
    """(name, labels, pod spec) of every workload's pods (Deployment, StatefulSet, DaemonSet, Job...)."""
    found = []
    for obj in objects:
        template = (obj.get("spec") or {}).get("template") or (obj.get("spec", {}).get("jobTemplate", {})
                                                                .get("spec", {}).get("template"))
        if obj["kind"] == "Pod":
            template = {"metadata": obj["metadata"], "spec": obj["spec"]}
        if template and "containers" in template.get("spec", {}):
            found.append((f"{obj['kind']}/{obj['metadata']['name']}", template["metadata"].get("labels", {}),
                          template["spec"]))
    return found


def _container_port(container: dict, target: int | str) -> int | None:
    for port in container.get("ports", []):
        if target in (port.get("name"), port["containerPort"]):
            return int(port["containerPort"])
    return None


def worker_port_gated_on_readiness(objects: list[dict]) -> list[str]:
    """Services that reach a spec-serve broker's worker port (its --backend) only while the broker is ready,
    when its readiness waits for a registered worker: no worker could ever register. A Service publishes
    only ready pods unless ``publishNotReadyAddresses``."""
    problems = []
    for service in (o for o in objects if o["kind"] == "Service"):
        spec, name = service["spec"], f"Service/{service['metadata']['name']}"
        if spec.get("publishNotReadyAddresses") or not spec.get("selector"):
            continue
        for workload, labels, pod in _pod_templates(objects):
            if not spec["selector"].items() <= labels.items():
                continue
            for container in pod["containers"]:
                argv = [*container.get("command", []), *container.get("args", [])]
                if "broker" not in argv[1:2] or Path(argv[0]).name != "spec-serve" or "--backend" not in argv:
                    continue
                path = (container.get("readinessProbe") or {}).get("httpGet", {}).get("path", "")
                backend = int(flag_value(argv, "--backend").rpartition(":")[2])
                for port in spec.get("ports", []):
                    if _container_port(container, port.get("targetPort", port["port"])) == backend and \
                            _WAITS_FOR_WORKERS.search(path):
                        problems.append(f"{name} port {port['port']} reaches {workload}'s worker port only once "
                                        f"it is ready, and its readiness ({path}) waits for a worker: set "
                                        f"publishNotReadyAddresses: true on a Service of its own")
    return problems


def test_no_service_gates_the_worker_port_on_the_broker_readiness():
    """Every manifest under examples/deploy: workers register through a Service that publishes the broker
    before it is ready (its /ready waits for them). The rule also catches the layout that broke it."""
    objects = k8s_manifests()
    assert any(o["kind"] == "Service" for o in objects)
    assert worker_port_gated_on_readiness(objects) == []
    one_service = [o for o in objects if o["kind"] != "Service"] + [yaml.safe_load("""
        kind: Service
        metadata: {name: spec-serve-broker}
        spec:
          selector: {app.kubernetes.io/name: spec-serve, app.kubernetes.io/component: broker}
          ports: [{name: clients, port: 5555, targetPort: clients}, {name: workers, port: 5556, targetPort: 5556}]
        """)]
    assert worker_port_gated_on_readiness(one_service) == [
        "Service/spec-serve-broker port 5556 reaches Deployment/spec-serve-broker's worker port only once it is "
        "ready, and its readiness (/ready) waits for a worker: set publishNotReadyAddresses: true on a Service "
        "of its own"]
    one_service[-1]["spec"]["publishNotReadyAddresses"] = True
    assert worker_port_gated_on_readiness(one_service) == []


def test_the_autoscaler_scales_the_worker_deployment_on_the_brokers_advice():
    """The HPA scales worker.yaml's Deployment to ceil(spec_serve_workers_needed) of the workers' service, a
    metric the broker registers with that label, which the prometheus-adapter rule serves under the name the HPA
    asks; each scale-up step waits longer than the broker's --sizing-window (its figures must see the last step)."""
    from broker_util import SERVICE, make_router, ready

    objects = {**k8s_objects(K8S_WORKER), **k8s_objects(K8S_AUTOSCALER)}
    hpa = objects["HorizontalPodAutoscaler/spec-serve-worker"]["spec"]
    target = hpa["scaleTargetRef"]
    deployment = objects[f"{target['kind']}/{target['name']}"]
    assert target["apiVersion"] == deployment["apiVersion"] == "apps/v1"
    (metric,) = hpa["metrics"]
    assert metric["type"] == "External" and metric["external"]["target"] == {"type": "AverageValue",
                                                                             "averageValue": "1"}
    selector = metric["external"]["metric"]["selector"]["matchLabels"]
    assert selector == {"service": k8s_env(k8s_container(deployment))["SPEC_SERVE_SERVICE"]}
    (rule,) = yaml.safe_load(objects["ConfigMap/prometheus-adapter"]["data"]["config.yaml"])["externalRules"]
    assert rule["name"]["as"] == metric["external"]["metric"]["name"] and rule["resources"]["namespaced"] is False
    series = re.fullmatch(r"(\w+)\{(\w+)!=\"\"\}", rule["seriesQuery"])
    assert series is not None and series.group(2) == "service" and set(selector) == {"service"}
    assert "by (service)" in rule["metricsQuery"]
    # ... a series a broker exports, labelled with the service, once it has a window of figures
    broker = make_router(sizing_window=1.0)
    ready(broker, b"worker", 0.0)
    for now in (0.0, 1.0):
        broker.measure(now)
    assert broker.metrics.registry.get_sample_value(series.group(1), {"service": SERVICE}) is not None
    assert 1 <= hpa["minReplicas"] <= hpa["maxReplicas"]
    window = next(p.default for p in main.commands["broker"].params if p.name == "sizing_window")
    broker_argv = k8s_argv(k8s_container(k8s_objects(K8S_BROKER)["Deployment/spec-serve-broker"]))
    if "--sizing-window" in broker_argv:
        window = float(flag_value(broker_argv, "--sizing-window"))
    for direction in ("scaleUp", "scaleDown"):
        assert all(p["periodSeconds"] > window for p in hpa["behavior"][direction]["policies"]), direction


# ---------------------------------------------------------------------------- on loopback


def _keys(directory: Path) -> Path:
    """The key layout the files expect (docs/deploy.md): broker, worker and trainer keypairs, and the
    directories of admitted worker and client keys."""
    keygen(directory, "broker")
    for name, admitted in (("worker", "workers"), ("trainer", "clients")):
        public, _ = keygen(directory, name)
        (directory / admitted).mkdir()
        (directory / admitted / public.name).write_bytes(public.read_bytes())
    return directory


def _trainer(keys: Path) -> Security:
    return Security(keys / "trainer.key_secret", keys / "broker.key", worker_keys_dir=keys / "workers")


def _health(port: int) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def _serves(frontend: str, keys: Path, reference: Reference, seed: int) -> None:
    with RemoteTargetModel(frontend, security=_trainer(keys), timeout=60, heartbeat_interval=0.2,
                           liveness=15) as client:
        assert_equal_batches(client.generate_batch(*reference.batch(seed), kind="dspark"),
                             reference.expected(seed, kind="dspark"))


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


@pytest.fixture(scope="module")
def reference(tiny_target_dir, tiny_vocab_mapping):
    return Reference(tiny_target_dir, tiny_vocab_mapping)


def _checkout_entry_point(bin_dir: Path) -> Path:
    """A directory whose ``spec-serve`` runs this checkout with this interpreter, as the installed entry point
    would: the script's steps then test this tree wherever the suite runs (a venv's own entry point, or none
    where the package is only on PYTHONPATH, as on the GPU machine)."""
    bin_dir.mkdir()
    script = bin_dir / "spec-serve"
    script.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m spec_serve.tools.cli "$@"\n')
    script.chmod(0o755)
    return bin_dir


def test_the_slurm_script_runs_on_loopback(tiny_target_dir, reference, tmp_path):
    """spec-serve.sbatch itself, its srun steps run here (two 'nodes', both this host, one worker): the
    broker and the worker come up, serve a CURVE client, and on SIGTERM to the steps (scancel, the time
    limit) every task exits 0 and the script ends."""
    keys = _keys(tmp_path / "keys")
    ports = {name: free_port() for name in ("FRONTEND_PORT", "BACKEND_PORT", "HTTP_PORT", "WORKER_HTTP_PORT")}
    env = {**os.environ, **FAST_ENV, **{k: str(v) for k, v in ports.items()}, "OMP_NUM_THREADS": "1",
           "PATH": os.pathsep.join([str(FAKE_SLURM), str(_checkout_entry_point(tmp_path / "bin")), os.environ["PATH"]]),
           "SLURM_JOB_NODELIST": "node[1-2]", "TARGET": str(tiny_target_dir), "KEYS": str(keys),
           "WORKERS_PER_NODE": "1", "SPEC_SERVE_DEVICE": "cpu", "DRAIN_TIMEOUT": "5", "CPUS_PER_WORKER": "2"}
    log = tmp_path / "job.log"
    with open(log, "wb") as out:
        job = subprocess.Popen(["bash", str(SBATCH)], env=env, stdout=out, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        def worker_up() -> bool:
            assert job.poll() is None, f"the job ended ({job.returncode}) first:\n{log.read_text()[-3000:]}"
            return _health(ports["WORKER_HTTP_PORT"]) == 200

        wait_until(worker_up, 180, what="the worker's /health 200")
        assert _health(ports["HTTP_PORT"]) == 200
        _serves(f"tcp://127.0.0.1:{ports['FRONTEND_PORT']}", keys, reference, seed=60)
        steps = _children(job.pid)
        assert len(steps) == 2, steps  # the broker's srun and the workers'
        for step in steps:
            os.kill(step, signal.SIGTERM)
        assert job.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    text = log.read_text()
    assert text.count("fake srun: task 0 exited 0") == 2, text[-3000:]
    assert "outcome=drained" in text and "broker.stop" in text, text[-3000:]
    assert "worker.threads threads=2 source=--threads" in text, text[-3000:]


def _swap(text: str, swaps: dict[str, str]) -> str:
    """``text`` with this host's paths, ports and device in place of the file's (each place swapped once)."""
    pattern = re.compile("|".join(re.escape(old) for old in sorted(swaps, key=len, reverse=True)))
    return pattern.sub(lambda m: swaps[m.group(0)], text)


def _start(name: str, argv: list[str], env: dict[str, str], swaps: dict[str, str],
           log_dir: Path) -> subprocess.Popen | zygote.ForkedProcess:
    """``spec-serve ARGS`` of a deploy file, as a process of this checkout, with ``swaps`` applied."""
    args = [_swap(a, swaps) for a in argv[1:]]
    full_env = {**os.environ, **FAST_ENV, "OMP_NUM_THREADS": "1", **{k: _swap(v, swaps) for k, v in env.items()}}
    with open(log_dir / f"{name}.log", "wb") as out:  # forked from the test zygote where it is the same process
        return zygote.popen(["-m", "spec_serve.tools.cli", *args], full_env, out)


def _grace(path: Path, deployment: str) -> float:
    return k8s_objects(path)[deployment]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]


def test_kubernetes_and_systemd_commands_run_on_loopback(tiny_target_dir, reference, tmp_path):
    """The Kubernetes broker and worker containers' commands and the systemd worker unit's ExecStart, run
    here: /health answers 200 on the port the probes ask, a CURVE client is served, and each process stops
    on SIGTERM (kubelet, systemctl stop) with status 0 within the grace its orchestrator gives it."""
    keys = _keys(tmp_path / "keys")
    frontend, backend, http, k8s_http, unit_http = (free_port() for _ in range(5))
    swaps = {"spec-serve-broker-workers:5556": f"127.0.0.1:{backend}", "127.0.0.1:5556": f"127.0.0.1:{backend}",
             "tcp://*:5555": f"tcp://*:{frontend}", "tcp://*:5556": f"tcp://*:{backend}",
             "/models/llama-3.1-8b": str(tiny_target_dir), "/etc/spec-serve/keys": str(keys), "/keys": str(keys),
             "cuda:0": "cpu", "8080": str(http), "8081": str(k8s_http), "8090": str(unit_http)}
    worker = k8s_container(k8s_objects(K8S_WORKER)["Deployment/spec-serve-worker"])
    broker = k8s_container(k8s_objects(K8S_BROKER)["Deployment/spec-serve-broker"])
    procs = {"broker": _start("broker", k8s_argv(broker), k8s_env(broker), swaps, tmp_path),
             "k8s-worker": _start("k8s-worker", k8s_argv(worker), {**k8s_env(worker), "SPEC_SERVE_THREADS": "1"},
                                  swaps, tmp_path),  # this host's cores
             "unit-worker": _start("unit-worker", unit_argv(WORKER_UNIT), unit_env(WORKER_UNIT), swaps, tmp_path)}
    grace = {"k8s-worker": _grace(K8S_WORKER, "Deployment/spec-serve-worker"),
             "unit-worker": float(unit(WORKER_UNIT)["Service"]["TimeoutStopSec"][0]),
             "broker": _grace(K8S_BROKER, "Deployment/spec-serve-broker")}
    try:
        for port in (k8s_http, unit_http):
            wait_until(lambda port=port: _health(port) == 200, 180, what=f"/health 200 on {port}")
        assert _health(http) == 200
        _serves(f"tcp://127.0.0.1:{frontend}", keys, reference, seed=61)
        for name in ("k8s-worker", "unit-worker", "broker"):  # the workers first, as a cluster is taken down
            procs[name].send_signal(signal.SIGTERM)
            assert procs[name].wait(grace[name]) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    finally:
        for proc in procs.values():
            kill(proc)
    for name in ("k8s-worker", "unit-worker"):
        assert "outcome=drained" in (tmp_path / f"{name}.log").read_text()
