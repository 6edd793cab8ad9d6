"""The Helm chart (helm/gpupool), rendered and linted by the real Helm v4 library (PyPI helm-python-sdk),
with no cluster: every object checked by kubernetes-validate (strict) and Volcano's CRD schemas, the values
schema's named errors, and the chart's Volcano objects identical to what `gpupool render` prints.

The Zero-to-JupyterHub dependency is fetched by `helm dependency build` from https://hub.jupyter.org/helm-chart/,
which this network (PyPI, npm and Debian only) cannot reach; without helm/gpupool/charts/jupyterhub-*.tgz the
chart is rendered with `jupyterhub.enabled=false`, and the test that renders both charts together skips.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import importlib.util
import io
import tarfile
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from gpupool.hub import __version__
from gpupool.hub.cli import main
from gpupool.hub.culler import IdleCuller
from gpupool.hub.render import policy_files
from gpupool.policies import DEFAULT_POLICY_DIR, EXAMPLES_DIR, load_policy
from gpupool.spawner import volcano
from gpupool.spawner.wiring import ACCOUNTING_SCOPES, CULLER_ROLE, CULLER_SCOPES

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "helm" / "gpupool"
Z2JH_ARCHIVES = sorted((CHART / "charts").glob("jupyterhub-*.tgz"))
Z2JH_MISSING = (
    "the Zero-to-JupyterHub chart is not in helm/gpupool/charts/: `helm dependency build helm/gpupool` needs "
    "https://hub.jupyter.org/helm-chart/, which this network cannot reach"
)
RELEASE, NAMESPACE = "pool", "jhub"
#: Volcano's scheduler configuration that gpupool ships, given to Volcano's own chart (docs/kubernetes.md).
SCHEDULER_CONF = CHART / "files" / "volcano-scheduler.conf"
VOLCANO_CHART_FLAG = "custom.scheduler_config_override"
#: What an operator adds to the generated values: the PostgreSQL server and the Secret with its password,
#: which the hub gets too (it records usage).
HUB_PASSWORD = {"valueFrom": {"secretKeyRef": {"name": "gpupool-postgres", "key": "password"}}}
OPERATOR_VALUES = {"postgresql": {"host": "postgres.db.svc", "existingSecret": "gpupool-postgres"},
                   "jupyterhub": {"hub": {"extraEnv": {"PGPASSWORD": HUB_PASSWORD}}}}


def _checks():
    # The manifest checks live in test_render.py; pytest's importlib mode puts no test folder on sys.path.
    spec = importlib.util.spec_from_file_location("gpupool_render_checks", Path(__file__).with_name("test_render.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


checks = _checks()


def gpupool(*args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(list(args)) == 0
    return out.getvalue()


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def values_for(policies: Path, jupyterhub: bool = bool(Z2JH_ARCHIVES)) -> dict[str, Any]:
    """The values an operator installs with: `gpupool render --helm-values` plus their own file."""
    generated = yaml.safe_load(gpupool("render", "--policies", str(policies), "--release", RELEASE, "--helm-values"))
    return merge(merge(generated, OPERATOR_VALUES), {"jupyterhub": {"enabled": jupyterhub}})


def values_without_culler(policies: Path) -> dict[str, Any]:
    """The values of a release that does not run the idle culler: rendered without it, and `culler.enabled` off."""
    release = volcano.Release(RELEASE, NAMESPACE)
    generated = volcano.helm_values(load_policy(policies), policy_files(policies), release, culler=False)
    return merge(merge(generated, OPERATOR_VALUES),
                 {"jupyterhub": {"enabled": bool(Z2JH_ARCHIVES)}, "culler": {"enabled": False}})


def objects(manifests: dict[str, str]) -> list[dict[str, Any]]:
    return [
        doc for path, text in sorted(manifests.items()) if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text) if doc
    ]


def render(values: dict[str, Any], name: str = RELEASE) -> list[dict[str, Any]]:
    with helm.Chart.load(CHART) as chart:
        return objects(chart.render(values, name=name, namespace=NAMESPACE, is_install=True))


def key(obj: dict[str, Any]) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


@pytest.fixture(scope="module")
def crds():
    return checks.volcano_validators()


POLICY_SETS = pytest.mark.parametrize("policies", [DEFAULT_POLICY_DIR, EXAMPLES_DIR], ids=["default", "examples"])


# --- rendering ------------------------------------------------------------------------------------------


@POLICY_SETS
def test_chart_renders_objects_that_pass_the_kubernetes_and_volcano_schemas(policies, crds):
    values = merge(values_for(policies), {
        "mlflow": {"enabled": True, "artifacts": {"destination": "s3://mlflow/", "existingSecret": "s3-keys",
                                                 "s3EndpointUrl": "http://seaweedfs:8333"}},
        "ingress": {"enabled": True, "className": "nginx", "hosts": ["gpu.example.org"],
                    "tls": [{"secretName": "gpu-tls", "hosts": ["gpu.example.org"]}]},
        "culler": {"metricsUrls": ["http://10.0.0.7:9394/metrics"], "resources": {"limits": {"memory": "256Mi"}},
                   "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
    })
    rendered = render(values)
    for obj in rendered:
        checks.validate(obj, crds)
    kinds = {(o["kind"], o["metadata"]["name"]) for o in rendered}
    assert {("Deployment", "pool-accounting"), ("Service", "pool-accounting"), ("Deployment", "pool-mlflow"),
            ("Service", "pool-mlflow"), ("Deployment", "pool-culler"), ("Service", "pool-culler"),
            ("Deployment", "pool-jobs"), ("Service", "pool-jobs"), ("Ingress", "pool"), ("ConfigMap", "pool-policies"),
            ("PriorityClass", "gpupool-deprioritized")} <= kinds
    assert len(rendered) == len({key(o) for o in rendered}), "an object is rendered twice"


@POLICY_SETS
def test_chart_objects_from_policies_are_exactly_what_gpupool_render_prints(policies):
    """One source of truth: same policies, same Queues, PriorityClasses and ConfigMaps, field for field."""
    cli = list(yaml.safe_load_all(gpupool("render", "--policies", str(policies), "--release", RELEASE,
                                          "--namespace", NAMESPACE)))
    chart = {key(o): o for o in render(values_for(policies))}
    assert [chart.get(key(o)) for o in cli] == cli
    own = {key(o) for o in cli}
    assert not [k for k in chart if k[0] in ("Queue", "PriorityClass") and k not in own]


def test_the_jupyterhub_wiring_points_at_what_the_chart_creates():
    values = values_for(EXAMPLES_DIR)
    rendered = {key(o): o for o in render(values)}
    hub = values["jupyterhub"]["hub"]
    service = rendered[("Service", NAMESPACE, "pool-accounting")]
    assert hub["services"]["accounting"]["url"] == f"http://pool-accounting:{service['spec']['ports'][0]['port']}"
    (volume,) = hub["extraVolumes"]
    assert ("ConfigMap", NAMESPACE, volume["configMap"]["name"]) in rendered
    deployment = rendered[("Deployment", NAMESPACE, "pool-accounting")]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["JUPYTERHUB_API_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "hub", "key": "hub.services.accounting.apiToken",
    }
    assert env["JUPYTERHUB_SERVICE_PREFIX"]["value"] == "/services/accounting/"
    assert env["JUPYTERHUB_SERVICE_NAME"]["value"] == "accounting"
    assert container["command"] == ["python", "-m", "gpupool.hub.services.accounting_service"]
    assert env["GPUPOOL_POLICIES"]["value"] == hub["extraEnv"]["GPUPOOL_POLICIES"]
    assert env["GPUPOOL_LEDGER_URL"]["value"] == "postgresql+psycopg://gpupool@postgres.db.svc:5432/gpupool?sslmode=prefer"
    # The password comes from the Secret, never from values.
    assert env["PGPASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "gpupool-postgres", "key": "password"}
    assert deployment["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/etc/gpupool/policies", "/tmp"}
    # Zero-to-JupyterHub's NetworkPolicy admits to the hub's API only the pods it labels so: every service calls it.
    for name in ("pool-accounting", "pool-culler", "pool-jobs"):
        labels = rendered[("Deployment", NAMESPACE, name)]["spec"]["template"]["metadata"]["labels"]
        assert labels["hub.jupyter.org/network-access-hub"] == "true", name
    # The hub records usage in the same ledger, with the same password Secret.
    ledger = hub["extraEnv"]["GPUPOOL_LEDGER_URL"]["valueFrom"]["configMapKeyRef"]
    assert rendered[("ConfigMap", NAMESPACE, ledger["name"])]["data"][ledger["key"]] == env["GPUPOOL_LEDGER_URL"]["value"]
    assert hub["extraEnv"]["PGPASSWORD"] == {"valueFrom": env["PGPASSWORD"]["valueFrom"]}
    # The jobs service: registered at its Service, in its Kubernetes mode (the hub's runner makes Volcano Jobs).
    jobs = rendered[("Deployment", NAMESPACE, "pool-jobs")]["spec"]["template"]["spec"]
    assert hub["services"]["jobs"]["url"] == \
        f"http://pool-jobs:{rendered[('Service', NAMESPACE, 'pool-jobs')]['spec']['ports'][0]['port']}"
    jobs_env = {e["name"]: e.get("value") for e in jobs["containers"][0]["env"]}
    assert jobs["containers"][0]["command"] == ["python", "-m", "gpupool.hub.services.jobs_service"]
    assert jobs_env["GPUPOOL_JOBS_MODE"] == "kubernetes" and jobs_env["JUPYTERHUB_SERVICE_PREFIX"] == "/services/jobs/"
    assert jobs["automountServiceAccountToken"] is False  # it writes the ledger's jobs table; the hub talks to Kubernetes
    # Optional parts stay out unless asked for.
    assert not [k for k in rendered if k[0] == "Ingress" or k[2] == "pool-mlflow"]


def test_the_hub_may_read_podgroups_run_volcano_jobs_and_list_nodes_and_nothing_more():
    rendered = {key(o): o for o in render(values_for(EXAMPLES_DIR))}
    role = rendered[("Role", NAMESPACE, "pool-hub-podgroups")]
    assert role["rules"] == [{"apiGroups": ["scheduling.volcano.sh"], "resources": ["podgroups"],
                              "verbs": ["get", "list", "watch"]},
                             # the job runner's (gpupool.spawner.jobs.volcano): what it calls, nothing more
                             {"apiGroups": ["batch.volcano.sh"], "resources": ["jobs"],
                              "verbs": ["list", "create", "delete"]},
                             # its pods' output into the jobs' logs (z2jh's hub Role has no pods/log)
                             {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]}]
    binding = rendered[("RoleBinding", NAMESPACE, "pool-hub-podgroups")]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pool-hub-podgroups"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "hub", "namespace": NAMESPACE}]
    nodes = rendered[("ClusterRole", "", "jhub-pool-hub-nodes")]
    assert nodes["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]}]
    assert rendered[("ClusterRoleBinding", "", "jhub-pool-hub-nodes")]["subjects"] == binding["subjects"]
    # Without the node check nothing cluster-wide is granted.
    without = render(merge(values_for(EXAMPLES_DIR), {"hubAccess": {"listNodes": False}}))
    assert not [o for o in without if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]


def test_the_hub_without_the_ledger_password_is_refused_with_the_snippet_to_add():
    values = values_for(EXAMPLES_DIR)
    del values["jupyterhub"]["hub"]["extraEnv"]["PGPASSWORD"]
    with pytest.raises(Exception, match=r"jupyterhub.hub.extraEnv.PGPASSWORD: the hub records usage") as refused:
        render(values)
    assert "secretKeyRef: {name: gpupool-postgres, key: password}" in str(refused.value)


def test_mlflow_runs_the_gpupool_app_as_the_hub_service_the_wiring_names():
    values = merge(values_for(EXAMPLES_DIR), {"mlflow": {"enabled": True, "artifacts": {
        "destination": "s3://mlflow/", "existingSecret": "s3-keys"}}})
    rendered = {key(o): o for o in render(values)}
    hub = values["jupyterhub"]["hub"]
    service = rendered[("Service", NAMESPACE, "pool-mlflow")]
    assert hub["services"]["mlflow"]["url"] == f"http://pool-mlflow:{service['spec']['ports'][0]['port']}"
    assert hub["config"]["GPUKubeSpawner"]["mlflow_url"] == "http://proxy-public/services/mlflow/"
    pod = rendered[("Deployment", NAMESPACE, "pool-mlflow")]["spec"]["template"]
    assert pod["metadata"]["labels"]["hub.jupyter.org/network-access-hub"] == "true"  # it checks hub tokens
    container = pod["spec"]["containers"][0]
    assert container["command"][:3] == ["mlflow", "server", "--app-name=gpupool"]
    assert "--static-prefix=/services/mlflow" in container["command"]
    assert "--serve-artifacts" in container["command"] and "--artifacts-destination=s3://mlflow/" in container["command"]
    assert ("--backend-store-uri=postgresql+psycopg://gpupool@postgres.db.svc:5432/mlflow?sslmode=prefer"
            in container["command"])
    env = {e["name"]: e for e in container["env"]}
    assert env["JUPYTERHUB_API_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hub", "key": "hub.services.mlflow.apiToken"}
    assert env["JUPYTERHUB_SERVICE_PREFIX"]["value"] == "/services/mlflow/"
    assert env["GPUPOOL_POLICIES"]["value"] == hub["extraEnv"]["GPUPOOL_POLICIES"]
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "s3-keys"
    assert container["readinessProbe"]["httpGet"]["path"] == "/services/mlflow/health"
    # Without an artifact store there is nothing to serve the teams' artifacts from: a named error.
    with pytest.raises(Exception, match="mlflow.artifacts.destination"):
        render(merge(values_for(EXAMPLES_DIR), {"mlflow": {"enabled": True}}))


HAMI_MONITORS = ["http://10.0.0.7:9394/metrics", "http://10.0.0.8:9394/metrics"]
#: A Prometheus federation URL: brackets, braces, quotes and `=~` reach the culler as written.
FEDERATION = 'http://prometheus-server.monitoring/federate?match[]={__name__=~"Device_.*_of_container"}'


def culler_container(rendered: dict) -> dict[str, Any]:
    (container,) = rendered[("Deployment", NAMESPACE, "pool-culler")]["spec"]["template"]["spec"]["containers"]
    return container


def culler_as_configured(container: dict[str, Any], monkeypatch) -> IdleCuller:
    """The real IdleCuller with the pod's environment and arguments (parsed, not started: no ledger, no hub)."""
    for variable in container["env"]:
        if "value" in variable:
            monkeypatch.setenv(variable["name"], variable["value"])
    culler = IdleCuller()
    culler.parse_command_line(container["args"])
    return culler


