"""A test double of the Kubernetes API server for the spawner tests: kmock's in-memory emulator, served over
real HTTP, with what kubernetes_asyncio and KubeSpawner need of a real API server (see `KubernetesAPIDouble`),
and `Cluster`, the tests' hand as Volcano and the kubelet (PodGroups, events, pod status written into it
through the same client library).

A double, named as one: the Kubernetes mode is also tested against the real control plane where it can run.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import uuid
from datetime import UTC, datetime

import kmock
from gpupool.spawner import podgroups
from kubernetes_asyncio.client import ApiClient, Configuration, CoreV1Api, CustomObjectsApi
from kubespawner import KubeSpawner
from kubespawner.clients import load_config

NAMESPACE = "gpupool-test"
PODGROUPS = (podgroups.GROUP, podgroups.VERSION)


# --- the Kubernetes API double -----------------------------------------------------------------------------


class _RecordingBus(kmock.Bus):
    """kmock's change bus for one resource, also keeping what it carried, numbered, for watches to replay."""

    def __init__(self, double: KubernetesAPIDouble):
        super().__init__()
        self.double = double
        self.log: list[tuple[int, dict]] = []

    async def put(self, *items):
        for item in items:  # the emulator publishes under its lock: the numbers follow the writes
            self.double.version += 1
            self.log.append((self.double.version, item))
        await super().put(*items)


class KubernetesAPIDouble(kmock.KubernetesEmulator):
    """A test double of the Kubernetes API server: kmock's in-memory emulator, served over real HTTP.

    Adapted where kubernetes_asyncio and KubeSpawner need what a real API server does and kmock does not:

    - watches: kubernetes_asyncio sends `watch=True`, kmock only understands `watch=true`;
    - CREATE answers 201 Created (kmock answers 200);
    - objects get what the API server fills in: `uid`, `creationTimestamp` (unless the test sets it, to
      order a queue), `namespace`, a `resourceVersion` on every write (KubeSpawner's reflectors read it from
      every watch event), and `status.phase: Pending` for a new pod;
    - list and watch agree, as KubeSpawner's reflectors need (they list, then watch from the list's
      resourceVersion): a list answers the number of changes so far, a watch from that number replays the
      changes after it, and a watch without one replays every object as ADDED. kmock alone loses a change
      made between the two (a pod deleted right after the list stays in the reflector for good).

    Not emulated, and not relied on: label and field selectors (every watcher sees every object of its
    kind and namespace; the spawner filters by name and uid).
    """

    version = 0
    _writes = itertools.count(1)

    def __attrs_post_init__(self):
        self._buses = collections.defaultdict(lambda: _RecordingBus(self))
        super().__attrs_post_init__()

    async def __call__(self, raw_request):
        watch = raw_request.query.get("watch")
        if watch is not None and watch != "true" and watch.lower() == "true":
            raw_request = raw_request.clone(rel_url=raw_request.rel_url.update_query(watch="true"))
        return await super().__call__(raw_request)

    async def _handle(self, request):
        if request.resource is not None and isinstance(request.data, dict):
            metadata = request.data.setdefault("metadata", {})
            if request.action == kmock.action.CREATE:
                if request.namespace:
                    metadata.setdefault("namespace", request.namespace)
                metadata.setdefault("uid", str(uuid.uuid4()))
                metadata.setdefault("creationTimestamp", rfc3339(datetime.now(UTC)))
                if request.resource.plural == "pods":
                    request.data.setdefault("status", {}).setdefault("phase", "Pending")
            if request.action in (kmock.action.CREATE, kmock.action.UPDATE):
                metadata["resourceVersion"] = str(next(self._writes))
        return await super()._handle(request)

    async def _serve_create(self, request):
        return kmock.Response(status=201, payload=await super()._serve_create(request))

    def _selected(self, request, resource, namespace, name) -> bool:
        return (resource == request.resource and (request.namespace is None or namespace == request.namespace)
                and (request.name is None or name == request.name))

    def _current(self, request) -> list[dict]:
        return [obj.raw for (resource, namespace, name), obj in self._objects.items()
                if not obj.deleted and self._selected(request, resource, namespace, name)]

    async def _serve_list(self, request):
        if request.resource not in self._get_resources():
            raise kmock.KubernetesResourceNotFoundError()
        async with self._lock:
            return {"metadata": {"resourceVersion": str(self.version)}, "items": self._current(request)}

    async def _serve_watch(self, request):
        yield b""  # send the headers: the client waits for them before it reads events
        bus = self._buses[request.resource]
        since = request.params.get("resourceVersion", "")
        async with self._lock:  # writes publish under this lock: nothing slips between mark and replay
            mark = await bus.mark()
            if since.isdigit() and since != "0":
                replay = [event for version, event in bus.log if version > int(since)]
            else:
                replay = [{"type": "ADDED", "object": raw} for raw in self._current(request)]
        try:
            for event in [*replay]:
                metadata = event.get("object", {}).get("metadata", {})
                if self._selected(request, request.resource, metadata.get("namespace"), metadata.get("name")):
                    yield event
            async for event in bus.stream(since=mark):
                metadata = event.get("object", {}).get("metadata", {})
                if self._selected(request, request.resource, metadata.get("namespace"), metadata.get("name")):
                    yield event
        finally:
            await bus.unmark(mark)


