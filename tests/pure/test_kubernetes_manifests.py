"""configs/kubernetes/: valid against Kubernetes' own schemas (offline), and in agreement with its cluster file.

The schemas are kubernetes-validate's (shipped in the wheel, 1.25 to its release's Kubernetes; no network),
strict, so an unknown or misspelt field fails. Native sidecars (an init container's ``restartPolicy``)
exist from 1.28 and are on by default from 1.29: the manifests are checked against 1.29 and the newest.
The PodMonitor is a Prometheus Operator CRD with no schema here: it is checked against the pods instead.
"""

from __future__ import annotations

import posixpath
import re
import stat
from pathlib import Path
from typing import Any

import pytest

from protocol.config import ClusterConfig, load_config, token_file_problem

yaml = pytest.importorskip("yaml", reason="PyYAML comes with the test extra (pip install -e '.[test]')")
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate comes with the test extra (pip install -e '.[test]')")

DIR = Path(__file__).resolve().parents[2] / "configs" / "kubernetes"
VERSIONS = ["1.29.0", kubernetes_validate.utils.latest_version()]
Manifest = dict[str, Any]


def documents() -> dict[str, list[Manifest]]:
    return {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d] for p in sorted(DIR.glob("*.yaml"))}


def one(kind: str) -> Manifest:
    found = [d for docs in documents().values() for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} manifests"
    return found[0]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> ClusterConfig:
    path = tmp_path_factory.mktemp("k8s") / "cluster.toml"
    path.write_text(one("ConfigMap")["data"]["cluster.toml"])
    return load_config(path)


def containers(pod: Manifest) -> dict[str, Manifest]:
    return {c["name"]: c for c in pod.get("initContainers", []) + pod["containers"]}


def port(container: Manifest, name_or_number: str | int) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    ports = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == name_or_number]
    assert ports, f"{container['name']} has no port named {name_or_number!r}"
    return int(ports[0])