def test_the_culler_runs_as_the_hub_service_the_wiring_names_with_hamis_metrics(monkeypatch):
    values = merge(values_for(EXAMPLES_DIR), {"culler": {"metricsUrls": [*HAMI_MONITORS, FEDERATION],
                                                         "interval": 30}})
    rendered = {key(o): o for o in render(values)}
    hub = values["jupyterhub"]["hub"]
    service = rendered[("Service", NAMESPACE, "pool-culler")]
    assert hub["services"]["culler"] == {"url": f"http://pool-culler:{service['spec']['ports'][0]['port']}",
                                         "oauth_no_confirm": True, "display": True}
    assert service["spec"]["selector"] == rendered[("Deployment", NAMESPACE, "pool-culler")]["spec"]["selector"][
        "matchLabels"]
    # Its role: exactly the culler's scopes, for the culler only; every user may open its page and API.
    assert hub["loadRoles"][CULLER_ROLE] == {"description": hub["loadRoles"][CULLER_ROLE]["description"],
                                             "scopes": list(CULLER_SCOPES), "services": ["culler"]}
    assert "access:services!service=culler" in hub["loadRoles"]["user"]["scopes"]
    container = culler_container(rendered)
    assert container["command"] == ["python", "-m", "gpupool.hub.culler"]
    env = {e["name"]: e for e in container["env"]}
    assert env["JUPYTERHUB_API_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hub",
                                                                       "key": "hub.services.culler.apiToken"}
    assert env["PGPASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "gpupool-postgres", "key": "password"}
    # What the culler makes of the pod's environment and arguments: the Kubernetes mode's GPU signal and no CPU.
    culler = culler_as_configured(container, monkeypatch)
    assert culler.gpu_source == "hami" and culler.metrics_urls == [*HAMI_MONITORS, FEDERATION]
    assert culler.namespace == NAMESPACE and culler.cpu is False and culler.interval == 30
    assert culler.port == container["ports"][0]["containerPort"] and service["spec"]["ports"][0]["targetPort"] == "http"
    assert culler.prefix == "/services/culler/"
    assert culler.hub_api_url == "http://hub:8081/hub/api"
    assert culler.policy_dir == hub["extraEnv"]["GPUPOOL_POLICIES"]
    assert culler.ledger_url == "postgresql+psycopg://gpupool@postgres.db.svc:5432/gpupool?sslmode=prefer"
    # The accounting service's confinement: no Kubernetes token, read-only root, policies mounted.
    accounting = rendered[("Deployment", NAMESPACE, "pool-accounting")]["spec"]["template"]["spec"]
    pod = rendered[("Deployment", NAMESPACE, "pool-culler")]["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    # Never two cullers at once, not even during an upgrade (each would count the same idle time).
    assert rendered[("Deployment", NAMESPACE, "pool-culler")]["spec"]["strategy"] == {"type": "Recreate"}
    assert "strategy" not in rendered[("Deployment", NAMESPACE, "pool-accounting")]["spec"]
    assert pod["securityContext"] == accounting["securityContext"]
    assert container["securityContext"] == accounting["containers"][0]["securityContext"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["volumes"] == accounting["volumes"]
    assert container["volumeMounts"] == accounting["containers"][0]["volumeMounts"]


def test_the_culler_reads_dcgm_exporters_metrics_where_pods_have_their_own_devices(monkeypatch):
    exporters = ["http://10.0.0.7:9400/metrics", "http://10.0.0.8:9400/metrics"]
    values = merge(values_for(EXAMPLES_DIR), {"culler": {"gpuSource": "dcgm", "metricsUrls": exporters}})
    culler = culler_as_configured(culler_container({key(o): o for o in render(values)}), monkeypatch)
    assert culler.gpu_source == "dcgm" and culler.metrics_urls == exporters and culler.cpu is False


def test_the_culler_without_hami_urls_runs_without_a_gpu_signal_and_takes_its_own_settings(monkeypatch):
    rendered = {key(o): o for o in render(values_for(EXAMPLES_DIR))}
    culler = culler_as_configured(culler_container(rendered), monkeypatch)
    assert culler.gpu_source == "hami" and culler.metrics_urls == [] and culler.interval == 60
    # The install's notes say so, and where to point it.
    for urls, said in (([], True), (HAMI_MONITORS, False)):
        with helm.Chart.load(CHART) as chart:
            notes = chart.render(merge(values_for(EXAMPLES_DIR), {"culler": {"metricsUrls": urls}}), name=RELEASE,
                                 namespace=NAMESPACE, is_install=True)["gpupool/templates/NOTES.txt"]
        assert ("The idle culler has no GPU signal yet" in notes) is said
    values = merge(values_for(EXAMPLES_DIR), {"culler": {
        "gpuSource": "none", "metricsUrls": HAMI_MONITORS, "namespace": "users",
        "extraArgs": ["--IdleCuller.concurrency=16"], "extraEnv": {"GPUPOOL_NAV_SERVICES": "accounting,culler"}}})
    container = culler_container({key(o): o for o in render(values)})
    assert not [a for a in container["args"] if "metrics_urls" in a]
    culler = culler_as_configured(container, monkeypatch)
    assert (culler.gpu_source, culler.namespace, culler.concurrency) == ("none", "users", 16)
    assert {"name": "GPUPOOL_NAV_SERVICES", "value": "accounting,culler"} in container["env"]


def test_a_disabled_culler_renders_nothing_of_it_and_is_not_registered_in_the_hub():
    enabled = {key(o): o for o in render(values_for(EXAMPLES_DIR))}
    values = values_without_culler(EXAMPLES_DIR)
    rendered = {key(o): o for o in render(values)}
    assert not [k for k in rendered if k[2] == "pool-culler"]
    assert rendered == {k: o for k, o in enabled.items() if k[2] != "pool-culler"}
    hub = values["jupyterhub"]["hub"]
    assert "culler" not in hub["services"] and CULLER_ROLE not in hub["loadRoles"]
    assert not [s for s in hub["loadRoles"]["user"]["scopes"] if "culler" in s]
    # Nothing else of the wiring changes: the accounting service keeps its role.
    assert hub["loadRoles"]["gpupool-accounting"]["scopes"] == list(ACCOUNTING_SCOPES)


def test_the_chart_refuses_a_culler_the_hub_values_disagree_about():
    # Disabled, but the hub would list a service nobody runs and give it a role: render without it.
    with pytest.raises(helm.HelmRenderError, match=r"culler.enabled is false, .*--no-culler"):
        render(merge(values_for(EXAMPLES_DIR), {"culler": {"enabled": False}}))
    # Enabled, but the hub makes it no token (values from a gpupool without the culler): its pod could not start.
    with pytest.raises(helm.HelmRenderError, match=r"culler.enabled: the values do not register the culler"):
        render(merge(values_without_culler(EXAMPLES_DIR), {"culler": {"enabled": True}}))


def test_chart_defaults_are_the_python_constants_and_version():
    with helm.Chart.load(CHART) as chart:
        defaults, metadata = chart.values, chart.metadata
    assert defaults["gpupool"]["accountingService"] == volcano.ACCOUNTING_SERVICE
    assert defaults["gpupool"]["accountingPort"] == volcano.ACCOUNTING_PORT
    assert defaults["gpupool"]["cullerService"] == volcano.CULLER_SERVICE
    assert defaults["gpupool"]["cullerPort"] == volcano.CULLER_PORT
    assert defaults["culler"]["enabled"] is True and "publicUrl" not in defaults["culler"]
    assert defaults["gpupool"]["policyDir"] == volcano.POLICY_DIR
    assert metadata["appVersion"] == __version__
    assert metadata["apiVersion"] == "v2"
    (dependency,) = metadata["dependencies"]
    assert dependency == {"name": "jupyterhub", "version": dependency["version"],
                          "repository": "https://hub.jupyter.org/helm-chart/", "condition": "jupyterhub.enabled"}


@pytest.mark.skipif(not Z2JH_ARCHIVES, reason=Z2JH_MISSING)
def test_chart_with_zero_to_jupyterhub_renders_valid_objects_and_our_hub_config(crds):
    values = values_for(EXAMPLES_DIR, jupyterhub=True)
    rendered = render(values)
    for obj in rendered:
        checks.validate(obj, crds)
    # z2jh hands the hub its values through the `hub` Secret, with a generated token for each service.
    secret = next(o for o in rendered if o["kind"] == "Secret" and o["metadata"]["name"] == "hub")
    hub_values = yaml.safe_load(base64.b64decode(secret["data"]["values.yaml"]))
    assert hub_values["hub"]["config"]["JupyterHub"]["spawner_class"] == volcano.SPAWNER_CLASS
    assert "hub.services.accounting.apiToken" in secret["data"]
    assert "hub.services.culler.apiToken" in secret["data"]
    assert hub_values["hub"]["loadRoles"][CULLER_ROLE]["scopes"] == list(CULLER_SCOPES)
    assert hub_values["scheduling"]["userScheduler"]["enabled"] is False


# --- what the chart refuses, with the way out --------------------------------------------------------------


def test_a_misspelled_section_or_key_is_an_error_that_names_it():
    values = values_for(DEFAULT_POLICY_DIR)
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values)
        with pytest.raises(helm.HelmValuesError, match="additional properties 'mlfow' not allowed"):
            chart.validate_schema(merge(values, {"mlfow": {"enabled": True}}))
        with pytest.raises(helm.HelmValuesError, match=r"at '/accounting': additional properties 'imgae'"):
            chart.validate_schema(merge(values, {"accounting": {"imgae": {"name": "x"}}}))
        with pytest.raises(helm.HelmValuesError, match="/postgresql/sslmode"):
            chart.validate_schema(merge(values, {"postgresql": {"sslmode": "sometimes"}}))
        with pytest.raises(helm.HelmValuesError, match=r"at '/culler': additional properties 'hamiMetricUrls'"):
            chart.validate_schema(merge(values, {"culler": {"hamiMetricUrls": ["http://n:9394/metrics"]}}))
        # NVML is the embedded mode's: a pod of the cluster sees no other pod's processes.
        with pytest.raises(helm.HelmValuesError, match="/culler/gpuSource"):
            chart.validate_schema(merge(values, {"culler": {"gpuSource": "nvml"}}))
        with pytest.raises(helm.HelmValuesError, match="/culler/metricsUrls/0"):
            chart.validate_schema(merge(values, {"culler": {"metricsUrls": ["node-1:9394"]}}))
        with pytest.raises(helm.HelmValuesError, match="/culler/interval"):
            chart.validate_schema(merge(values, {"culler": {"interval": 0}}))
        # Rendering applies the same schema, so a typo never installs.
        with pytest.raises(helm.HelmValuesError, match="mlfow"):
            chart.render(merge(values, {"mlfow": {"enabled": True}}), name=RELEASE, namespace=NAMESPACE)


def test_lint_finds_nothing_but_the_dependency_this_network_cannot_fetch():
    report = helm.lint(CHART, values_for(EXAMPLES_DIR), strict=True, namespace=NAMESPACE, kube_version="v1.35.0")
    problems = [m["error"] for m in report["messages"] if m["severity"] >= 2]
    expected = [] if Z2JH_ARCHIVES else ["chart directory is missing these dependencies: jupyterhub"]
    assert problems == expected
    # Lint is not blind: a misspelled section is one of its errors.
    report = helm.lint(CHART, merge(values_for(EXAMPLES_DIR), {"ingres": {}}), namespace=NAMESPACE)
    assert any("'ingres' not allowed" in m["error"] for m in report["messages"] if m["severity"] == 3)


def test_policy_files_edited_in_values_without_rendering_again_are_refused():
    values = values_for(DEFAULT_POLICY_DIR)
    values["gpupool"]["policies"]["teams.yaml"] += "\n  physics: {priority: 1000}\n"
    with pytest.raises(helm.HelmRenderError, match=r"gpupool.policies differ .*run `gpupool render --helm-values`"):
        render(values)


def test_values_rendered_for_another_release_are_refused():
    with pytest.raises(helm.HelmRenderError, match=r'rendered for release "pool", this release is "other"'):
        render(values_for(DEFAULT_POLICY_DIR), name="other")


def test_the_chart_without_generated_values_says_how_to_make_them():
    with pytest.raises(helm.HelmRenderError, match=r"gpupool.policies is empty: .*gpupool render"):
        render(merge(OPERATOR_VALUES, {"jupyterhub": {"enabled": False}}))


def test_postgresql_needs_a_host_and_a_password_secret():
    values = values_for(DEFAULT_POLICY_DIR)
    with pytest.raises(helm.HelmRenderError, match="postgresql.existingSecret: name the Secret"):
        render(merge(values, {"postgresql": {"existingSecret": ""}}))
    with pytest.raises(helm.HelmRenderError, match="postgresql.host"):
        render(merge(values, {"postgresql": {"host": ""}}))


# --- Volcano's scheduler configuration -------------------------------------------------------------------


def _versions() -> dict[str, str]:
    text = (ROOT / "kube" / "versions.env").read_text()
    return dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))


