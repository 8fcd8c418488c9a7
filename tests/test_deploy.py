"""deploy/: the systemd unit, the Kubernetes manifests and the Dockerfile, checked
without systemd running, without a cluster and without a Docker daemon.

systemd-analyze and systemd-sysusers check the unit and the sysusers file as
systemd would load them; kubernetes-validate checks each manifest against the
API schema of one Kubernetes version, rejecting unknown fields; the Dockerfile is
parsed here. The rest are the cross-file contracts a typo would break silently:
one socket path, one uid/gid, the same hostPaths for the daemon and the trainers.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
UNIT = DEPLOY / "systemd" / "fastpersistd.service"
SYSUSERS = DEPLOY / "systemd" / "fastpersist.conf"
DAEMONSET = DEPLOY / "kubernetes" / "daemonset.yaml"
TRAINING = DEPLOY / "kubernetes" / "training-pod-example.yaml"
DOCKERFILE = DEPLOY / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"

# The Kubernetes version the manifests must be valid for. Fixed, so that a new
# kubernetes-validate release cannot change the verdict on its own.
K8S_VERSION = "1.34"
SOCKET = "/run/fastpersist/fastpersistd.sock"
DAEMON_UID = 10001


# --- helpers -------------------------------------------------------------------------------


def _missing(why: str) -> None:
    """Skip where a validator is missing, except in CI, which must validate deploy/
    (scripts/setup.sh installs systemd there)."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must validate deploy/: {why}")
    pytest.skip(why)


def unit_entries(path: Path) -> list[tuple[str, str, str]]:
    """(section, key, value) of each assignment in a unit file, in order (keys may repeat)."""
    entries, section = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        entries.append((section, key.strip(), value.strip()))
    return entries


def unit_value(key: str) -> str:
    values = [v for _, k, v in unit_entries(UNIT) if k == key]
    assert len(values) == 1, f"{key}= should appear once in {UNIT.name}"
    return values[0]


def flag(argv: list[str], name: str) -> str:
    """The value after `name` in an argument list."""
    assert name in argv, f"{name} missing from {argv}"
    return argv[argv.index(name) + 1]


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    """The pod spec of a Pod, or of the template of a DaemonSet, Job, Deployment, ..."""
    spec: dict[str, Any] = doc["spec"]
    return spec if doc["kind"] == "Pod" else spec["template"]["spec"]


def only_doc(path: Path) -> dict[str, Any]:
    docs = load_docs(path)
    assert len(docs) == 1, f"{path.name}: expected one document"
    return docs[0]


def daemon_container() -> dict[str, Any]:
    (container,) = [c for c in pod_spec(only_doc(DAEMONSET))["containers"]
                    if c["name"] == "fastpersistd"]
    return container


def host_mounts(doc: dict[str, Any]) -> dict[str, str]:
    """hostPath -> mountPath over every container of a pod spec."""
    spec = pod_spec(doc)
    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    mounts = {}
    for container in spec["containers"]:
        for m in container.get("volumeMounts", []):
            if m["name"] in host:
                mounts[host[m["name"]]] = m["mountPath"]
    return mounts


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, comments dropped and continuations joined
    (Docker removes comment lines before it joins continued lines, as here)."""
    lines = [ln for ln in DOCKERFILE.read_text().splitlines() if not ln.lstrip().startswith("#")]
    text = re.sub(r"\\[ \t]*\n", " ", "\n".join(lines))
    out = []
    for line in text.splitlines():
        if line.strip():
            instruction, _, args = line.strip().partition(" ")
            out.append((instruction.upper(), args.strip()))
    return out


def final_stage() -> list[tuple[str, str]]:
    instructions = dockerfile_instructions()
    last_from = max(i for i, (ins, _) in enumerate(instructions) if ins == "FROM")
    return instructions[last_from:]


def exec_form(args: str) -> list[str]:
    """The JSON (exec) form of CMD/ENTRYPOINT/HEALTHCHECK CMD; fails on the shell form."""
    value = json.loads(args)
    assert isinstance(value, list), f"not in exec form: {args}"
    return [str(v) for v in value]


def docker_instruction(name: str) -> str:
    (args,) = [a for ins, a in final_stage() if ins == name]
    return args


def dockerignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    """(re-include?, regex) per .dockerignore line, with Docker's glob meaning: `*` and
    `?` stay within one path component, `**` spans any number of them."""
    rules = []
    for raw in DOCKERIGNORE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = os.path.normpath(line.lstrip("!").lstrip("/"))
        assert "[" not in pattern, "character classes are not handled here"
        regex = re.escape(pattern)
        regex = regex.replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        rules.append((negate, re.compile(regex + r"\Z")))
    return rules


def dockerignored(relpath: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Whether Docker leaves `relpath` out of the build context: the last rule that
    matches the path or one of its parent directories decides."""
    parts = relpath.split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    ignored = False
    for negate, regex in rules:
        if any(regex.match(c) for c in candidates):
            ignored = not negate
    return ignored


