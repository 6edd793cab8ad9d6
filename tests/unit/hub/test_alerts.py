"""The embedded queue's admission against a real ledger: budget alerts logged and POSTed to the policy's
webhook, once; the period's usage read once per pass of the queue, however long the queue."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from datetime import UTC, datetime, timedelta
from fractions import Fraction
from http.server import BaseHTTPRequestHandler, HTTPServer

from gpupool.hub.accounting.ledger import Ledger
from gpupool.policies import periods
from gpupool.policies.admission import Holdings, Reason
from gpupool.policies.loader import load_policy_files
from gpupool.spawner.local import admission, door
from gpupool.spawner.pool import AllocationStore, Card, LocalPool, Request


def test_alerts_reach_the_webhook_once(tmp_path, monkeypatch):
    now = datetime(2026, 11, 15, 12, tzinfo=UTC)
    monkeypatch.setattr(periods, "utcnow", lambda: now)
    received: list[dict] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self):
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        (tmp_path / "policy.yaml").write_text(f"""
models: {{H200: {{vendor: nvidia, memory_gib: 141, backends: [hami]}}}}
teams: {{vision: {{budget: {{gpu_hours: 10, on_exhausted: alert}}}}}}
profiles: {{q: {{display_name: q, gpu: {{model: H200, share: 0.25}}, teams: [vision]}}}}
billing: {{prices: {{H200: '1'}}}}
settings: {{alert_webhook: "http://127.0.0.1:{server.server_port}/hook"}}
""")
        policy = load_policy_files([tmp_path / "policy.yaml"])
        ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
        # one whole card for 9 hours: 9 GPU-hours of the 10, past the 80% threshold only
        ledger.open_interval("old", "alice", "vision", "q", "H200", Fraction(1), now - timedelta(hours=10))
        ledger.close_interval("old", now - timedelta(hours=1), "stopped")
        assert ledger.usage(periods.period_of(now), now).team["vision"] == 9
        # Through the door, as the pool places each: both admissions find 80% passed; the alert is sent once.
        hold = door(lambda: policy, ledger, logging.getLogger("test"))
        for user in ("bob", "carol"):
            assert hold(Request(f"{user}/", user, "vision", "q", "q", "H200", Fraction(1, 4),
                                holding=f"{user}/@1")).action == "admit"
        assert {i.user: i.state for i in ledger.open_intervals()} == {"bob": "reserved", "carol": "reserved"}
        # Ordering the queue decides without writing or alerting.
        decide = admission(lambda: policy, ledger)
        assert decide(Request("dan/", "dan", "vision", "q", "q", "H200", Fraction(1, 4)), Holdings()).action == "admit"
        assert len(ledger.open_intervals()) == 2
        deadline = time.monotonic() + 5
        while not received and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        assert [a["threshold"] for a in received] == ["0.8"]
        assert received[0]["team"] == "vision" and "has used 80% of its budget of 10 GPU-hours" in received[0]["message"]
    finally:
        server.shutdown()


def test_a_pass_of_the_queue_reads_the_usage_once_however_many_wait(tmp_path):
    (tmp_path / "policy.yaml").write_text("""
models: {H200: {vendor: nvidia, memory_gib: 141, backends: [hami]}}
teams: {vision: {quota: {gpus: 0.25}, budget: {gpu_hours: 100}}}
profiles: {q: {display_name: q, gpu: {model: H200, share: 0.25}, teams: [vision]}}
billing: {prices: {H200: '1'}}
""")
    policy = load_policy_files([tmp_path / "policy.yaml"])
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    reads = []
    real_usage = ledger.usage
    ledger.usage = lambda *args, **kwargs: reads.append(args) or real_usage(*args, **kwargs)  # a spy on the real one
    pool = LocalPool([Card("GPU-0", "H200", 0, 141)], AllocationStore(tmp_path / "allocations.sqlite"),
                     admission(lambda: policy, ledger), holdings=ledger.holdings,
                     hold=door(lambda: policy, ledger, logging.getLogger("test")))

    def request(n: int) -> Request:
        return Request(f"user{n}/", f"user{n}", "vision", "q", "q", "H200", Fraction(1, 4), holding=f"user{n}/@1")

    async def scenario():
        await pool.acquire(request(0))  # the team's quota is now full: everyone else waits
        waiting = [asyncio.create_task(pool.acquire(request(n))) for n in range(1, 51)]
        await asyncio.sleep(0)  # they reach the queue
        await pool.settled()
        assert {pool.ticket(f"user{n}/").code for n in range(1, 51)} == {Reason.QUOTA_FULL}
        del reads[:]
        pool.schedule()
        await pool.settled()
        assert len(reads) == 1, f"one pass over 50 waiting requests read the usage {len(reads)} times"
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)

    asyncio.run(scenario())
