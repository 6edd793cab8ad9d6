"""Checks that span sections of a policy: names that must exist, queue hierarchies, MIG profiles, prices.

Each problem is returned with the path of the offending key so that the loader can name file and line.
"""

from __future__ import annotations

from fractions import Fraction

from gpupool.policies.model import DNS_LABEL, KNOWN_MIG_PROFILES, RESERVED_TEAM_NAMES, Policy, parse_quantity
# The share translation decides what a profile can be given, so an undeliverable profile is a policy error.
from gpupool.policies.resources import gpu_resources

Path = tuple[str | int, ...]

#: Unix group names (teams become groups in the embedded mode) are limited to 32 characters.
MAX_TEAM_NAME = 32


def check_references(policy: Policy) -> list[tuple[Path, str]]:
    problems: list[tuple[Path, str]] = []
    models = sorted(policy.models)
    teams = sorted(policy.teams)

    def unknown_model(path: Path, name: str) -> None:
        if name not in policy.models:
            problems.append((path, f"unknown GPU model {name!r} (known: {', '.join(models) or 'none'})"))

    for name, model in policy.models.items():
        known = KNOWN_MIG_PROFILES.get(name)
        if model.mig is not None and known is not None:
            for i, mig in enumerate(model.mig.profiles):
                if mig not in known:
                    problems.append(
                        (("models", name, "mig", "profiles", i),
                         f"{name} has no MIG profile {mig!r} (its profiles: {', '.join(known)})")
                    )

    seen_uuids: set[str] = set()
    for i, declared in enumerate(policy.inventory):
        unknown_model(("inventory", i, "model"), declared.model)
        for j, uuid in enumerate(declared.uuids or []):
            if uuid in seen_uuids:
                problems.append((("inventory", i, "uuids", j), f"card UUID {uuid!r} is declared twice"))
            seen_uuids.add(uuid)

    for section in ("profiles", "teams"):
        for name in getattr(policy, section):
            if not DNS_LABEL.fullmatch(name) or len(name) > 63:
                problems.append(
                    ((section, name),
                     f"{name!r} is not DNS-safe (accepted: lower-case letters, digits and '-', starting and "
                     "ending with a letter or digit, at most 63 characters)")
                )

    defaults = [slug for slug, p in policy.profiles.items() if p.default]
    if len(defaults) > 1:
        problems.append((("profiles", defaults[1], "default"), f"several default profiles: {', '.join(defaults)}"))
    for slug, profile in policy.profiles.items():
        for i, team in enumerate(profile.teams):
            if team not in policy.teams:
                problems.append(
                    (("profiles", slug, "teams", i), f"unknown team {team!r} (known: {', '.join(teams) or 'none'})")
                )
        if sum(image.default for image in profile.images.values()) > 1:
            problems.append((("profiles", slug, "images"), "more than one image is marked default"))
        if profile.gpu is None:
            continue
        if profile.gpu.model not in policy.models:
            unknown_model(("profiles", slug, "gpu", "model"), profile.gpu.model)
            continue
        if policy.billing.prices and profile.gpu.model not in policy.billing.prices:
            problems.append(
                (("profiles", slug, "gpu", "model"),
                 f"no price for {profile.gpu.model} in billing.prices (give one, 0 for free use)")
            )
        try:
            gpu_resources(profile.gpu, policy.models[profile.gpu.model])
        except ValueError as error:
            key = "mig" if profile.gpu.mig is not None else "backend" if profile.gpu.backend else "share"
            if profile.gpu.count is not None:
                key = "count"
            problems.append((("profiles", slug, "gpu", key), str(error)))

    for name, team in policy.teams.items():
        if name in RESERVED_TEAM_NAMES:
            problems.append(
                (("teams", name), f"team name {name!r} is reserved (reserved: {', '.join(sorted(RESERVED_TEAM_NAMES))})")
            )
        if len(name) > MAX_TEAM_NAME:
            problems.append((("teams", name), f"team name {name!r} is longer than {MAX_TEAM_NAME} characters"))
        for model in team.quota.per_model:
            unknown_model(("teams", name, "quota", "per_model", model), model)
        for model in team.budget.per_model:
            unknown_model(("teams", name, "budget", "per_model", model), model)
        parent = team.queue.parent
        if parent is not None and parent not in policy.teams:
            problems.append(
                (("teams", name, "queue", "parent"), f"unknown parent queue {parent!r} (teams: {', '.join(teams)})")
            )

    cycles = _queue_cycles(policy)
    problems.extend(cycles)
    if not cycles:
        problems.extend(_queue_hierarchy(policy))
    problems.extend(_dataset_roots(policy))

    for model in policy.billing.prices:
        unknown_model(("billing", "prices", model), model)
    return problems


