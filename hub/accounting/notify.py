"""Budget alerts leaving the accounting: claimed once per threshold and period, logged, and posted to the webhook.

Both spawners admit through here (`admit`: the ledger's door, deciding and holding in one transaction; `admit_now`:
the embedded queue's decision against its cards), so an alert is sent the same way whichever mode made the decision.
"""

from __future__ import annotations

import json
import threading
import urllib.request

from gpupool.hub.accounting import periods
from gpupool.hub.accounting.admission import Alert, AdmissionRequest, Decision, Holdings, Usage, decide
from gpupool.hub.accounting.ledger import AdmissionResult, Ledger
from gpupool.policies.model import Policy


def post_alert(url: str, alert: Alert, log) -> None:
    """POST one budget alert as JSON (in a thread: a slow receiver must not hold up the queue)."""
    body = json.dumps({"team": alert.team, "period": alert.period, "scope": alert.scope or None,
                       "threshold": alert.threshold_text, "message": alert.message}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10):
            pass
    except OSError as error:
        log.error("budget alert webhook %s failed: %s", url, error)


def send_alerts(policy: Policy, ledger: Ledger, decision: Decision, log) -> list[Alert]:
    """The decision's alerts not sent before (claimed in the ledger), logged and posted; returns them."""
    if not (decision.admitted and decision.alerts):
        return []
    claimed = ledger.claim_alerts(decision.alerts, periods.utcnow())
    deliver(policy, claimed, log)
    return claimed


def deliver(policy: Policy, alerts: list[Alert] | tuple[Alert, ...], log) -> None:
    """Log and post alerts already claimed in the ledger (each is delivered once)."""
    webhook = policy.settings.alert_webhook
    for alert in alerts:
        log.warning("gpupool budget alert: %s", alert.message)
        if webhook:
            threading.Thread(target=post_alert, args=(webhook, alert, log), daemon=True).start()


def admit(policy: Policy, ledger: Ledger, request: AdmissionRequest, key: str, log) -> AdmissionResult:
    """`Ledger.admit` (decide and hold `key` as reserved, in one transaction), with its new alerts delivered.

    Blocking (SQL under the team's lock): call it from a thread, not the event loop.
    """
    result = ledger.admit(policy, request, key)
    deliver(policy, result.alerts, log)
    return result


def admit_now(policy: Policy, ledger: Ledger, request: AdmissionRequest, holdings: Holdings, log,
              usage: Usage | None = None) -> Decision:
    """The admission decision for `request` against the period's usage so far, with its alerts sent.

    `usage` is the period's usage when the caller has just read it (`Ledger.usage`); read here otherwise.
    """
    if usage is None:
        usage = ledger.usage(periods.period_of(request.at), request.at)
    decision = decide(policy, request, holdings, usage)
    send_alerts(policy, ledger, decision, log)
    return decision