def copy_sources() -> list[str]:
    """Sources of every COPY/ADD that reads the build context (not --from=stage)."""
    sources = []
    for ins, args in dockerfile_instructions():
        if ins not in ("COPY", "ADD"):
            continue
        words = json.loads(args) if args.startswith("[") else shlex.split(args)
        flags = [w for w in words if w.startswith("--")]
        paths = [w for w in words if not w.startswith("--")]
        if any(f.startswith("--from=") for f in flags):
            continue
        sources += paths[:-1]
    return sources


def context_files() -> list[str]:
    """The files the COPY lines take from the context, after .dockerignore."""
    rules, files = dockerignore_rules(), []
    for source in copy_sources():
        path = REPO / source
        found = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        files += [str(p.relative_to(REPO)) for p in found]
    return [f for f in files if not dockerignored(f, rules)]


def project_scripts() -> dict[str, str]:
    tomllib = pytest.importorskip("tomllib")
    scripts: dict[str, str] = tomllib.loads((REPO / "pyproject.toml").read_text())["project"].get(
        "scripts", {}
    )
    return scripts


def daemon_script() -> str:
    """The installed `fastpersistd`, else any executable (see test_systemd_unit_verifies)."""
    found = shutil.which("fastpersistd") or shutil.which(
        "fastpersistd", path=str(Path(sys.executable).parent)
    )
    return found or sys.executable


# --- systemd -------------------------------------------------------------------------------


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    """`systemd-analyze verify` parses the unit as systemd would: unknown keys, bad
    values and a missing ExecStart binary are all reported.

    verify insists that ExecStart's binary exists, and /usr/local/bin/fastpersistd does
    not here, so a copy runs the venv's fastpersistd instead. Until the daemon's console
    script is installed any executable stands in: the binary's existence is not what is
    being tested. Unknown keys and unparsable values only print a line naming the unit
    (the exit code stays 0), so those lines fail the test as well. Lines that do not
    name the unit are about the machine (systemd-analyze run in a container without
    systemd as PID 1 may complain about it), not about our file; they are passed on as
    warnings."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        _missing("systemd-analyze not installed (Debian/Ubuntu: apt-get install systemd)")
    text = UNIT.read_text()
    exec_start = unit_value("ExecStart").split()[0]
    assert exec_start == "/usr/local/bin/fastpersistd"
    unit = tmp_path / UNIT.name
    unit.write_text(text.replace(f"ExecStart={exec_start} ", f"ExecStart={daemon_script()} ", 1))
    proc = subprocess.run(
        [analyze, "verify", "--man=no", str(unit)],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_PAGER": ""},
    )
    lines = (proc.stdout + proc.stderr).splitlines()
    ours = [ln for ln in lines if UNIT.name in ln]
    assert proc.returncode == 0 and not ours, "\n".join(lines)
    for line in lines:
        warnings.warn(f"systemd-analyze verify (not about the unit): {line}", stacklevel=1)


def test_systemd_unit_hardening(tmp_path: Path) -> None:
    """`systemd-analyze security` scores the sandbox (0 best, 10 worst); the unit
    scored 1.7 with systemd 252. Losing a protection setting pushes it up."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        _missing("systemd-analyze not installed (Debian/Ubuntu: apt-get install systemd)")
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/fastpersistd", daemon_script(), 1))
    proc = subprocess.run(
        [analyze, "security", "--offline=yes", "--no-pager", str(unit)],
        capture_output=True, text=True, timeout=120,
    )
    if "--offline" in proc.stderr:
        pytest.skip(f"systemd-analyze security --offline needs systemd >= 250: {proc.stderr}")
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout)
    assert found, proc.stdout + proc.stderr
    assert float(found.group(1)) <= 2.0, proc.stdout