async def forget_kube_clients() -> None:
    """What KubeSpawner keeps for the life of a hub process, forgotten between tests that each serve an API at a
    port of their own: its class-level reflectors (bound to one event loop) and the client configuration.
    `load_config` is cached per host and sets the process-wide default only on a miss, so a test whose port an
    earlier test had used would otherwise be sent to the port of the test just before it."""
    await KubeSpawner._stop_all_reflectors()
    load_config.cache_clear()
    Configuration.set_default(None)


def rfc3339(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")  # whole seconds, as the API server writes them


class Cluster:
    """The double's URL and a client for playing Volcano and the kubelet against it."""

    def __init__(self, api: KubernetesAPIDouble, url: str, client: ApiClient):
        self.api, self.url = api, url
        self.core, self.custom = CoreV1Api(client), CustomObjectsApi(client)

    def requests(self) -> list:
        return list(self.api)  # kmock's handler iterates over the requests it served

    def object(self, plural: str, name: str, group: str = "", version: str = "v1"):
        try:
            obj = self.api.objects[kmock.resource(group, version, plural), NAMESPACE, name]
        except KeyError:
            return None
        return None if obj.deleted else obj.raw

    async def pod_named(self, name: str, timeout: float = 10) -> dict:
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            pod = self.object("pods", name)
            if pod is not None:
                return pod
            await asyncio.sleep(0.02)
        raise AssertionError(f"pod {name} was never created; requests: {[str(r.url) for r in self.requests()]}")

    async def podgroup(self, name: str, queue: str, priority_class: str, created: str, phase: str,
                       conditions: list | None = None) -> None:
        body = {
            "apiVersion": "scheduling.volcano.sh/v1beta1", "kind": "PodGroup",
            "metadata": {"name": name, "namespace": NAMESPACE, "creationTimestamp": created,
                         "uid": str(uuid.uuid4())},
            "spec": {"minMember": 1, "queue": queue, "priorityClassName": priority_class},
            "status": {"phase": phase, "conditions": conditions or []},
        }
        await self.custom.create_namespaced_custom_object(*PODGROUPS, NAMESPACE, "podgroups", body)

    async def set_podgroup_status(self, name: str, status: dict) -> None:
        await self.custom.patch_namespaced_custom_object_status(*PODGROUPS, NAMESPACE, "podgroups", name,
                                                                {"status": status})

    async def event(self, kind: str, name: str, uid: str, reason: str, message: str) -> None:
        now = rfc3339(datetime.now(UTC))
        await self.core.create_namespaced_event(NAMESPACE, {
            "metadata": {"name": f"{name}.{uuid.uuid4().hex[:8]}", "namespace": NAMESPACE},
            "involvedObject": {"kind": kind, "name": name, "namespace": NAMESPACE, "uid": uid},
            "reason": reason, "message": message, "type": "Warning", "source": {"component": "volcano"},
            "firstTimestamp": now, "lastTimestamp": now, "eventTime": None, "count": 1,
        })

    async def run_pod(self, name: str) -> None:
        """The kubelet's part: the pod is on a node, running and ready."""
        await self.core.patch_namespaced_pod(name, NAMESPACE, {"spec": {"nodeName": "gpu-node-1"}})
        await self.core.patch_namespaced_pod_status(name, NAMESPACE, {"status": {
            "phase": "Running", "podIP": "127.0.0.1",
            "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}],
            "containerStatuses": [{"name": "notebook", "ready": True, "restartCount": 0, "image": "x",
                                   "imageID": "", "state": {"running": {"startedAt": rfc3339(datetime.now(UTC))}}}],
        }})
