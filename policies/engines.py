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

from gpupool.policies.model import Policy

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


def accepted(engine: str) -> list[str]:
    """The backends `engine` places."""
    return [backend for backend in BACKENDS if backend not in REFUSED[engine]]


@dataclass(frozen=True)
class Refusal:
    """A profile whose backend `engine` cannot place."""

    engine: str
    profile: str
    model: str
    backend: str

    def __str__(self) -> str:
        instead = accepted(self.engine)
        others = [e for e in REFUSED if e != self.engine and self.backend not in REFUSED[e]]
        return (f"profiles.{self.profile}: backend {self.backend!r} (model {self.model}) cannot work under "
                f"settings.engine {self.engine!r}: {REFUSED[self.engine][self.backend]}; give this profile "
                f"{', '.join(instead[:-1])} or {instead[-1]} (a backend its model offers)"
                + (f", or choose settings.engine {others[0]!r}" if others else ""))


def refusals(policy: Policy, engine: str | None = None) -> list[Refusal]:
    """The profiles of `policy` whose share backend `engine` (default: the policy's `settings.engine`) cannot
    place, in policy order. A profile's backend is the one it resolves to (`GPURequest.backend_for`)."""
    engine = engine or policy.settings.engine
    found = []
    for slug, profile in policy.profiles.items():
        if profile.gpu is None:
            continue
        backend = profile.gpu.backend_for(policy.models[profile.gpu.model])
        if backend in REFUSED[engine]:
            found.append(Refusal(engine, slug, profile.gpu.model, backend))
    return found


def engine_named(policy: Policy) -> bool:
    """Whether the policy names its engine (`settings.engine` written in a file): then it is declared for the
    Kubernetes mode, and a refusal is an error rather than a note."""
    return "engine" in policy.settings.model_fields_set
