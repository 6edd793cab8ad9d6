"""Why a notebook waits in its Volcano queue, in plain words: queue position, scheduler reasons. Pure functions.

Volcano's controller wraps each bare notebook pod in a PodGroup (`podgroup-<pod uid>`) whose `status.phase`
goes Pending → Inqueue → Running. `GPUKubeSpawner` reads the PodGroups, the pod and their events through
reflectors and asks these functions where the pod stands and what to tell the user; nothing here does I/O.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from fractions import Fraction
from typing import Any, Literal

from gpupool.policies.model import parse_quantity
from gpupool.spawner.pool import format_share

GROUP = "scheduling.volcano.sh"
VERSION = "v1beta1"
PLURAL = "podgroups"
#: PodGroup phases of work that waits in its queue (Pending: not enqueued yet; Inqueue: enqueued, not placed).
WAITING_PHASES = ("Pending", "Inqueue")
#: Phases after Volcano placed the group's pods on nodes.
ADMITTED_PHASES = ("Running", "Completed")

Obj = Mapping[str, Any]


def podgroup_name(pod_uid: str) -> str:
    """The PodGroup Volcano's controller creates for a bare pod with this uid."""
    return f"podgroup-{pod_uid}"


def phase(podgroup: Obj | None) -> str | None:
    """The PodGroup's phase; a group the scheduler has not looked at yet has no status: it is Pending."""
    if podgroup is None:
        return None
    return (podgroup.get("status") or {}).get("phase") or "Pending"


def queue_of(podgroup: Obj) -> str:
    # Volcano's CRD defaults the queue to `default`.
    return (podgroup.get("spec") or {}).get("queue") or "default"


_EARLIEST = datetime.min.replace(tzinfo=UTC)


def _timestamp(text: str | None) -> datetime:
    """An RFC 3339 time of the API server; a missing or unreadable one sorts first."""
    try:
        moment = datetime.fromisoformat(text) if text else _EARLIEST
    except ValueError:
        return _EARLIEST
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def volcano_order(podgroups: Iterable[Obj], priorities: Mapping[str, int]) -> list[Obj]:
    """PodGroups in the order Volcano considers them: higher priority first, then older, then by uid.

    `priorities` maps PriorityClass names to their values; a group without a known class counts as 0, the
    value Kubernetes gives pods without a class when no class is the global default.
    """

    def key(podgroup: Obj) -> tuple[int, datetime, str]:
        meta = podgroup.get("metadata") or {}
        name = (podgroup.get("spec") or {}).get("priorityClassName") or ""
        return (-priorities.get(name, 0), _timestamp(meta.get("creationTimestamp")), meta.get("uid") or "")

    return sorted(podgroups, key=key)


def queue_position(podgroups: Iterable[Obj], name: str, queue: str,
                   priorities: Mapping[str, int]) -> tuple[int, int] | None:
    """(position, of) of PodGroup `name` among the waiting PodGroups of `queue`; None when it is not waiting."""
    waiting = [pg for pg in podgroups if queue_of(pg) == queue and phase(pg) in WAITING_PHASES]
    ordered = volcano_order(waiting, priorities)
    for index, podgroup in enumerate(ordered, start=1):
        if (podgroup.get("metadata") or {}).get("name") == name:
            return index, len(ordered)
    return None


def _condition(obj: Obj | None, kind: str) -> Obj | None:
    for condition in ((obj or {}).get("status") or {}).get("conditions") or []:
        if condition.get("type") == kind:
            return condition
    return None


def admitted(pod: Obj | None, podgroup: Obj | None) -> bool:
    """Whether Volcano has given the pod its place: bound to a node, or its group is running.

    From this moment on `start_timeout` counts (image pull, container start); before it the pod waits in
    the queue and only the policy's queue timeout applies.
    """
    if phase(podgroup) in ADMITTED_PHASES:
        return True
    if pod is None:
        return False
    if (pod.get("spec") or {}).get("nodeName"):
        return True
    scheduled = _condition(pod, "PodScheduled")
    if scheduled is not None and scheduled.get("status") == "True":
        return True
    return ((pod.get("status") or {}).get("phase") or "Pending") != "Pending"


def _event_time(event: Obj) -> str:
    return event.get("lastTimestamp") or event.get("eventTime") or event.get("firstTimestamp") or ""