def mounted_at(pod: Manifest, container: Manifest, path: str) -> Manifest:
    """The volume whose mount in ``container`` holds ``path``."""
    mounts = [m for m in container.get("volumeMounts", [])
              if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mounts, f"{path} is on no volume of {container['name']}"
    deepest = max(mounts, key=lambda m: len(m["mountPath"]))
    return next(v for v in pod["volumes"] if v["name"] == deepest["name"])


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", [n for n in documents() if n != "podmonitor.yaml"])
def test_manifests_are_valid_kubernetes(name: str, version: str) -> None:
    for doc in documents()[name]:
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_schemas_catch_a_misspelt_field_and_a_too_old_kubernetes() -> None:
    job = one("Job")
    with pytest.raises(kubernetes_validate.ValidationError, match="restartPolicy"):
        kubernetes_validate.validate(job, "1.27.0", strict=True)  # no native sidecars yet
    probe = job["spec"]["template"]["spec"]["initContainers"][0]["startupProbe"]
    probe["httpGett"] = probe.pop("httpGet")
    with pytest.raises(kubernetes_validate.ValidationError, match="httpGett"):
        kubernetes_validate.validate(job, VERSIONS[0], strict=True)


def test_training_pods_are_an_indexed_job_with_native_sidecars(cluster: ClusterConfig) -> None:
    job = one("Job")
    pod = job["spec"]["template"]["spec"]
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == cluster.workers
    assert [(c["name"], c.get("restartPolicy")) for c in pod["initContainers"]] == [
        ("bps-server", "Always"), ("bps-worker", "Always")]  # the server first: the worker needs it
    for sidecar in pod["initContainers"]:
        assert "--id" not in sidecar["command"]  # from JOB_COMPLETION_INDEX
    assert "--bind" in pod["initContainers"][0]["command"]


def test_servers_names_and_ports_are_the_pods(cluster: ClusterConfig) -> None:
    service, job, sts = one("Service"), one("Job"), one("StatefulSet")
    name = service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    job_pod, sts_pod = job["spec"]["template"], sts["spec"]["template"]
    for template in (job_pod, sts_pod):
        assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    assert job_pod["spec"]["subdomain"] == name and sts["spec"]["serviceName"] == name
    for template in (job_pod, sts_pod):  # one machine each: no two BytePS pods on one node
        (term,) = template["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        assert term["labelSelector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    colocated = [s for s in cluster.servers if s.worker is not None]
    cpu_only = [s for s in cluster.servers if s.worker is None]
    server_port = port(containers(job_pod["spec"])["bps-server"], "bps")
    for i, s in enumerate(colocated):  # server i in the Job's pod i, beside worker i
        assert (s.id, s.worker, s.host, s.port) == (i, i, f"{job['metadata']['name']}-{i}.{name}", server_port)
    assert sts["spec"]["replicas"] == len(cpu_only)
    env = {e["name"]: e.get("value") for e in sts_pod["spec"]["containers"][0]["env"]}
    assert env["BPS_ID"] == "hostname" and int(env["BPS_ID_OFFSET"]) == len(colocated)
    sts_port = port(sts_pod["spec"]["containers"][0], "bps")
    for j, s in enumerate(cpu_only):  # ordinal j: BPS_ID_OFFSET + j
        assert (s.id, s.host, s.port) == (len(colocated) + j, f"{sts['metadata']['name']}-{j}.{name}", sts_port)


def probes_agree(container: Manifest, metrics_port: int) -> None:
    kinds = {k: container[k]["httpGet"] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in container}
    assert "livenessProbe" in kinds and "readinessProbe" in kinds, container["name"]
    for kind, get in kinds.items():
        assert port(container, get["port"]) == metrics_port, f"{container['name']} {kind}"
        assert get["path"] == ("/livez" if kind == "livenessProbe" else "/readyz"), f"{container['name']} {kind}"


def test_probes_are_on_the_metrics_ports(cluster: ClusterConfig) -> None:
    job_pod = containers(one("Job")["spec"]["template"]["spec"])
    sts_pod = containers(one("StatefulSet")["spec"]["template"]["spec"])
    for s in cluster.servers:
        assert s.metrics is not None and s.metrics[0] == "0.0.0.0"  # probes and Prometheus use the pod's IP
        probes_agree(job_pod["bps-server"] if s.worker is not None else sts_pod["bps-server"], s.metrics[1])
    for w in cluster.worker_specs:
        assert w.metrics is not None and w.metrics[0] == "0.0.0.0"
        probes_agree(job_pod["bps-worker"], w.metrics[1])
    for sidecar in ("bps-server", "bps-worker"):  # a sidecar's startupProbe holds back the trainer
        assert job_pod[sidecar]["startupProbe"]["httpGet"]["path"] == "/readyz"


def test_sockets_and_shared_memory_are_shared_emptydirs(cluster: ClusterConfig) -> None:
    pod = one("Job")["spec"]["template"]["spec"]
    by_name = containers(pod)
    trainer = by_name["trainer"]
    env = {e["name"]: e for e in trainer["env"]}
    assert "job-completion-index" in env["BPS_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
    for w in cluster.worker_specs:
        socket_dir = posixpath.dirname(w.socket)
        volumes = [mounted_at(pod, by_name[c], socket_dir) for c in ("bps-worker", "trainer")]
        assert volumes[0] is volumes[1] and volumes[0]["emptyDir"] == {}
        assert env["BPS_SOCKET"]["value"].replace("$(BPS_INDEX)", str(w.id)) == w.socket
    shm = [mounted_at(pod, by_name[c], "/dev/shm") for c in ("bps-server", "bps-worker", "trainer")]
    assert shm[0] is shm[1] is shm[2]
    assert shm[0]["emptyDir"]["medium"] == "Memory" and re.fullmatch(r"\d+[GM]i", shm[0]["emptyDir"]["sizeLimit"])


@pytest.mark.parametrize("kind", ["Job", "StatefulSet"])
def test_the_token_is_a_secret_the_daemons_accept(cluster: ClusterConfig, kind: str) -> None:
    pod = one(kind)["spec"]["template"]["spec"]
    assert cluster.token_file is not None
    secrets = {v["name"] for v in pod["volumes"] if "secret" in v}
    for c in containers(pod).values():
        if not c["name"].startswith("bps-"):  # the trainer never sees the token
            assert not secrets & {m["name"] for m in c.get("volumeMounts", [])}, c["name"]
            continue
        assert mounted_at(pod, c, cluster.token_file)["secret"] == {"secretName": "bps-token", "defaultMode": 0o400}
        config = c["command"][c["command"].index("--config") + 1]
        assert mounted_at(pod, c, config)["configMap"]["name"] == one("ConfigMap")["metadata"]["name"]
    # As the kubelet writes it: root's, defaultMode, and with an fsGroup also group-readable (0440).
    security = pod["securityContext"]
    mode = 0o400 | (0o440 if "fsGroup" in security else 0)
    problem = token_file_problem(stat.S_IFREG | mode, 0, uid=security.get("runAsUser", 0),
                                 group_readable=cluster.token_group_readable)
    assert problem is None, problem


def test_the_podmonitor_scrapes_every_daemon() -> None:
    monitor = one("PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"]
    endpoints = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    assert all(e["path"] == "/metrics" for e in monitor["spec"]["podMetricsEndpoints"])
    for kind in ("Job", "StatefulSet"):
        template = one(kind)["spec"]["template"]
        assert selector.items() <= template["metadata"]["labels"].items()
        for c in containers(template["spec"]).values():
            if c["name"].startswith("bps-"):
                names = {p.get("name") for p in c["ports"]}
                assert names & endpoints, f"{kind} {c['name']}: no port the PodMonitor scrapes"
