"""Which GPU share backends each Kubernetes engine (`settings.engine`) can place, and the profiles of a policy
that ask for one it cannot. Pure: no I/O.

Where the refusal applies (docs/kubernetes.md, "Choosing an engine"): the embedded mode has no engine, and the
shipped policies (an H200 shared by HAMi) run there as they are. A policy that *names* `settings.engine` is
declared for the Kubernetes mode on that engine: `gpupool render` and `gpupool policy check` refuse it when a
profile's backend is one the engine cannot place. A policy that leaves the engine out gets the same findings as
notes from both commands, and as a refusal from `gpupool policy check --kubernetes`.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpupool.policies.model import FRACTIONAL_BACKENDS, GPURequest, Policy, parse_quantity

#: The share backends each engine cannot place, and why.
REFUSED: dict[str, dict[str, str]] = {
    "volcano": {
        "hami": "HAMi's shares need HAMi's own scheduler (its extender counts the cores and memory HAMi's device "
        "plugin registers in a node annotation), which Volcano is not: under Volcano the pod stays Pending",
    },
    "yunikorn": {
        "hami": "YuniKorn runs no scheduler extender, and HAMi's shares need HAMi's (it counts the cores and memory "
        "HAMi's device plugin registers in a node annotation): under YuniKorn the pod never fits a node",
        "volcano-vgpu": "Volcano's vGPU shares are placed by Volcano's own device-share plugin, which YuniKorn does "
        "not run: under YuniKorn the pod never fits a node",
    },
}
BACKENDS = ("hami", "volcano-vgpu", "mig", "timeslice", "whole")


def _either(names: list[str] | tuple[str, ...]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


@dataclass(frozen=True)
class Refusal:
    """A profile whose backend `engine` cannot place; `fitting`: the backends that deliver the same kind of
    request (whole cards, a MIG slice or a fraction), that `engine` places and that the model offers;
    `addable`: those of the kind the engine places that the model does not offer."""

    engine: str
    profile: str
    model: str
    backend: str
    fitting: tuple[str, ...] = ()
    addable: tuple[str, ...] = ()

    def __str__(self) -> str:
        others = [e for e in REFUSED if e != self.engine and self.backend not in REFUSED[e]]
        if self.fitting:
            instead = (f"give this profile {_either(self.fitting)} (a backend for this request that its model "
                       "offers)")
        elif self.addable:
            instead = (f"model {self.model} offers no backend for this request that works under "
                       f"{self.engine!r}: add {_either(self.addable)} to models.{self.model}.backends")
        else:
            instead = f"no backend for this request works under {self.engine!r}"
        return (f"profiles.{self.profile}: backend {self.backend!r} (model {self.model}) cannot work under "
                f"settings.engine {self.engine!r}: {REFUSED[self.engine][self.backend]}; {instead}"
                + (f", or choose settings.engine {others[0]!r}" if others else ""))


def request_backends(request: GPURequest) -> tuple[str, ...]:
    """The backends that can deliver `request`'s kind, whatever the model (as `GPURequest.backend_for`)."""
    if request.mig is not None:
        return ("mig",)
    if request.count is not None:
        return ("whole", "hami")
    return FRACTIONAL_BACKENDS


def refusals(policy: Policy, engine: str | None = None) -> list[Refusal]:
    """The profiles of `policy` whose share backend `engine` (default: the policy's `settings.engine`) cannot
    place, in policy order. A profile's backend is the one it resolves to (`GPURequest.backend_for`)."""
    engine = engine or policy.settings.engine
    found = []
    for slug, profile in policy.profiles.items():
        if profile.gpu is None:
            continue
        model = policy.models[profile.gpu.model]
        backend = profile.gpu.backend_for(model)
        if backend in REFUSED[engine]:
            kind = [b for b in BACKENDS if b in request_backends(profile.gpu) and b not in REFUSED[engine]]
            found.append(Refusal(engine, slug, profile.gpu.model, backend,
                                 tuple(b for b in kind if b in model.backends),
                                 tuple(b for b in kind if b not in model.backends)))
    return found