def scheduling_messages(pod: Obj | None, podgroup: Obj | None, events: Iterable[Obj]) -> list[str]:
    """What the scheduler said about this pod and its PodGroup, newest event first, as "Reason: message".

    Sources: the PodGroup's `Unschedulable` condition, the pod's `PodScheduled=False` condition, and events
    whose involved object is the pod or the PodGroup (matched by uid when both sides have one).
    """
    messages: list[str] = []

    def said(reason: str | None, message: str | None) -> None:
        text = ": ".join(part for part in (reason, message) if part)
        if text:
            messages.append(text)

    mine: list[tuple[str, Obj]] = []
    for obj, kind in ((pod, "Pod"), (podgroup, "PodGroup")):
        if obj is not None:
            meta = obj.get("metadata") or {}
            mine.append((kind, meta))
    relevant = []
    for event in events:
        involved = event.get("involvedObject") or {}
        for kind, meta in mine:
            if involved.get("kind") == kind and involved.get("name") == meta.get("name") and (
                not involved.get("uid") or not meta.get("uid") or involved.get("uid") == meta.get("uid")
            ):
                relevant.append(event)
                break
    for event in sorted(relevant, key=_event_time, reverse=True):
        said(event.get("reason"), event.get("message"))
    for obj, kind in ((podgroup, "Unschedulable"), (pod, "PodScheduled")):
        condition = _condition(obj, kind)
        if condition is not None and condition.get("status") != ("True" if kind == "PodScheduled" else "False"):
            said(condition.get("reason"), condition.get("message"))
    return messages


# --- plain words ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Wanted:
    """What the waiting server asks for, to say what is missing in the user's words."""

    display_name: str
    queue: str
    model: str | None = None
    #: How much of the model, for "no H200 has 0.25 free": "0.25", "a MIG 1g.18gb slice", "2 cards".
    amount: str = ""
    #: Kubernetes resource names of the GPU request (`nvidia.com/gpu`, `nvidia.com/mig-1g.18gb`, ...).
    gpu_resources: frozenset[str] = frozenset()


def amount_text(share: Fraction, mig: str | None, count: int | None) -> str:
    """How a share is said in waiting messages: 0.25 → "0.25", a MIG slice, whole cards."""
    if mig is not None:
        return f"a MIG {mig} slice"
    if count is not None:
        return "a card" if count == 1 else f"{count} cards"
    return format_share(share)


Stage = Literal["enqueue", "any"]


@dataclass(frozen=True)
class Reason:
    """One row of the translation table: a scheduler message pattern and what to say instead."""

    pattern: re.Pattern[str]
    #: `enqueue`: only while the PodGroup is Pending (Volcano's enqueue step); once Inqueue it is stale.
    stage: Stage
    words: Callable[[Wanted, re.Match[str]], str | None]


def _no_free_gpu(wanted: Wanted, match: re.Match[str]) -> str | None:
    resource = match.groupdict().get("resource")
    if resource is not None and resource not in wanted.gpu_resources:
        return None  # another resource: a later row speaks about it
    if wanted.model is None:
        return None
    return f"no {wanted.model} has {wanted.amount} free"


def _fixed(text: str) -> Callable[[Wanted, re.Match[str]], str]:
    return lambda wanted, match: text.format(queue=wanted.queue, model=wanted.model or "GPU")


#: Scheduler messages → plain words, best explanation first. Texts come from Volcano (enqueue: the
#: capacity/proportion plugins' "queue resource quota insufficient"; allocate: "0/3 nodes are unavailable:
#: 2 Insufficient nvidia.com/gpu, 1 node(s) didn't match Pod's node affinity/selector."), from HAMi's
#: filter ("3 nodes CardInsufficientMemory(node-a,...)") and from the Kubernetes scheduler's predicates.
REASONS: tuple[Reason, ...] = (
    Reason(re.compile(r"queue\s+\S+\s+(?:is\s+)?(?:closed|not open)|queue\s+\S+\s+(?:is\s+)?(?:not found|does not exist)",
                      re.IGNORECASE),
           "any", _fixed('queue "{queue}" is closed or missing; ask an administrator (for an administrator: '
                         '`kubectl get queue {queue}` shows it; `helm upgrade` with the policies makes it again)')),
    Reason(re.compile(r"queue resource quota insufficient|\bNotInqueueable\b", re.IGNORECASE),
           "enqueue", _fixed('team queue "{queue}" is at its capability')),
    Reason(re.compile(r"Insufficient\s+(?P<resource>[A-Za-z0-9][-A-Za-z0-9_./]*[A-Za-z0-9])"), "any", _no_free_gpu),
    Reason(re.compile(r"\b(?:CardInsufficientMemory|CardInsufficientCore|NodeInsufficientDevice|"
                      r"AllocatedCardsInsufficientRequest|CardTimeSlicingExhausted)\b"), "any", _no_free_gpu),
    Reason(re.compile(r"\bResourceQuotaNotFit\b|exceeded quota"), "any",
           _fixed("the namespace's GPU quota is used up")),
    Reason(re.compile(r"Insufficient\s+cpu\b"), "any", _fixed("no node has the CPUs it asks for free")),
    Reason(re.compile(r"Insufficient\s+memory\b"), "any", _fixed("no node has the memory it asks for free")),
    Reason(re.compile(r"untolerated taint|had taints? that the pod didn't tolerate"), "any",
           _fixed("the nodes with room carry taints this profile does not tolerate")),
    Reason(re.compile(r"didn't match (?:Pod's )?node (?:affinity/)?selector|\bCardTypeMismatch\b"), "any",
           _fixed("no node with a {model} can take it")),
    Reason(re.compile(r"node\(s\) (?:were unschedulable|had untolerated taint \{node\.kubernetes\.io/not-ready)"),
           "any", _fixed("nodes are cordoned or not ready")),
    Reason(re.compile(r"pod number exceeded|Too many pods"), "any", _fixed("the nodes hold as many pods as they may")),
)

