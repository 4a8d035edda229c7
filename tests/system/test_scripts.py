"""The test command's own machinery (scripts/test.sh): its background stage yields the CPU to the main one, and
its installs (uv) use the package sources pip is configured with."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
# Says who it is, then waits for a line, so that its group can be read while it runs.
PROBE = "import os, sys; print(os.getpid(), os.getsid(0), os.nice(0), flush=True); sys.stdin.readline()"


def _autogroup_nice(pid: int) -> int | None:
    """The nice value of ``pid``'s scheduling group by session (None where the kernel has no autogroup)."""
    try:
        text = Path(f"/proc/{pid}/autogroup").read_text()
    except OSError:
        return None
    return int(re.search(r"nice (-?\d+)", text).group(1))


def _run(*command: str) -> tuple[int, int, int, int | None]:
    """(pid, session id, nice, autogroup nice) of a probe run through ``command``, read while it still runs."""
    proc = subprocess.Popen([*command, sys.executable, "-c", PROBE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        pid, sid, nice = map(int, proc.stdout.readline().split())
        group = _autogroup_nice(pid)
    finally:
        proc.communicate("\n", timeout=30)
    return pid, sid, nice, group


def test_low_priority_holds_across_sessions():
    """scripts/low_priority.sh runs its command in a session of its own (one kill of the group ends the stage)
    at nice 10, and where the kernel schedules sessions as groups (autogroup) the group is at nice 10 too: a new
    session's group otherwise gets an equal share of the CPU whatever its processes' nice values (the vLLM
    stage took 55% of the two cores beside the main run, started as `setsid nice -n 10`)."""
    pid, sid, nice, group = _run("bash", str(SCRIPTS / "low_priority.sh"))
    assert (sid, nice) == (pid, 10)
    assert group in (None, 10)
    if group is not None:  # what the script is for: the plain way leaves the new session's group at nice 0
        assert _run("setsid", "nice", "-n", "10")[3] == 0


def test_the_vllm_stage_starts_through_low_priority():
    text = (SCRIPTS / "test.sh").read_text()
    (line,) = [ln for ln in text.splitlines() if "vllm_stage.sh" in ln and not ln.lstrip().startswith("#")
               and "echo" not in ln]
    assert line.split()[:3] == ["bash", "scripts/low_priority.sh", "bash"], line


def _uv_pip():
    spec = importlib.util.spec_from_file_location("uv_pip", SCRIPTS / "uv_pip.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pip_env(conf: Path, **pip_vars: str) -> dict[str, str]:
    """An environment whose pip reads only ``conf`` (besides the host's files, which it overrides) and ``pip_vars``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": str(conf), **pip_vars}


def test_uv_gets_the_package_sources_pip_is_configured_with(tmp_path, monkeypatch):
    """scripts/uv_pip.py hands uv what pip would use: index, every extra index, find-links and constraint, from
    pip's files and PIP_* variables with pip's precedence (a variable over the install section over global)."""
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nindex-url = https://mirror.example/simple\n"
                    "extra-index-url = file:///a/simple file:///b/simple\nfind-links = /global/wheels\n"
                    "constraint = /etc/c.txt\ncert = /etc/ca.pem\n[install]\nfind-links = /install/wheels\n")
    uv_pip = _uv_pip()
    for k in [k for k in os.environ if k.startswith("PIP_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    args, env = uv_pip.uv_options(uv_pip.pip_config(sys.executable))
    pairs = list(zip(args[::2], args[1::2]))
    assert pairs[0] == ("--index-strategy", "unsafe-best-match")
    assert ("--default-index", "https://mirror.example/simple") in pairs
    assert [v for o, v in pairs if o == "--extra-index-url"] == ["file:///a/simple", "file:///b/simple"]
    assert [v for o, v in pairs if o == "--find-links"] == ["/install/wheels"]  # the install section wins
    assert ("--constraint", "/etc/c.txt") in pairs and env == {"SSL_CERT_FILE": "/etc/ca.pem"}
    monkeypatch.setenv("PIP_FIND_LINKS", "/env/wheels /env/more")
    args, _ = uv_pip.uv_options(uv_pip.pip_config(sys.executable))
    assert [v for o, v in zip(args[::2], args[1::2]) if o == "--find-links"] == ["/env/wheels", "/env/more"]


def _wheel(directory: Path, name: str, version: str) -> Path:
    """A minimal pure-Python wheel of one module."""
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}.py": "X = 1\n", f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    path = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for arcname, text in files.items():
            whl.writestr(arcname, text)
        whl.writestr(f"{dist}/RECORD", "".join(f"{a},,\n" for a in [*files, f"{dist}/RECORD"]))
    return path


@pytest.mark.skipif(not (Path(sys.executable).parent / "uv").exists(), reason="uv is not in this venv (scripts/test.sh "
                    "installs it)")
def test_uv_resolves_from_a_find_links_only_pip_knows(tmp_path):
    """End to end, with the venv's own uv: a package that only pip's configured find-links directory has (and no
    index: pip's no-index) is found; without pip's configuration uv could not know the directory."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "spec_serve_probe_pkg", "1.0")
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nno-index = true\nfind-links = {wheels}\n")
    command = [sys.executable, str(SCRIPTS / "uv_pip.py"), "install", "--dry-run", "spec-serve-probe-pkg"]
    done = subprocess.run(command, env=_pip_env(conf), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "+ spec-serve-probe-pkg==1.0" in done.stderr, done.stderr
    alone = subprocess.run(command, env=_pip_env(Path(os.devnull), UV_NO_INDEX="1"), capture_output=True, text=True,
                           timeout=120)
    assert alone.returncode != 0 and "spec-serve-probe-pkg" in alone.stderr
