"""The output of the training jobs' pods, kept in the jobs table while they run (`PodLogs`), read through the
Kubernetes API server; with the reading of an API answer the Volcano adapter shares (`read_answer`).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import time
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

from gpupool.hub.accounting.jobs import JobStore
from gpupool.policies import periods
from gpupool.policies.restarts import Ended, Event
from gpupool.spawner.jobs.runner import cancel_tasks
from gpupool.spawner.jobs.volcano_objects import TASK, running_since

#: A pod's output is kept in pieces of at most this many bytes, written at least every `LOG_FLUSH_S` seconds.
LOG_PIECE = 64 * 1024
LOG_FLUSH_S = 1.0
#: Reads of an ended pod's log that may fail (its node gone, say) before its output is given up.
LOG_TRIES = 3
#: Seconds a pod's log waits for the job's previous pod's to be all kept, so that runs follow one another.
LOG_ORDER_WAIT_S = 30.0
#: Seconds a run's end (or a stopping hub) waits for the logs of pods that ended to be kept to their end.
STOP_WAIT_S = 5.0
#: Connections the pods' logs may hold at once (one per followed pod), apart from the spawner's client's pool.
LOG_CONNECTIONS = 1000


class PodLogs:
    """Keeps the jobs' pods' output in the jobs table (`JobStore.keep_log`): each pod's container log is read
    through the API server (`GET …/pods/NAME/log?follow=true`, the kubelet's file) from when it runs until it has
    ended, so a job's log holds every run's output after Volcano deleted the pods (a restart deletes them) and
    after the pod's node is gone. A line before each pod's output says which pod and node it is, one after it how
    it ended.

    Each pod's bytes are counted by its uid (`JobStore.log_progress`): a read that starts again (a dropped
    connection, a restarted hub) skips what is kept. Before it, a probe reads one byte more than is kept: fewer
    means the kubelet rotated the file, and from then on the pod's log is read from shortly before the last piece
    was kept (`sinceTime`), counted anew (a few lines may repeat; a line says so). Volcano names a restarted pod
    as the last one: every read first checks that the name is still this pod (its uid)."""

    def __init__(self, store: JobStore, core, namespace: str, log):
        self.store, self.core, self.namespace, self.log = store, core, namespace, log
        self.tasks: dict[str, tuple[str, asyncio.Task]] = {}  # pod uid → (job id, what keeps its log)
        self.over: dict[str, Ended] = {}  # pod uid → how it ended, once it has
        self._api = None  # its own client: one connection per followed pod, apart from the spawner's pool

    def see(self, job_id: str, pod: Mapping[str, Any], ended: Ended | None) -> None:
        """What the watch (or a look) saw of a pod: its log is kept once its container runs."""
        uid = (pod.get("metadata") or {}).get("uid")
        if not uid:
            return
        if ended is not None:
            self.over.setdefault(uid, ended)
        if uid not in self.tasks and running_since(pod):
            earlier = [task for job, task in self.tasks.values() if job == job_id and not task.done()]
            task = asyncio.get_running_loop().create_task(self._keep(job_id, pod, uid, earlier))
            self.tasks[uid] = (job_id, task)

    def forget(self, live: Mapping[str, Any]) -> None:
        """The pods of jobs that ended, whose logs are all kept; the ends of pods that never ran."""
        for uid, (job_id, task) in list(self.tasks.items()):
            if job_id not in live and task.done():
                del self.tasks[uid]
        for uid in [uid for uid in self.over if uid not in self.tasks]:
            del self.over[uid]

    async def settle(self, job_id: str | None = None) -> None:
        """Wait (at most `STOP_WAIT_S`) until the logs of the pods that ended (of one job, or all) are kept to
        their end."""
        ending = [task for uid, (job, task) in self.tasks.items()
                  if job_id in (None, job) and uid in self.over and not task.done()]
        if ending:
            await asyncio.wait(ending, timeout=STOP_WAIT_S)

    async def stop(self) -> None:
        """The hub goes down: the logs of pods that ended get a moment to be kept to their end; the others are
        read again by the next hub."""
        await self.settle()
        await cancel_tasks([task for _, task in self.tasks.values()])
        if self._api is not None:
            await self._api.api_client.close()
            self._api = None

    @property
    def api(self):
        if self._api is None:
            from kubernetes_asyncio import client

            configuration = copy.copy(self.core.api_client.configuration)
            configuration.connection_pool_maxsize = LOG_CONNECTIONS
            self._api = client.CoreV1Api(client.ApiClient(configuration))
        return self._api

    async def _keep(self, job_id: str, pod: Mapping[str, Any], uid: str, earlier: list[asyncio.Task]) -> None:
        from kubernetes_asyncio.client import ApiException

        if earlier:  # the last run's output and its end line come first (unless its pod hangs on a lost node)
            await asyncio.wait(earlier, timeout=LOG_ORDER_WAIT_S)
        name = pod["metadata"]["name"]
        node = (pod.get("spec") or {}).get("nodeName") or "?"
        await self._note(job_id, f"gpupool:{uid}", f"--- gpupool: pod {name} on node {node}, started at "
                                                    f"{running_since(pod)} ---\n")
        progress = await asyncio.to_thread(self.store.log_progress, job_id, uid)
        read = _Read(uid, name, progress.source if progress else uid, progress.size if progress else 0,
                     _since_of(progress.source) if progress else None, progress.at if progress else None)
        failures = 0
        while True:
            over = uid in self.over  # then one read to its end; else followed until the stream ends
            try:
                if not await self._still(read):
                    break  # the pod is gone (or its name is a new pod's): all it had is kept
                if read.size:
                    await self._probe(job_id, read)
                await self._read(job_id, read, follow=not over)
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as error:  # noqa: BLE001 - an API refusal, a dropped connection: read again
                failures += 1
                self.log.debug("gpupool job %s: reading the log of pod %s: %s", job_id, name, error)
                if over and failures >= LOG_TRIES:
                    self.log.warning("gpupool job %s: the log of pod %s cannot be read (%s); its output is kept "
                                     "up to there", job_id, name, getattr(error, "reason", None) or error)
                    break
                await asyncio.sleep(1)
                continue
            if over:
                break
            await asyncio.sleep(LOG_FLUSH_S)  # the stream ended before its end was seen: read on from what is kept
        ended = self.over.get(uid)
        if ended is not None:
            await self._note(job_id, f"gpupool-end:{uid}", f"--- gpupool: pod {name} {_how(ended)} ---\n")

    async def _note(self, job_id: str, source: str, line: str) -> None:
        """gpupool's own line in the job's log, once (a restarted hub does not write it again)."""
        if not await asyncio.to_thread(self.store.log_kept, job_id, source):
            await asyncio.to_thread(self.store.keep_log, job_id, source, line.encode(), periods.utcnow())

    async def _still(self, read: _Read) -> bool:
        """Whether the pod's name is still this pod (Volcano's next pod of the job takes the same name)."""
        from kubernetes_asyncio.client import ApiException

        try:
            pod = await read_answer(await self.api.read_namespaced_pod(read.name, self.namespace,
                                                                  _preload_content=False))
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        return pod["metadata"]["uid"] == read.uid

    async def _probe(self, job_id: str, read: _Read) -> None:
        """One byte more than is kept: fewer means the kubelet rotated the file since; then count anew from
        shortly before the last piece was kept."""
        reply = await self._ask(read, follow=False, limit_bytes=read.size + 1)
        try:
            size = len(await reply.read())
        finally:
            reply.close()
        if size >= read.size:
            return
        since = (read.at or periods.utcnow()) - timedelta(seconds=2)
        read.source, read.size, read.since = f"{read.uid}@{int(since.timestamp())}", 0, since
        await self._note(job_id, f"gpupool-rotated:{read.source}",
                         f"--- gpupool: the kubelet rotated the log of pod {read.name}; what follows starts at "
                         f"{since:%H:%M:%S} UTC and may repeat a few lines ---\n")

    async def _ask(self, read: _Read, follow: bool, **params):
        """The log request, answered (a followed log's answer may start only with its first byte: while waiting,
        a pod that ended stops the wait, and None is returned)."""
        from kubernetes_asyncio.client import ApiException

        asked = asyncio.ensure_future(self._log_request(read, follow, params))
        try:
            while not (await asyncio.wait({asked}, timeout=LOG_FLUSH_S))[0]:
                if follow and read.uid in self.over:  # then read to its end without following
                    asked.cancel()
                    return None
        except asyncio.CancelledError:
            asked.cancel()
            if asked.done() and not asked.cancelled() and asked.exception() is None:
                asked.result().close()
            raise
        reply = asked.result()
        if not 200 <= reply.status <= 299:  # with `_preload_content=False` the client does not check it
            try:
                said = (await reply.read())[:500].decode("utf-8", "replace")
            finally:
                reply.close()
            raise ApiException(status=reply.status, reason=said)
        return reply

    def _log_request(self, read: _Read, follow: bool, params: dict):
        """`GET …/pods/NAME/log`, unread: as `CoreV1Api.read_namespaced_pod_log` asks it, with `sinceTime` too
        (an absolute time: a fixed start to count bytes from; the generated client offers only `sinceSeconds`)."""
        query = [("container", TASK), ("follow", follow)] + [(_camel(k), v) for k, v in params.items()]
        if read.since is not None:
            query.append(("sinceTime", read.since.strftime("%Y-%m-%dT%H:%M:%SZ")))
        client = self.api.api_client
        return client.call_api("/api/v1/namespaces/{namespace}/pods/{name}/log", "GET",
                               {"name": read.name, "namespace": self.namespace}, query,
                               {"Accept": "text/plain, application/json"}, auth_settings=["BearerToken"],
                               response_types_map={200: "str"}, _preload_content=False)

    async def _read(self, job_id: str, read: _Read, follow: bool) -> None:
        """Read the pod's log from its start (or `read.since`) and keep what is past what is kept (`read.size`,
        moved on as each piece is kept). Following, it stops when the stream ends (a kubelet ends it when the
        container exits) or when the pod is seen to have ended and the log is quiet."""
        reply = await self._ask(read, follow)
        if reply is None:
            return
        seen, piece, written = 0, bytearray(), time.monotonic()
        try:
            while True:
                try:
                    async with asyncio.timeout(LOG_FLUSH_S):
                        data = await reply.content.readany()
                except TimeoutError:
                    data = None  # quiet for a while
                if data:
                    piece += data[max(0, read.size + len(piece) - seen):]  # the bytes past what is kept
                    seen += len(data)
                if piece and (not data or len(piece) >= LOG_PIECE or time.monotonic() - written >= LOG_FLUSH_S):
                    at = periods.utcnow()
                    await asyncio.to_thread(self.store.keep_log, job_id, read.source, bytes(piece), at)
                    read.size, read.at = read.size + len(piece), at
                    piece.clear()
                    written = time.monotonic()
                if data == b"" or (data is None and read.uid in self.over):
                    return
        finally:
            reply.close()


@dataclasses.dataclass
class _Read:
    """Where the reading of one pod's log stands: its pieces' source, the bytes of it kept (counted from the
    container's start, or from `since` after a rotation), and when the last was kept."""

    uid: str
    name: str
    source: str
    size: int
    since: datetime | None
    at: datetime | None


async def read_answer(reply) -> Any:
    """The JSON body of an answer asked with `_preload_content=False`, which the client hands back unchecked: an
    error answer (a deleted pod's 404 is a `Status` object, with no `metadata.uid`) raises `ApiException` with
    its status, as the client does otherwise. The answer is closed either way."""
    from kubernetes_asyncio.client import ApiException

    try:
        body = await reply.read()
    finally:
        reply.close()
    if not 200 <= reply.status <= 299:
        raise ApiException(status=reply.status, reason=body[:500].decode("utf-8", "replace"))
    return json.loads(body)


def _camel(name: str) -> str:
    first, *rest = name.split("_")
    return first + "".join(word.title() for word in rest)


def _since_of(source: str) -> datetime | None:
    """The time a pod's log is counted from, after a rotation (`UID@SECONDS`)."""
    _, _, seconds = source.partition("@")
    return datetime.fromtimestamp(int(seconds), tz=timezone.utc) if seconds else None


def _how(ended: Ended) -> str:
    """How a pod ended, for its log: by itself (with its exit code), or stopped (a preemption, a drain, a lost
    node, a deletion), as the restart rules count it."""
    if ended.event in (Event.SUCCEEDED, Event.FAILED):
        return f"ended ({ended.event.value}, exit code {ended.exit_code})"
    return f"stopped ({ended.event.value})"