def _queue_cycles(policy: Policy) -> list[tuple[Path, str]]:
    problems: list[tuple[Path, str]] = []
    reported: set[str] = set()
    for start in policy.teams:
        chain = [start]
        current = policy.teams[start].queue.parent
        while current is not None and current in policy.teams:
            if current in chain:
                cycle = chain[chain.index(current):] + [current]
                if not reported & set(cycle):
                    problems.append(
                        (("teams", cycle[0], "queue", "parent"), "queue parents form a cycle: " + " → ".join(cycle))
                    )
                reported.update(cycle)
                break
            chain.append(current)
            current = policy.teams[current].queue.parent
    return problems


def _queue_hierarchy(policy: Policy) -> list[tuple[Path, str]]:
    """A parent queue's figures cover its children's, as Volcano's capacity plugin (enableHierarchy) requires.

    The plugin reads a child's deserved as max(deserved, guarantee) and logs an error on every scheduling cycle
    when the children's deserved or guarantees add up to more than their parent's, or a child's capability is
    above its parent's. The policy check refuses such a tree instead of raising the parent's figures itself:
    a parent's deserved decides what its siblings may reclaim from it, which is the admin's choice to make.
    """
    problems: list[tuple[Path, str]] = []

    def figures(values: dict[str, object] | None) -> dict[str, Fraction]:
        return {name: parse_quantity(value) for name, value in (values or {}).items()}

    def effective_deserved(team: str) -> dict[str, Fraction]:
        queue = policy.teams[team].queue
        deserved, guarantee = figures(queue.deserved), figures(queue.guarantee)
        return {name: max(deserved.get(name, Fraction(0)), guarantee.get(name, Fraction(0)))
                for name in deserved.keys() | guarantee.keys()}

    def text(value: Fraction) -> str:
        for suffix, factor in (("Ti", 1024 ** 4), ("Gi", 1024 ** 3), ("Mi", 1024 ** 2)):
            if value >= factor and value % factor == 0:
                return f"{value // factor}{suffix}"
        return str(value.numerator) if value.denominator == 1 else str(float(value))

    children: dict[str, list[str]] = {}
    for name, team in policy.teams.items():
        if team.queue.parent in policy.teams:
            children.setdefault(team.queue.parent, []).append(name)
    for parent, kids in children.items():
        queue = policy.teams[parent].queue
        for field, own, of_child in (
            ("deserved", effective_deserved(parent), effective_deserved),
            ("guarantee", figures(queue.guarantee), lambda kid: figures(policy.teams[kid].queue.guarantee)),
        ):
            parts: dict[str, dict[str, Fraction]] = {}
            for kid in kids:
                for name, value in of_child(kid).items():
                    parts.setdefault(name, {})[kid] = value
            totals = {name: sum(by_kid.values(), Fraction(0)) for name, by_kid in parts.items()}
            over = [name for name in sorted(totals) if totals[name] > own.get(name, Fraction(0))]
            if over:
                detail = "; ".join(
                    f"{name}: {' + '.join(f'{kid} {text(v)}' for kid, v in parts[name].items())}"
                    f"{' = ' + text(totals[name]) if len(parts[name]) > 1 else ''} > "
                    f"{parent} {text(own[name]) if name in own else 'none'}" for name in over)
                kind = "deserved (or guarantee where larger)" if field == "deserved" else "guarantees"
                problems.append(
                    (("teams", parent, "queue", field),
                     f"the child queues' {kind} add up to more than parent queue {parent!r} has in its {field} "
                     f"({detail}); give {parent!r} at least the children's sum, or lower theirs")
                )
        parent_capability = figures(queue.capability)
        for kid in kids:
            capability = figures(policy.teams[kid].queue.capability)
            over = [name for name in sorted(capability)
                    if name in parent_capability and capability[name] > parent_capability[name]]
            if over:
                detail = "; ".join(f"{name}: {text(capability[name])} > {text(parent_capability[name])}"
                                   for name in over)
                problems.append(
                    (("teams", kid, "queue", "capability"),
                     f"capability above its parent queue {parent!r}'s ({detail}); the parent's limit applies "
                     f"anyway: lower it to at most the parent's")
                )
    return problems


def _dataset_roots(policy: Policy) -> list[tuple[Path, str]]:
    """With S3 storage no team's root may hold another's: each team's credentials reach its root only."""
    if policy.datasets.storage != "s3":
        return []
    problems: list[tuple[Path, str]] = []
    roots = {name: policy.dataset_s3_root(name) + "/" for name in policy.teams}
    for name, root in roots.items():
        for other, other_root in roots.items():
            if other != name and root.startswith(other_root) and (root != other_root or name > other):
                problems.append(
                    (("teams", name, "datasets", "root"),
                     f"the dataset root {root.rstrip('/')} of team {name!r} lies inside the root of team "
                     f"{other!r} ({other_root.rstrip('/')}); give each team its own bucket or prefix")
                )
                break
    return problems