def test_systemd_unit_essentials() -> None:
    """What the daemon's contract needs, whatever else the unit says."""
    assert unit_value("User") == unit_value("Group") == "fastpersist"
    assert unit_value("RuntimeDirectory") == "fastpersist"
    assert unit_value("RuntimeDirectoryMode") == "0750"
    argv = shlex.split(unit_value("ExecStart"))
    assert flag(argv, "--socket") == SOCKET
    assert flag(argv, "--socket-group") == "fastpersist"
    root = flag(argv, "--root")
    assert {root, "/dev/shm"} <= set(unit_value("ReadWritePaths").split())
    assert unit_value("CapabilityBoundingSet") == ""
    assert unit_value("KillSignal") == "SIGTERM"
    assert int(unit_value("TimeoutStopSec")) >= 300
    assert unit_value("LimitMEMLOCK") == "infinity"
    # Either would separate the daemon from the trainers' shared memory.
    keys = {k for _, k, _ in unit_entries(UNIT)}
    assert "PrivateIPC" not in keys
    assert not any(k in ("TemporaryFileSystem", "BindPaths") and "/dev/shm" in v
                   for _, k, v in unit_entries(UNIT))


def test_sysusers_creates_the_service_user(tmp_path: Path) -> None:
    """systemd-sysusers applies the file to an empty root and creates the unit's user."""
    sysusers = shutil.which("systemd-sysusers")
    if sysusers is None:
        _missing("systemd-sysusers not installed (Debian/Ubuntu: apt-get install systemd)")
    (tmp_path / "etc").mkdir()
    proc = subprocess.run(
        [sysusers, f"--root={tmp_path}", "-"], input=SYSUSERS.read_text(),
        capture_output=True, text=True, timeout=60,
    )
    # It reports what it creates on stderr; problems with the file are "-:LINE: ...".
    problems = [ln for ln in proc.stderr.splitlines() if ln.startswith("-:")]
    assert proc.returncode == 0 and not problems, proc.stderr
    passwd = (tmp_path / "etc" / "passwd").read_text()
    group = (tmp_path / "etc" / "group").read_text()
    user = unit_value("User")
    assert re.search(rf"^{user}:x:\d+:\d+:.*:/usr/sbin/nologin$", passwd, re.M), passwd
    assert re.search(rf"^{unit_value('Group')}:x:\d+:", group, re.M), group


# --- Kubernetes ----------------------------------------------------------------------------

MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_kubernetes_manifests_validate(path: Path) -> None:
    """Every document against the API schema, strict: unknown fields are errors. An
    unknown kind raises SchemaNotFoundError, which fails the test too."""
    docs = load_docs(path)
    assert docs
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            where = ".".join(str(p) for p in e.path)
            pytest.fail(f"{path.name}: {doc['kind']} {where}: {e.message}")
        # No namespace: the manifests go wherever `kubectl apply -n` puts them.
        assert "namespace" not in doc["metadata"]


