"""The MLflow service's gate in-process: what it reads of a request and forwards to MLflow, and that it never reads
MLflow's database on the event loop. Through a real hub and `mlflow server`: tests/e2e/test_mlflow_service.py.
"""

from __future__ import annotations

import json

import pytest


def test_mlflow_reads_exactly_the_checked_parameters_and_gets_the_body_as_sent_when_unchanged():
    from gpupool.mlflow.auth import Request

    def forwarded(body: bytes, change: tuple | None = None) -> tuple[dict, bytes]:
        request = Request({"method": "POST", "path": "/m/api/2.0/mlflow/runs/log-batch", "headers": []}, "/m", body)
        request.params()
        if change:
            request.set_param(*change)
        request.rewrite()
        assert json.loads(request.body) == request.params()  # what MLflow parses is what the gate checked
        return request.params(), request.body

    sent = b'{"run_id": "abc",  "run_id": "def", "metrics": [{"key": "loss", "value": 0.5}]}'
    assert forwarded(sent) == ({"run_id": "def", "metrics": [{"key": "loss", "value": 0.5}]}, sent)
    params, body = forwarded(sent, ("user_id", "alice"))
    assert params["user_id"] == "alice" and body != sent
    double = json.dumps(sent.decode()).encode()  # old clients' double-encoded JSON: forwarded as one object
    assert forwarded(double)[1] == json.dumps({"run_id": "def", "metrics": [{"key": "loss", "value": 0.5}]}).encode()
    assert forwarded(b" ") == ({}, b"{}")


def test_the_event_loop_never_reads_mlflows_database(tmp_path):
    """Calls on owners not yet remembered are decided in a worker thread, from the request as sent; remembered ones
    on the event loop, with no database read at all."""
    import threading
    from types import SimpleNamespace

    import anyio

    from gpupool.mlflow.auth import Gate, HubGate, Request, Stores
    from gpupool.mlflow.permissions import Refused, Viewer

    reads = []

    class Tracking:
        def get_experiment(self, experiment_id):
            reads.append((experiment_id, threading.current_thread()))
            return SimpleNamespace(tags={"gpupool.team": "vision"})

    stores = Stores()
    stores._handlers = SimpleNamespace(_get_tracking_store=Tracking)
    gate = HubGate(None, Gate(stores, str(tmp_path), ""), None, "/m")
    alice, nadia = Viewer("alice", False, ("vision",), frozenset()), Viewer("nadia", False, ("nlp",), frozenset())
    body = json.dumps({"experiment_id": "7", "tags": [{"key": "mlflow.user", "value": "mallory"}]}).encode()

    def create_run() -> Request:
        return Request({"method": "POST", "path": "/m/api/2.0/mlflow/runs/create", "headers": []}, "/m", body)

    async def decide_three_times():
        first, second, refused = create_run(), create_run(), create_run()
        await gate.decide(alice, first)
        await gate.decide(alice, second)
        with pytest.raises(Refused) as error:
            await gate.decide(nadia, refused)
        assert error.value.status == 404
        return threading.current_thread(), first, second

    loop_thread, first, second = anyio.run(decide_three_times)
    assert [experiment for experiment, _ in reads] == ["7"] and reads[0][1] is not loop_thread
    for request in (first, second):
        forwarded = json.loads(request.body)
        assert isinstance(forwarded.pop("start_time"), int)  # the server's clock
        assert forwarded == {"experiment_id": "7", "user_id": "alice", "tags": [
            {"key": "gpupool.user", "value": "alice"}, {"key": "mlflow.user", "value": "alice"}]}

