"""deploy/: every manifest parses and carries what a deployment needs.

Validators used: Ray's own cluster-launcher JSON schema (ray/autoscaler/ray-schema.json,
shipped in the ray wheel) for ray-cluster.yaml; Ray's KubeRay CR parser (the autoscaler's
`_derive_autoscaling_config_from_ray_cr`, which ends in the same schema check) for the
RayCluster; the Kubernetes OpenAPI schemas of `kubernetes-validate` (when installed) for the
core objects and the pod templates inside the KubeRay objects; ServeConfig.from_yaml for
deploy/pdserve.yaml; a live ServiceMetrics registry for the dashboard's metric names.
No Ray cluster is started.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBERAY = DEPLOY / "kuberay"
DASHBOARD = DEPLOY / "grafana" / "pdserve-dashboard.json"


def load_all(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def kuberay_docs() -> dict[str, dict]:
    """{kind: object} of every document under deploy/kuberay (one object per kind, except
    NetworkPolicies, which are checked by test_core_objects_match_the_kubernetes_schema)."""
    out = {}
    for path in sorted(KUBERAY.glob("*.yaml")):
        for doc in load_all(path):
            out.setdefault(doc["kind"], doc)
    return out


def serve_argv(command: str) -> list[str]:
    """The `pdserve serve ...` argv inside a shell command line (also inside `bash -c '...'`)."""
    words = shlex.split(command.replace("\n", " "))
    nested = [w for w in words if " " in w and "pdserve serve" in w]
    if nested:
        return serve_argv(nested[0])
    starts = [i for i, w in enumerate(words[:-1]) if w == "pdserve" and words[i + 1] == "serve"]
    assert starts, f"no `pdserve serve` in {command!r}"
    i = starts[0]
    end = next((j for j in range(i, len(words)) if words[j] in ("&&", "||", ";", "&", ">")),
               len(words))
    return words[i + 2:end]


def assert_serve_flags_parse(argv: list[str]):
    """The flags are real `pdserve serve` flags and the config they build is valid."""
    import argparse

    from cluster.config.flags import add_cli_flags
    from cluster.config.serve import ServeConfig

    parser = argparse.ArgumentParser()
    add_cli_flags(parser)
    args = parser.parse_args(argv)  # SystemExit on an unknown flag
    cfg = ServeConfig.from_dict(None).with_values(
        {k: v for k, v in vars(args).items() if "." in k})
    assert cfg.pools.address == "auto"
    return cfg


# ---- ray-cluster.yaml (ray up) ----------------------------------------------------------
def test_ray_cluster_yaml_matches_rays_launcher_schema():
    import jsonschema

    cfg = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    spec = importlib.util.find_spec("ray")
    schema_path = Path(spec.submodule_search_locations[0]) / "autoscaler" / "ray-schema.json"
    jsonschema.validate(cfg, json.loads(schema_path.read_text()))

    assert cfg["cluster_name"] and cfg["provider"]["type"]
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] in types
    gpu_types = {n: t for n, t in types.items() if t.get("resources", {}).get("GPU", 0) > 0}
    assert gpu_types, "no GPU worker node type"
    assert all(t["min_workers"] >= 1 for t in gpu_types.values())
    # pool pinning: each GPU type offers the custom resource one pool asks for
    offered = {r for t in gpu_types.values() for r in t["resources"]} - {"CPU", "GPU"}
    assert {"prefill_node", "decode_node"} <= offered

    setup = " ".join(cfg["setup_commands"])
    assert "pip install" in setup and "pdserve" in setup and "[triton]" in setup
    head_start = " ".join(cfg["head_start_ray_commands"])
    assert "ray start --head" in head_start
    assert "ray start --address" in " ".join(cfg["worker_start_ray_commands"])
    serve = serve_argv(head_start)
    cfg_s = assert_serve_flags_parse(serve)
    assert set(cfg_s.pools.prefill_resources) <= offered
    assert set(cfg_s.pools.decode_resources) <= offered
    assert cfg_s.server.auth_token_file, "gRPC on 0.0.0.0 needs the bearer token"


# ---- KubeRay ------------------------------------------------------------------------------
def _ports(template: dict) -> dict[str, int]:
    return {p.get("name", str(p["containerPort"])): p["containerPort"]
            for c in template["spec"]["containers"] for p in c.get("ports", [])}


def test_raycluster_has_head_and_gpu_worker_groups_with_ports():
    rc = kuberay_docs()["RayCluster"]
    assert rc["apiVersion"] == "ray.io/v1" and rc["kind"] == "RayCluster"
    assert rc["metadata"]["name"]
    spec = rc["spec"]
    head = spec["headGroupSpec"]
    ports = _ports(head["template"])
    assert 50051 in ports.values(), "gRPC port"
    assert 8000 in ports.values(), "metrics port (server.metrics_port)"
    assert 6379 in ports.values(), "Ray GCS port"
    groups = spec["workerGroupSpecs"]
    assert groups
    for g in groups:
        assert g["groupName"] and g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        (container,) = g["template"]["spec"]["containers"]
        limits = container["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) >= 1
        assert container["image"] == head["template"]["spec"]["containers"][0]["image"]
    # every container of the cluster carries the same Ray token setting
    for t in [head["template"]] + [g["template"] for g in groups]:
        env = {e["name"]: e for e in t["spec"]["containers"][0].get("env", [])}
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "ray-auth"


def test_raycluster_resources_as_rays_kuberay_autoscaler_reads_them():
    mod = pytest.importorskip("ray.autoscaler._private.kuberay.autoscaling_config")
    rc = copy.deepcopy(kuberay_docs()["RayCluster"])
    rc["metadata"].setdefault("namespace", "default")
    node_types = mod._derive_autoscaling_config_from_ray_cr(rc)["available_node_types"]
    workers = {n: t["resources"] for n, t in node_types.items() if n != "headgroup"}
    assert node_types["headgroup"]["resources"]["CPU"] == 0  # no pool actors on the head
    assert all(r["GPU"] >= 1 for r in workers.values())
    assert {"prefill_node", "decode_node"} <= {k for r in workers.values() for k in r}


def test_rayjob_runs_pdserve_serve_on_the_raycluster():
    docs = kuberay_docs()
    job, rc = docs["RayJob"], docs["RayCluster"]
    assert job["apiVersion"] == "ray.io/v1"
    assert job["spec"]["clusterSelector"]["ray.io/cluster"] == rc["metadata"]["name"]
    assert job["spec"]["shutdownAfterJobFinishes"] is False
    cfg = assert_serve_flags_parse(serve_argv(job["spec"]["entrypoint"]))
    assert cfg.server.host == "0.0.0.0" and cfg.server.auth_token_file
    assert cfg.server.port == 50051 and cfg.server.metrics_port == 8000
    # the pools' custom resources are offered by the worker groups
    offered = set()
    for g in rc["spec"]["workerGroupSpecs"]:
        offered |= set(json.loads(json.loads(g["rayStartParams"]["resources"])))
    assert set(cfg.pools.prefill_resources) | set(cfg.pools.decode_resources) <= offered
    # files the entrypoint reads are mounted on the head
    mounts = {m["mountPath"] for m in
              rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert str(Path(cfg.server.auth_token_file).parent) in mounts
    svc = docs["Service"]
    assert {p["port"] for p in svc["spec"]["ports"]} == {50051, 8000}
    assert svc["spec"]["selector"]["ray.io/node-type"] == "head"


def test_core_objects_match_the_kubernetes_schema():
    kv = pytest.importorskip("kubernetes_validate")  # optional: `pip install kubernetes-validate`
    version = "1.30.0"
    checked = 0
    for path in sorted(KUBERAY.glob("*.yaml")):
        for doc in load_all(path):
            if doc["apiVersion"].startswith("ray.io/"):
                # no CRD schema offline: validate the pod templates inside instead
                spec = doc["spec"]
                templates = [spec["headGroupSpec"]["template"]] + [
                    g["template"] for g in spec["workerGroupSpecs"]] if doc["kind"] == \
                    "RayCluster" else [spec["submitterPodTemplate"]]
                for t in templates:
                    kv.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                 "metadata": {"name": "t"}, "template": t}, version, strict=True)
                    checked += 1
            else:
                kv.validate(doc, version, strict=True)
                checked += 1
    assert checked >= 6


# ---- Dockerfile -----------------------------------------------------------------------------
def test_dockerfile_builds_on_cuda_pytorch_and_installs_pdserve_with_triton():
    text = (DEPLOY / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.replace("\\\n", " ").splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    args = dict(re.match(r"ARG (\w+)=(\S+)", ln).groups() for ln in lines
                if re.match(r"ARG \w+=", ln))
    froms = [ln.split()[1] for ln in lines if ln.upper().startswith("FROM ")]
    assert froms
    image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], froms[0])
    assert re.fullmatch(r"pytorch/pytorch:[\d.]+-cuda[\d.]+-cudnn\d+-(runtime|devel)", image), image
    run = " ".join(ln for ln in lines if ln.startswith("RUN "))
    assert re.search(r"pip install [^&]*\.\[triton\]", run), "installs pdserve with triton"
    assert "ray[default]==" in run
    assert "gcc" in run  # triton compiles its launcher at runtime
    assert any(ln.startswith("USER ") and ln.split()[1] not in ("root", "0") for ln in lines)
    exposed = {int(p) for ln in lines if ln.startswith("EXPOSE ") for p in ln.split()[1:]}
    assert {50051, 8000} <= exposed
    assert 'CMD ["pdserve", "serve"' in text


def test_dockerignore_keeps_the_package_sources():
    ignored = {ln.strip() for ln in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")}
    pyproject = (REPO / "pyproject.toml").read_text()
    packages = re.search(r'include = \[(.*?)\]', pyproject).group(1)
    for pkg in re.findall(r'"(\w+)\*"', packages):
        assert pkg not in ignored, pkg
    assert {"README.md", "pyproject.toml", "deploy"}.isdisjoint(ignored)
    assert ".venv" in ignored and ".git" in ignored


# ---- deploy/pdserve.yaml ----------------------------------------------------------------------
def test_pdserve_yaml_loads_and_covers_every_section():
    from cluster.config.serve import SECTIONS, ServeConfig

    path = DEPLOY / "pdserve.yaml"
    cfg = ServeConfig.from_yaml(path)
    raw = yaml.safe_load(path.read_text())
    assert set(raw) == set(SECTIONS)
    for dotted in ("pools.prefill_workers", "pools.decode_workers", "pools.prefill_resources",
                   "pools.decode_resources", "model.path", "model.dtype", "cache.block_size",
                   "cache.kv_cache_memory_gb", "scheduler.fairness_policy",
                   "scheduler.chunk_policy", "scheduler.max_prefill_chunk",
                   "transfer.connector", "transfer.send_policy", "transfer.rate_gbps",
                   "transfer.bind_host", "limits.max_queue_len", "limits.drain_timeout_s",
                   "server.host", "server.port", "server.metrics_port",
                   "server.auth_token_file", "server.tls_cert"):
        section, key = dotted.split(".")
        assert key in raw[section], dotted
    # the runbook's 1 node x 8 GPUs: 2 prefill + 6 decode, one GPU each
    assert (cfg.pools.prefill_workers, cfg.pools.decode_workers) == (2, 6)
    assert cfg.pools.gpus_per_worker * (2 + 6) == 8
    assert cfg.server.host == "127.0.0.1"  # the safe default; deployments widen it with a token


def test_wait_for_resources_parses_its_arguments():
    sys.path.insert(0, str(DEPLOY))
    try:
        import wait_for_resources as w
    finally:
        sys.path.remove(str(DEPLOY))
    assert w.parse_wants(["GPU=16", "decode_node=8"]) == {"GPU": 16.0, "decode_node": 8.0}
    assert w.missing({"GPU": 8.0}, {"GPU": 16.0, "x": 1.0}) == {"GPU": 16.0, "x": 1.0}
    assert w.missing({"GPU": 16.0, "x": 2.0}, {"GPU": 16.0, "x": 1.0}) == {}
    for bad in (["GPU"], ["=1"], ["GPU=0"]):
        with pytest.raises(ValueError):
            w.parse_wants(bad)
    out = subprocess.run([sys.executable, str(DEPLOY / "wait_for_resources.py"), "GPU"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "NAME=AMOUNT" in out.stderr


# ---- Grafana dashboard --------------------------------------------------------------------------
def exported_series() -> set[str]:
    """Every series name the service's /metrics can show (a live registry, one worker of
    each role, so that the per-worker families have samples)."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from cluster.metrics import ServiceMetrics

    def worker(worker_id: str, role: str):  # the WorkerStats fields the collector reads
        return SimpleNamespace(worker_id=worker_id, role=role, alive=True, num_running=0,
                               num_waiting=0, kv_blocks_used=1, kv_blocks_free=3, extra={})

    m = ServiceMetrics()
    m.update_workers([worker("prefill-0", "prefill"), worker("decode-0", "decode")])
    m.update_chunk_sizes({"prefill-0": {16: 2}})  # the chunk histogram comes from stats
    text = generate_latest(m.registry).decode()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = []

    def walk(panels):
        for p in panels:
            exprs.extend(t["expr"] for t in p.get("targets", []))
            walk(p.get("panels", []))

    walk(dash["panels"])
    for var in dash["templating"]["list"]:
        q = var.get("query")
        if var["type"] == "query":
            exprs.append(q["query"] if isinstance(q, dict) else q)
    return exprs


def test_dashboard_queries_use_only_exported_metric_names():
    exprs = dashboard_queries()
    assert len(exprs) >= 15
    used = {n for e in exprs for n in re.findall(r"pdserve:[A-Za-z0-9_:]+", e)}
    exported = exported_series()
    assert used <= exported, sorted(used - exported)
    # what the issue asks the dashboard to show
    for name in ("pdserve:time_to_first_token_seconds_bucket",
                 "pdserve:inter_token_latency_seconds_bucket", "pdserve:kv_cache_usage_perc",
                 "pdserve:kv_transfer_bytes_total", "pdserve:kv_send_queue_seconds_total",
                 "pdserve:num_requests_running", "pdserve:num_requests_waiting",
                 "pdserve:worker_alive"):
        assert name in used, name
    quantile_exprs = [e for e in exprs if "histogram_quantile" in e]
    assert quantile_exprs and all("_bucket" in e and "le" in e for e in quantile_exprs)
    assert any("by (role)" in e and "kv_cache_usage_perc" in e for e in exprs)  # per pool


def test_dashboard_is_importable_grafana_json():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 30
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24
        for t in p.get("targets", []):
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            assert t["datasource"]["uid"] == "${datasource}"
