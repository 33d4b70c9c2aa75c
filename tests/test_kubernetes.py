"""configs/kubernetes/: the manifests validate against the Kubernetes API schemas (offline,
kubernetes-validate's bundled schemas, strict: no unknown fields), and they agree with the
server's contract: the serve flags parse, probes name the routes that answer them, the grace
period covers the preStop sleep plus the drain, the Service reaches the container's port."""

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from jaxpaged.cli import build_parser

MANIFESTS = Path(__file__).resolve().parents[1] / "configs" / "kubernetes"
#: Kubernetes API versions checked: an older one clusters still run, and the newest bundled.
K8S_VERSIONS = ["1.30.0", "1.37.0"]
K8S_VERSION = K8S_VERSIONS[-1]


def documents() -> dict[str, dict]:
    docs = {}
    for path in sorted(MANIFESTS.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[doc["kind"]] = doc
    return docs


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("kind", ["Deployment", "Service", "PersistentVolumeClaim"])
def test_manifest_validates_against_the_kubernetes_schema(kind, version):
    kubernetes_validate.validate(documents()[kind], version, strict=True)


def test_the_validator_rejects_a_broken_deployment():
    broken = documents()["Deployment"]
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"][
        "path"] = 42
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
    broken = documents()["Service"]
    broken["spec"]["portz"] = broken["spec"].pop("ports")     # a typo strict mode catches
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_deployment_matches_the_server_contract():
    docs = documents()
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"] == ["jaxpaged", "serve"]
    args = build_parser().parse_args(["serve", *container["args"]])   # every flag exists
    assert args.host == "0.0.0.0" and args.shutdown_timeout == 45
    assert args.compilation_cache_dir.startswith(next(
        m["mountPath"] for m in container["volumeMounts"] if m["name"] == "compile-cache"))
    assert args.model.startswith(next(
        m["mountPath"] for m in container["volumeMounts"] if m["name"] == "model"))
    port = next(p for p in container["ports"] if p["name"] == "http")
    assert port["containerPort"] == args.port
    probes = {name: container[name]["httpGet"] for name in
              ("startupProbe", "livenessProbe", "readinessProbe")}
    assert {name: p["path"] for name, p in probes.items()} == {
        "startupProbe": "/health", "livenessProbe": "/health", "readinessProbe": "/ready"}
    assert all(p["port"] == "http" for p in probes.values())
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] > int(pre_stop[1]) + args.shutdown_timeout
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]
              if "persistentVolumeClaim" in v}
    assert docs["PersistentVolumeClaim"]["metadata"]["name"] in claims


def test_service_selects_the_pods_and_their_port():
    docs = documents()
    labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    service = docs["Service"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert docs["Deployment"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {"http"}
    assert service["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