def volcano_chart(into: Path) -> Path:
    """Volcano's own chart (and its jobflow sub-chart), from its release archive in ../shared/upstream."""
    archive = ROOT.parent / "shared" / "upstream" / _versions()["VOLCANO_ARCHIVE"]
    if not archive.is_file():
        pytest.skip(f"Volcano's release archive is not in {archive.parent} (kube/versions.env names it)")
    top = archive.name.removesuffix(".tar.gz") + "/installer/helm/chart/volcano/"
    with tarfile.open(archive) as tar:
        tar.extractall(into, members=[m for m in tar.getmembers() if m.name.startswith(top)], filter="data")
    return into / top


def volcano_objects(chart: Path, values: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    with helm.Chart.load(chart) as loaded:
        manifests = loaded.render(values, name="volcano", namespace="volcano-system", is_install=True)
    return {(o["kind"], o["metadata"]["name"]): o for o in objects(manifests)}


def actions(conf: dict[str, Any]) -> list[str]:
    return [action.strip() for action in conf["actions"].split(",")]


def test_volcanos_own_chart_given_the_shipped_file_runs_its_scheduler_with_it(tmp_path):
    """What docs/kubernetes.md tells an admin to run (`--set-file custom.scheduler_config_override=...`)
    puts exactly the shipped configuration where Volcano's scheduler reads it; without it, Volcano's chart
    ships actions that never evict anyone (issue 35)."""
    chart = volcano_chart(tmp_path)
    shipped = SCHEDULER_CONF.read_text()
    rendered = volcano_objects(chart, {"custom": {"scheduler_config_override": shipped}})
    data = rendered["ConfigMap", "volcano-scheduler-configmap"]["data"]
    assert yaml.safe_load(data["volcano-scheduler.conf"]) == yaml.safe_load(shipped)
    pod = rendered["Deployment", "volcano-scheduler"]["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "volcano-scheduler"]
    assert "--scheduler-conf=/volcano.scheduler/volcano-scheduler.conf" in container["args"]
    mounted = {m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/volcano.scheduler"}
    assert [v["configMap"]["name"] for v in pod["volumes"] if v["name"] in mounted] == ["volcano-scheduler-configmap"]

    default = volcano_objects(chart, {})["ConfigMap", "volcano-scheduler-configmap"]["data"]
    assert {"preempt", "reclaim"}.isdisjoint(actions(yaml.safe_load(default["volcano-scheduler.conf"])))


def test_the_shipped_scheduler_configuration_preempts_and_reclaims_by_each_queues_own_deserved():
    conf = yaml.safe_load(SCHEDULER_CONF.read_text())
    assert actions(conf) == ["enqueue", "allocate", "preempt", "reclaim", "backfill"]
    tiers = [{p["name"]: p for p in tier["plugins"]} for tier in conf["tiers"]]
    plugins = {name: p for tier in tiers for name, p in tier.items()}
    # capacity reads each queue's own deserved (proportion would derive it from weights over the cluster,
    # and then never let one team reclaim another's over-budget work); hierarchy for queue.parent
    assert plugins["capacity"].get("enableHierarchy") is True
    assert "proportion" not in plugins
    # preempt inside a queue goes by the PodGroup's priority (a deprioritized pod's class is the lowest)
    assert "priority" in tiers[0]
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    assert f"--set-file {VOLCANO_CHART_FLAG}=helm/gpupool/files/volcano-scheduler.conf" in docs