#: Messages that say only that the group waits, not why; they never make the explanation.
BOILERPLATE = re.compile(
    r"^(?:\w+: )?(?:\d+/\d+ tasks in gang unschedulable: )?pod group is not ready.*$|"
    r"^(?:\w+: )?(?:all nodes are unavailable|\d+/\d+ nodes are (?:un)?available)\.?$|"
    r"^(?:Scheduled|Enqueued?|PodGroupReady|Ready)(?::.*)?$",
    re.IGNORECASE,
)
RAW_LIMIT = 160


def explain(messages: Iterable[str], wanted: Wanted, group_phase: str | None) -> str:
    """The best plain-words reason among the scheduler's `messages`, or what waiting means at this phase."""
    messages = list(messages)
    for reason in REASONS:
        if reason.stage == "enqueue" and group_phase not in (None, "Pending"):
            continue  # enqueued by now: an older enqueue rejection no longer holds
        for message in messages:
            for match in reason.pattern.finditer(message):
                words = reason.words(wanted, match)
                if words:
                    return words
    for message in messages:
        if not BOILERPLATE.match(message.strip()):
            text = " ".join(message.split())
            return "the scheduler says: " + (text if len(text) <= RAW_LIMIT else text[: RAW_LIMIT - 1] + "…")
    if group_phase is None:
        return "waiting for Volcano to take it into the queue"
    if group_phase == "Pending":
        return "waiting for the queue to admit it"
    return "admitted by the queue, waiting for a node with room"


def waiting_message(wanted: Wanted, position: tuple[int, int] | None, reason: str) -> str:
    """`Waiting for 0.25 × H200: position 2 of 3 in queue "vision" (no H200 has 0.25 free)`."""
    if position is None:
        return f'Waiting for {wanted.display_name} in queue "{wanted.queue}" ({reason})'
    return (f'Waiting for {wanted.display_name}: position {position[0]} of {position[1]} '
            f'in queue "{wanted.queue}" ({reason})')


# --- requests no node can ever hold -------------------------------------------------------------------------


def _matches(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def never_fits(requests: Mapping[str, str | int | float], node_selector: Mapping[str, str],
               nodes: Iterable[Obj], display_name: str) -> str | None:
    """Why no node of the cluster could ever hold these pod requests, or None when one could (or may).

    Only nodes matching `node_selector` count, and only resources some node advertises (HAMi's
    `nvidia.com/gpumem-percentage` is not a node resource, HAMi checks it itself). With no matching node at
    all nothing is concluded: an autoscaler may yet add one.
    """
    nodes = list(nodes)
    candidates = [n for n in nodes if _matches((n.get("metadata") or {}).get("labels") or {}, node_selector)]
    if not candidates:
        return None
    advertised = {name for n in nodes for name in ((n.get("status") or {}).get("allocatable") or {})}
    for resource, amount in requests.items():
        if resource not in advertised:
            continue
        need = parse_quantity(str(amount))
        offers = [((n.get("status") or {}).get("allocatable") or {}).get(resource, "0") for n in candidates]
        largest = max(offers, key=lambda text: parse_quantity(str(text)))
        if parse_quantity(str(largest)) < need:
            where = ", ".join(f"{k}={v}" for k, v in node_selector.items()) or "any"
            return (f"{display_name} can never start on this cluster: it asks for {amount} {resource} "
                    f"and the largest node ({where}) offers {largest}")
    return None
