"""Reconciliation of the ledger against the hub's REST API: what the hub runs is what the ledger counts.

Server runs are keyed by `ledger.run_key` (user, server name, the hub's `started`), which the spawner that
starts a server and this service that only reads the hub compute alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import requests

from gpupool.hub.accounting.ledger import Ledger, RunResult, run_key
from gpupool.policies import periods
from gpupool.policies.choice import ChoiceRefused, check_choice
from gpupool.policies.model import Policy
from gpupool.policies.resources import profile_share

#: Users per page asked of the hub (JupyterHub's default maximum page size is 200).
PAGE = 200


def hub_time(text: str) -> datetime:
    """A timestamp of the hub's REST API (`2026-12-02T14:20:00.123456Z`) as an aware UTC datetime."""
    moment = datetime.fromisoformat(text.removesuffix("Z"))
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


@dataclass(frozen=True)
class HubServer:
    """One active server as the hub's REST API shows it (`read:servers`)."""

    user: str
    name: str
    started: datetime
    ready: bool
    user_options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def run(self) -> str:
        return run_key(self.user, self.name, self.started)


def servers_of(users: Iterable[Mapping[str, Any]]) -> list[HubServer]:
    """The active servers in user models of `GET /hub/api/users` (ready or with an event pending)."""
    found = []
    for user in users:
        for name, server in (user.get("servers") or {}).items():
            if not server.get("started"):
                continue  # not started yet: nothing can have opened an interval of it
            found.append(HubServer(user["name"], name, hub_time(server["started"]), bool(server.get("ready")),
                                   server.get("user_options") or {}))
    return found


@dataclass
class Reconciled:
    """What one reconciliation changed, by run."""

    opened: list[str] = field(default_factory=list)
    continued: list[str] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)
    unknown: dict[str, str] = field(default_factory=dict)  # run → why its usage could not be recorded


def reconcile(ledger: Ledger, policy: Policy, servers: list[HubServer], groups: Mapping[str, list[str]],
              asked_at: datetime) -> Reconciled:
    """Make the ledger agree with the hub's answer, given at `asked_at`: `servers` are what runs.

    A ready server without an open interval is opened at the hub's `started` time (or continued where
    reconciliation closed it); an open interval of a run the hub no longer lists is closed at its last
    heartbeat. Pending servers are neither opened (their spawner opens them when they run) nor closed,
    and an open interval of theirs counts as seen.
    `groups` maps each user to their hub groups (for the team of a server whose options name none).
    """
    done = Reconciled()
    for server in servers:
        if not server.ready:
            # Starting (its spawner opens it once it holds its share) or stopping (it holds it until it
            # ends): still there, so an open interval of it is seen; nothing is opened for it.
            ledger.heartbeat_run(server.run, asked_at)
            continue
        try:
            choice = check_choice(policy, server.user, policy.teams_of(server.user, groups.get(server.user, [])),
                                  dict(server.user_options))
        except ChoiceRefused as refused:
            done.unknown[server.run] = refused.message
            continue
        if choice.profile.gpu is None:
            continue  # CPU only: nothing to account
        result = ledger.keep_run(server.run, server.user, choice.team, choice.slug, choice.profile.gpu.model,
                                 profile_share(choice.profile, policy), server.started, asked_at)
        if result is RunResult.OPENED:
            done.opened.append(server.run)
        elif result is RunResult.CONTINUED:
            done.continued.append(server.run)
    done.closed = ledger.close_runs_except((s.run for s in servers), asked_at)
    return done


def user_groups(groups: Iterable[Mapping[str, Any]]) -> dict[str, list[str]]:
    """user → group names, from group models of `GET /hub/api/groups` (`read:groups`)."""
    of: dict[str, list[str]] = {}
    for group in groups:
        for user in group.get("users") or []:
            of.setdefault(user, []).append(group["name"])
    return of


class HubClient:
    """The hub's REST API with the service's own token (`JUPYTERHUB_API_URL`, `JUPYTERHUB_API_TOKEN`)."""

    def __init__(self, api_url: str, token: str, timeout: float = 30):
        self.api_url = api_url.rstrip("/")
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"token {token}"
        # Page metadata instead of a bare list (JupyterHub ≥ 2), so every page is asked for.
        self.session.headers["Accept"] = "application/jupyterhub-pagination+json"
        self.timeout = timeout

    def _pages(self, path: str, **params: Any) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        offset = 0
        while True:
            reply = self.session.get(f"{self.api_url}{path}", params={**params, "offset": offset, "limit": PAGE},
                                     timeout=self.timeout)
            reply.raise_for_status()
            body = reply.json()
            page = body["items"] if isinstance(body, dict) else body
            items.extend(page)
            following = body.get("_pagination", {}).get("next") if isinstance(body, dict) else None
            if not following or not page:
                return items
            offset = following["offset"]

    def servers(self) -> list[HubServer]:
        return servers_of(self._pages("/users", state="active"))

    def groups(self) -> dict[str, list[str]]:
        return user_groups(self._pages("/groups"))


def reconcile_with_hub(ledger: Ledger, policy: Policy, hub: HubClient) -> Reconciled:
    """One round: ask the hub what runs, then make the ledger agree (see `reconcile`)."""
    asked_at = periods.utcnow()
    groups = hub.groups()
    servers = hub.servers()
    return reconcile(ledger, policy, servers, groups, asked_at)