def engine_named(policy: Policy) -> bool:
    """Whether the policy names its engine (`settings.engine` written in a file): then it is declared for the
    Kubernetes mode, and a refusal is an error rather than a note."""
    return "engine" in policy.settings.model_fields_set


# --- YuniKorn's queue configuration ----------------------------------------------------------------------------
# What YuniKorn 1.8's own validator (core pkg/common/configs/configvalidator.go, checkQueueResource and
# checkResourceConfig; quantities by pkg/common/resources/quantity.go) refuses in the queue configuration that
# `gpupool.spawner.yunikorn` writes for a policy: `gpupool policy check` and `gpupool render` refuse the same,
# naming the team's field, before the cluster does.

#: Policy resource names that YuniKorn names otherwise: its core counts CPU as `vcore`.
YUNIKORN_NAMES = {"cpu": "vcore"}


def yunikorn_quantity(name: str, value: object) -> int:
    """`value` of resource `name` in YuniKorn's integer unit: millicores for cpu (`vcore`), the quantity itself for
    every other resource (memory in bytes, GPUs and their slices or replicas as counts). YuniKorn parses digits
    only (`^[0-9]+` and a suffix), so what is not a whole number there cannot be written: ValueError saying
    why and what is accepted."""
    amount = parse_quantity(str(value))
    if name == "cpu":
        milli = amount * 1000
        if milli.denominator != 1:
            raise ValueError(f"cpu {value} is not a whole number of millicores, YuniKorn's unit for cpu "
                             "(accepted: e.g. 2, 1.5, 500m)")
        return milli.numerator
    if amount.denominator != 1:
        if name == "memory":
            raise ValueError(f"memory {value} is not a whole number of bytes, YuniKorn's unit for memory "
                             "(accepted: e.g. 512Mi, 1.5Gi, 2Ti)")
        raise ValueError(f"{name} {value} is not a whole number: YuniKorn counts {name} in whole units (a "
                         "fractional GPU share is a whole count of its own resource there: time-sliced replicas "
                         "as nvidia.com/gpu.shared, MIG slices as nvidia.com/gpu or nvidia.com/mig-<profile>)")
    return amount.numerator


def yunikorn_resources(values: dict[str, object] | None) -> dict[str, int]:
    """A policy resource list in YuniKorn's names and integer units (ValueError as `yunikorn_quantity`)."""
    return {YUNIKORN_NAMES.get(name, name): yunikorn_quantity(name, value) for name, value in (values or {}).items()}


def yunikorn_guaranteed(policy: Policy, team: str) -> dict[str, int]:
    """`team`'s YuniKorn `guaranteed`: per resource, the larger of `queue.deserved` and `queue.guarantee` (as
    Volcano's capacity plugin reads a queue's deserved, `policies.references`)."""
    queue = policy.teams[team].queue
    deserved, guarantee = yunikorn_resources(queue.deserved), yunikorn_resources(queue.guarantee)
    return {name: max(deserved.get(name, 0), guarantee.get(name, 0))
            for name in sorted(deserved.keys() | guarantee.keys())}


def _children(policy: Policy, team: str | None) -> list[str]:
    return sorted(name for name, other in policy.teams.items() if other.queue.parent == team)


def _path(policy: Policy, team: str) -> str:
    parts = [team]
    while (parent := policy.teams[parts[-1]].queue.parent) is not None:  # the checks refuse cycles
        parts.append(parent)
    return ".".join(["root", *reversed(parts)])


def _text(resources: dict[str, int]) -> str:
    return ", ".join(f"{name} {value}{'m' if name == 'vcore' else ''}" for name, value in sorted(resources.items()))


def _over(larger: dict[str, int], smaller: dict[str, int]) -> dict[str, int]:
    """What of `smaller` does not fit in `larger` (YuniKorn's FitInMaxUndef: a resource `larger` leaves out is
    unlimited)."""
    return {name: value for name, value in smaller.items() if name in larger and value > larger[name]}


