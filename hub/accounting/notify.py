"""Budget alerts leaving the accounting: claimed once per threshold and period, logged, and posted to the webhook.

Both spawners admit through `admit` (the ledger's one door: decided and held in one transaction), so an alert is
claimed once and sent the same way whichever mode made the decision.
"""

from __future__ import annotations

import json
import threading
import urllib.request

from gpupool.hub.accounting.ledger import AdmissionResult, Ledger
from gpupool.policies.admission import Alert, AdmissionRequest
from gpupool.policies.model import Policy


def post_webhook(url: str, body: dict, log) -> None:
    """POST one alert as JSON to the policy's webhook (in a thread: a slow receiver must not hold anything up)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
                                     method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10):
            pass
    except OSError as error:
        log.error("alert webhook %s failed: %s", url, error)


def post_alert(url: str, alert: Alert, log) -> None:
    """POST one budget alert as JSON."""
    post_webhook(url, {"team": alert.team, "period": alert.period, "scope": alert.scope or None,
                       "threshold": alert.threshold_text, "message": alert.message}, log)


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