def test_daemonset_probes_use_the_daemon_socket() -> None:
    container = daemon_container()
    socket = flag(container["args"], "--socket")
    assert socket == SOCKET
    expected = ["fpctl", "daemon", "status", "--daemon", f"unix://{socket}"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["exec"]["command"] == expected, probe
    # The socket must be on the volume the trainers mount.
    assert os.path.dirname(socket) in host_mounts(only_doc(DAEMONSET)).values()


def test_daemonset_stops_gracefully_and_runs_unprivileged() -> None:
    doc = only_doc(DAEMONSET)
    spec = pod_spec(doc)
    assert spec["terminationGracePeriodSeconds"] >= 300
    assert spec["securityContext"]["runAsUser"] == DAEMON_UID
    assert spec["securityContext"]["runAsNonRoot"] is True
    security = daemon_container()["securityContext"]
    assert "runAsUser" not in security  # inherits the pod's non-root user
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}


def test_training_example_mounts_what_the_daemon_mounts() -> None:
    """Same hostPaths at the same paths, FASTPERSIST_DAEMON at the daemon's socket,
    and the daemon's group among the trainer's groups (the socket is 0660)."""
    daemon, trainer = only_doc(DAEMONSET), only_doc(TRAINING)
    daemon_mounts = host_mounts(daemon)
    assert all(host == mount for host, mount in daemon_mounts.items())
    container = daemon_container()
    needed = {flag(container["args"], "--root"), os.path.dirname(SOCKET), "/dev/shm"}
    assert set(daemon_mounts) == needed
    assert host_mounts(trainer) == daemon_mounts

    (trainer_container,) = pod_spec(trainer)["containers"]
    env = {e["name"]: e.get("value") for e in trainer_container.get("env", [])}
    assert env["FASTPERSIST_DAEMON"] == f"unix://{flag(container['args'], '--socket')}"
    daemon_gid = pod_spec(daemon)["securityContext"]["runAsGroup"]
    assert daemon_gid in pod_spec(trainer)["securityContext"]["supplementalGroups"]


def test_metrics_port_is_the_same_everywhere() -> None:
    doc = only_doc(DAEMONSET)
    annotations = doc["spec"]["template"]["metadata"]["annotations"]
    container = daemon_container()
    port = int(flag(container["args"], "--metrics-listen").rpartition(":")[2])
    assert int(annotations["prometheus.io/port"]) == port
    assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in container["ports"]
    assert annotations["prometheus.io/scrape"] == "true"


# --- Dockerfile ----------------------------------------------------------------------------


def test_dockerfile_copy_sources_are_in_the_build_context() -> None:
    """Each COPY source exists in the repo and survives the root .dockerignore (an
    allow list), whose patterns keep the venv, build/ and .git out of the context."""
    rules = dockerignore_rules()
    sources = copy_sources()
    assert sources
    for source in sources:
        assert (REPO / source).exists(), f"COPY {source}: not in the repository"
        assert not dockerignored(source.rstrip("/"), rules), f"COPY {source}: in .dockerignore"
    for junk in (".venv/bin/python", ".git/HEAD", "build/lib/x.so", ".whl/a.whl",
                 "fastpersist/_engine.cpython-311-x86_64-linux-gnu.so",
                 "fastpersist/__pycache__/api.cpython-311.pyc", "fastpersist.egg-info/PKG-INFO"):
        assert dockerignored(junk, rules), f"{junk} would be sent to the Docker daemon"


def test_dockerfile_runs_the_daemon_unprivileged_without_torch() -> None:
    # Exec form: the daemon is PID 1 and gets the SIGTERM itself (a shell would not
    # pass it on, and the daemon would be SIGKILLed mid-commit after the timeout).
    assert exec_form(docker_instruction("ENTRYPOINT")) == ["fastpersistd"]
    user = docker_instruction("USER").split(":")[0]
    assert user not in ("", "root", "0")
    assert int(user) == DAEMON_UID
    runs = " ".join(args for ins, args in final_stage() if ins == "RUN")
    assert re.search(rf"useradd .*--uid {DAEMON_UID}\b", runs)

    # torch: never named in a pip install, and fastpersist itself only with --no-deps
    # (its dependencies are torch and the rest of the training stack).
    installs = 0
    for ins, args in dockerfile_instructions():
        if ins != "RUN":
            continue
        for command in re.split(r"&&|;|\|\|", args):
            words = command.split()
            if words[:2] != ["pip", "install"] and words[1:4] != ["-m", "pip", "install"]:
                continue
            installs += 1
            assert not any(re.match(r"torch\b", w) for w in words), command
            if any(w == "." or w.startswith(("./", "/src")) for w in words):
                assert "--no-deps" in words, command
    assert installs >= 2


