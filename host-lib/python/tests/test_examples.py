"""The seed's five examples, run on the Rust event loop with simulated services on a
virtual clock: results as the seed says, and concurrency read from the clock."""

import json
import threading

from dpumesh.testing import TestMesh

import basic_parallel
import conditional_skip
import data_chaining
import dynamic_builder
import fan_out_fan_in


def after(ms, body, status=200):
    return lambda req: (status, body, ms)


def test_basic_parallel_runs_the_two_calls_at_once_after_the_internal_step():
    mesh = TestMesh(
        basic_parallel.app,
        services={"svc-a": after(10, "a"), "svc-b": after(10, "b")},
    )
    r = mesh.get("/api/v1")
    assert r.status == 200
    # The answer is the last step's: the parallel block's last member.
    assert r.text == "b"
    sent = mesh.sent
    assert [url for _, _, url in sent] == ["http://svc-a/api/v1", "http://svc-b/api/v1"]
    # Both calls left at the same virtual moment (after the internal step) and the
    # request took one call's latency, not two.
    assert sent[0][0] == sent[1][0]
    assert 10 <= r.elapsed_ms < 19, r


def test_basic_parallel_a_failed_call_fails_the_block_naming_it():
    mesh = TestMesh(
        basic_parallel.app,
        services={"svc-a": after(5, "down", status=503), "svc-b": after(10, "b")},
    )
    r = mesh.get("/api/v1")
    assert r.status == 502
    assert "step-0" in r.text  # the generated id of svc-a's call
    # pipe lets the other member finish before failing
    assert len(mesh.sent) == 2


def test_data_chaining_passes_the_step_result_positionally_and_by_name():
    services = {
        "user-service": lambda req: (200, '{"name": "ada"}' if req.url.endswith(".json") else "ada", 7)
    }
    mesh = TestMesh(data_chaining.app, services=services)
    r = mesh.get("/chain")
    assert (r.status, r.text) == (200, "Hello, ada")
    assert r.elapsed_ms >= 7
    r = mesh.get("/chain-json")
    assert r.status == 200
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {"greeting": "Hi ada", "status": 200}


def test_dynamic_builder_sends_what_the_builder_made_from_the_earlier_result():
    seen = []

    def target(req):
        seen.append((req.method, req.url, req.body))
        return (201, "stored", 3)

    mesh = TestMesh(
        dynamic_builder.app,
        services={"config-service": after(2, "target-svc\n"), "target-svc": target},
    )
    r = mesh.get("/dynamic")
    assert (r.status, r.text) == (201, "stored")
    assert seen == [("POST", "http://target-svc/api", b"data")]
    assert [url for _, _, url in mesh.sent] == ["http://config-service/target", "http://target-svc/api"]
    assert r.elapsed_ms >= 5


def test_conditional_skip_skips_the_step_when_the_builder_returns_nothing():
    audits = []
    accounts = {
        "alice": {"id": "alice", "audited": True},
        "bob": {"id": "bob", "audited": False},
    }

    def audit(req):
        audits.append(req.body)
        return (200, "recorded", 4)

    mesh = TestMesh(
        conditional_skip.app,
        services={
            "accounts": lambda req: (200, json.dumps(accounts[req.url.rsplit("/", 1)[1]]), 1),
            "audit": audit,
        },
    )
    r = mesh.get("/account/alice")
    assert r.json() == {"account": "alice", "audit": "skipped"}
    assert audits == []
    r = mesh.get("/account/bob")
    assert r.json() == {"account": "bob", "audit": "recorded"}
    assert json.loads(audits[0]) == accounts["bob"]


def test_fan_out_fan_in_with_the_low_level_api_overlaps_the_two_fetches():
    mesh = TestMesh(
        fan_out_fan_in.app,
        services={"user": after(20, '{"id": 1}'), "orders": after(30, '{"order": 9}')},
    )
    r = mesh.get("/low-level")
    assert r.status == 200
    assert r.json() == {"user": {"id": 1}, "order": {"order": 9}}
    # max(20, 30), not 20 + 30
    assert 30 <= r.elapsed_ms < 49, r


def test_fan_out_builder_sends_its_requests_at_once_inside_a_parallel_block():
    mesh = TestMesh(
        fan_out_fan_in.app,
        services={
            "index": after(1, '{"shards": [1, 2, 3]}'),
            "shard-1": after(10, "one"),
            "shard-2": after(10, "two"),
            "shard-3": after(10, "three"),
        },
    )
    r = mesh.get("/search")
    assert r.json() == {"hits": ["one", "three", "two"]}
    shard_calls = [at for at, _, url in mesh.sent if "shard-" in url]
    assert len(shard_calls) == 3 and len(set(shard_calls)) == 1
    assert 11 <= r.elapsed_ms < 29, r


def test_internal_steps_run_on_the_pool_not_the_loop_thread():
    from flask import Flask

    from dpumesh.server import get_context

    app = Flask(__name__)
    threads = {}

    def work():
        threads["step"] = threading.get_ident()
        return "done"

    @app.route("/")
    def index():
        threads["handler"] = threading.get_ident()
        get_context().run_internal(work)
        return ""

    r = TestMesh(app).get("/")
    assert r.text == "done"
    assert threads["step"] != threads["handler"]


def test_a_fan_out_outside_a_parallel_block_sends_its_requests_one_after_another():
    from flask import Flask

    from dpumesh.server import get_context

    app = Flask(__name__)

    @app.route("/")
    def index():
        ctx = get_context()
        ctx.call(
            "GET",
            "unused",
            request_builder=lambda: [("GET", f"http://s/{n}", {}, None) for n in range(3)],
            id="each",
        )
        ctx.run_internal(lambda each: [p.body for p in each.parts], inputs=["each"])
        return ""

    mesh = TestMesh(app, services={"s": lambda req: (200, req.url[-1], 5)})
    r = mesh.get("/")
    assert r.json() == ["0", "1", "2"]
    times = [at for at, _, _ in mesh.sent]
    assert times[0] < times[1] < times[2], times
    assert r.elapsed_ms >= 15
