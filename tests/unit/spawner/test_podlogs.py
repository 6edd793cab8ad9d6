"""spawner/jobs/podlogs.py's reads of the API server that the client hands back unchecked
(`_preload_content=False`), against the API double (tests/kube_double.py) over real HTTP."""

from __future__ import annotations

import kmock
import pytest
import pytest_asyncio
from gpupool.spawner.jobs.podlogs import PodLogs, _Read
from kube_double import NAMESPACE, KubernetesAPIDouble, forget_kube_clients
from kubernetes_asyncio.client import ApiClient, ApiException, Configuration, CoreV1Api

pytestmark = pytest.mark.asyncio


@pytest_asyncio.fixture
async def api():
    async with KubernetesAPIDouble() as double, kmock.Server(double) as server:
        double.resources["v1/pods"] = {}
        async with ApiClient(Configuration(host=str(server.url).rstrip("/"))) as client:
            yield double, CoreV1Api(client)
        await forget_kube_clients()


def _pod(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"containers": [{"name": "task", "image": "busybox"}]}}


def _logs(core: CoreV1Api) -> PodLogs:
    logs = PodLogs(store=None, core=core, namespace=NAMESPACE, log=None)
    logs._api = core  # the same client: the double serves one
    return logs


def _read(uid: str, name: str) -> _Read:
    return _Read(uid, name, uid, 0, None, None)


async def test_a_deleted_pod_is_gone_not_a_key_error(api):
    """A deleted pod's 404 is a Status object, without `metadata.uid`: it read as KeyError('uid'), which the log
    keeper took for a refusal and retried, with a warning, instead of seeing that the pod is gone."""
    _, core = api
    logs = _logs(core)
    created = await core.create_namespaced_pod(NAMESPACE, _pod("job-1-task-0"))
    assert await logs._still(_read(created.metadata.uid, "job-1-task-0"))

    await core.delete_namespaced_pod("job-1-task-0", NAMESPACE)
    assert await logs._still(_read(created.metadata.uid, "job-1-task-0")) is False


async def test_a_name_taken_by_the_next_pod_is_not_this_pod(api):
    _, core = api
    logs = _logs(core)
    first = await core.create_namespaced_pod(NAMESPACE, _pod("job-2-task-0"))
    await core.delete_namespaced_pod("job-2-task-0", NAMESPACE)
    second = await core.create_namespaced_pod(NAMESPACE, _pod("job-2-task-0"))
    assert second.metadata.uid != first.metadata.uid
    assert await logs._still(_read(first.metadata.uid, "job-2-task-0")) is False
    assert await logs._still(_read(second.metadata.uid, "job-2-task-0")) is True


async def test_a_refusal_other_than_not_found_is_raised_with_its_status(api):
    double, core = api
    double["get", "/api/v1/namespaces/" + NAMESPACE + "/pods/job-3-task-0"] << 403 << {
        "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden", "code": 403,
        "message": "pods \"job-3-task-0\" is forbidden"}
    with pytest.raises(ApiException) as raised:
        await _logs(core)._still(_read("some-uid", "job-3-task-0"))
    assert raised.value.status == 403
    assert "forbidden" in raised.value.reason