def test_dockerfile_socket_and_health_check_match_the_daemonset() -> None:
    cmd = exec_form(docker_instruction("CMD"))
    container = daemon_container()
    assert flag(cmd, "--socket") == flag(container["args"], "--socket") == SOCKET
    assert flag(cmd, "--root") == flag(container["args"], "--root")
    health = docker_instruction("HEALTHCHECK")
    probe = exec_form(health[health.index("CMD ") + 4:])
    assert probe == container["livenessProbe"]["exec"]["command"]


def test_dockerfile_commands_are_console_scripts() -> None:
    """ENTRYPOINT and the health check run console scripts of this package."""
    scripts = project_scripts()
    assert "fpctl" in scripts
    assert "fastpersistd" in scripts


# --- the image's Python environment --------------------------------------------------------

# The image installs the daemon's dependencies and tqdm, not these (numpy and
# zstandard are in it, for --tier-compression zstd, imported only to compress).
NOT_IN_IMAGE = ("torch", "safetensors", "crc32c")


def run_without_image_deps(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m module args` with the packages the image lacks made unimportable."""
    code = (f"import runpy, sys\nfor m in {NOT_IN_IMAGE!r}: sys.modules[m] = None\n"
            f"sys.argv = [{module!r}, *{list(args)!r}]\n"
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def test_daemon_accepts_the_deployed_arguments() -> None:
    """Every argument list in deploy/ parses with the daemon's own parser."""
    cli = pytest.importorskip("fastpersist.daemon.cli")
    container = daemon_container()
    for argv in (shlex.split(unit_value("ExecStart"))[1:], container["args"],
                 exec_form(docker_instruction("CMD"))):
        args = cli.build_parser().parse_args(argv)
        assert str(args.socket) == SOCKET


def test_daemon_imports_without_torch() -> None:
    proc = run_without_image_deps("fastpersist.daemon", "--help")
    assert proc.returncode == 0, proc.stderr


def test_health_probe_runs_without_torch() -> None:
    """The probes and HEALTHCHECK run `fpctl daemon status` in the torch-free image: if
    fpctl cannot be imported there, every probe fails and the kubelet keeps killing a
    healthy daemon."""
    listing = subprocess.run([sys.executable, "-m", "fastpersist.cli", "--help"],
                             capture_output=True, text=True, timeout=120, cwd=REPO)
    if not re.search(r"^\s+daemon\b", listing.stdout, re.M):
        pytest.skip("fpctl has no `daemon` command yet")
    proc = run_without_image_deps("fastpersist.cli", "daemon", "status", "--help")
    assert proc.returncode == 0, proc.stderr


def test_docker_context_builds_the_package(tmp_path: Path) -> None:
    """What the builder stage does, minus Docker: from exactly the files COPY takes
    (after .dockerignore), build fastpersist with --no-deps. The wheel must carry the
    compiled C engine and the gRPC stubs."""
    context = tmp_path / "context"
    for rel in context_files():
        (context / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, context / rel)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-q", "-w", str(tmp_path / "dist"), str(context)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("fastpersist-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(re.match(r"fastpersist/_engine\..*\.so$", n) for n in names), names
    assert "fastpersist/_proto/fastpersist_pb2_grpc.py" in names


def test_hadolint(tmp_path: Path) -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed")
    proc = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