def yunikorn_problems(policy: Policy) -> list[tuple[tuple[str, ...], str]]:
    """What YuniKorn's validator would refuse in the queue configuration of `policy`, as (field path, message),
    quantities in policy order, then the tree from its top queues: a quantity it cannot write, a `guaranteed`
    above the queue's own `max`, a `max` above its parent's, children whose guarantees add up to more than their
    parent's `guaranteed` or `max`."""
    problems: list[tuple[tuple[str, ...], str]] = []
    figures: dict[str, tuple[dict[str, int], dict[str, int]]] = {}
    for name, team in policy.teams.items():
        converted = []
        for field in ("deserved", "guarantee", "capability"):
            try:
                converted.append(yunikorn_resources(getattr(team.queue, field)))
            except ValueError as error:
                problems.append((("teams", name, "queue", field), f"{error}; YuniKorn refuses the configuration"))
        if len(converted) == 3:
            figures[name] = (yunikorn_guaranteed(policy, name), converted[2])
    # YuniKorn places an application in a leaf queue only (core placement.go): a pod naming a parent's queue
    # is rejected, so a team with child teams can have no one who starts pods in it.
    for name, team in policy.teams.items():
        if not (kids := _children(policy, name)):
            continue
        why = (f"team {name!r} has child teams ({', '.join(kids)}) and YuniKorn never places a pod in a parent "
               f"queue ({_path(policy, name)} would reject them)")
        if team.members:
            problems.append((("teams", name, "members"), f"{why}: move its members to a child team, or to a new "
                             f"team with `queue.parent: {name}`"))
        if team.group_source == "authenticator":
            problems.append((("teams", name, "group_source"), f"{why}: members from the authenticator would start "
                             f"pods there; give the group to a child team, or to a new team with `queue.parent: "
                             f"{name}`"))
    for slug, profile in policy.profiles.items():
        for name in profile.teams:
            if name in policy.teams and (kids := _children(policy, name)):
                problems.append((("profiles", slug, "teams"), f"lists team {name!r}, which has child teams "
                                 f"({', '.join(kids)}), and YuniKorn never places a pod in a parent queue: list "
                                 "its child teams instead"))
    if len(figures) != len(policy.teams):
        return problems  # the tree is checked once every quantity can be written

    def check(team: str, parent_max: dict[str, int]) -> dict[str, int]:
        guaranteed, most = figures[team]
        path = ("teams", team, "queue")
        if over := _over(most, guaranteed):
            problems.append((path + ("capability",), f"guaranteed {_text(over)} (the larger of deserved and "
                             f"guarantee) is above the queue's max {_text(most)}: YuniKorn refuses a queue whose "
                             "guaranteed is larger than its max; raise capability or lower deserved/guarantee"))
        if over := _over(parent_max, most):
            problems.append((path + ("capability",), f"capability {_text(over)} is above the parent's max "
                             f"{_text(parent_max)}: YuniKorn refuses a child queue whose max is larger than its "
                             "parent's"))
        effective = {**most, **parent_max, **{k: min(v, parent_max.get(k, v)) for k, v in most.items()}}
        total: dict[str, int] = {}
        kids = _children(policy, team)
        for kid in kids:
            for name, value in check(kid, effective).items():
                total[name] = total.get(name, 0) + value
        if over := _over(guaranteed, total):
            problems.append((path + ("deserved",), f"the children's ({', '.join(kids)}) guaranteed add up to "
                             f"{_text(over)}, more than this queue's guaranteed {_text(guaranteed)} (the larger "
                             "of deserved and guarantee): YuniKorn refuses a parent queue whose guaranteed is "
                             "smaller than the sum of its children's"))
        if over := _over(effective, total):
            problems.append((path + ("capability",), f"the children's ({', '.join(kids)}) guaranteed add up to "
                             f"{_text(over)}, more than this queue's max {_text(effective)}: YuniKorn refuses a "
                             "parent queue whose max is smaller than the sum of its children's guaranteed"))
        return guaranteed if any(guaranteed.values()) else total

    for top in _children(policy, None):
        check(top, {})
    return problems
