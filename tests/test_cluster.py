"""Fleets (sim.cluster): replicas of the engine on one clock behind a router."""

import json
import math
from fractions import Fraction

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim import run
from sim.config import ClusterConfig, ScenarioError, parse_scenario
from sim.workload import load_requests


def scenario(rate=1.5, n=200, cluster=None, arrival="poisson", policies=("vllm",), seed=0, **extra):
    d = {"name": "t", "model": "opt-13b", "gpu": "a100-40gb",
         "workload": {"arrival": {"kind": arrival, "rate": rate, **({"cv": 3} if arrival == "gamma" else {})},
                      "lengths": "sharegpt", "num_requests": n, "seed": seed},
         "policies": list(policies), "decompose": False, **extra}
    if cluster is not None:
        d["cluster"] = cluster
    return parse_scenario(d)


def assert_same_run(single, fleet):
    """Every metric and every table of the single server's run, exactly; the fleet adds only its columns."""
    assert single.policies.keys() == fleet.policies.keys()
    for name, a in single.policies.items():
        b = fleet.policies[name]
        assert json.dumps(a.summary) == json.dumps(b.summary), name
        for table in ("requests", "steps", "timeline"):
            fleet_table = getattr(b, table).drop(columns=["replica"], errors="ignore")
            pd.testing.assert_frame_equal(getattr(a, table), fleet_table, check_exact=True)
        assert (b.requests.replica == 0).sum() == (b.requests.status != "rejected").sum()


@pytest.mark.parametrize("router", ["round-robin", "least-outstanding"])
def test_a_fleet_of_one_replica_is_the_single_server_exactly(router):
    """Every policy kind (static, contiguous, paged, chunked), with decode spans, a horizon and a warm-up;
    both ways a fleet runs: routed ahead (round-robin reads no replica state) and pushed at each arrival."""
    policies = ("fastertransformer", "orca-pow2", "orca-oracle-mixed", "vllm", "vllm-v1")
    base = scenario(rate=3.0, n=150, policies=policies, horizon_s=60.0, startup_s=0.5)
    cluster = ClusterConfig(replicas=1, router=router)
    assert_same_run(run(base), run(base.model_copy(update={"cluster": cluster})))


@pytest.mark.parametrize("router", ["round-robin", "least-outstanding"])
def test_a_fleet_of_one_with_prefix_caching_and_swapping_is_the_single_server_exactly(router):
    base = parse_scenario({
        "name": "t", "model": "opt-13b", "gpu": "a100-40gb", "decompose": False,
        "workload": {"arrival": {"kind": "poisson", "rate": 4}, "lengths": "sharegpt", "num_requests": 150,
                     "shared_prefixes": {"lengths": [256, 512], "popularity": [2, 1]}},
        "policies": [{"preset": "vllm", "name": "cache", "prefix_caching": True},
                     {"preset": "vllm", "name": "swap", "preemption": "swap", "block_size": 32}]})
    cluster = ClusterConfig(replicas=1, router=router)
    assert_same_run(run(base), run(base.model_copy(update={"cluster": cluster})))


def test_round_robin_replicas_are_independent_servers_on_every_nth_request():
    """Round-robin with N identical replicas is N independent servers, replica k serving requests
    k, k+N, ... -- each at rate/N. Checked per request against single servers run on those requests:
    exactly (round-robin reads no replica state, so each replica knows its own arrivals ahead)."""
    n_rep = 3
    fleet_sc = scenario(rate=4.5, n=240, cluster={"replicas": n_rep, "router": "round-robin"})
    fleet = run(fleet_sc).policies["vllm"]
    requests = load_requests(fleet_sc)
    assert fleet.summary["num_finished"] == 240
    for k in range(n_rep):
        idx = np.arange(k, len(requests), n_rep)
        alone = run(scenario(rate=1.5, n=80), requests=requests.take(idx, "other_replica")).policies["vllm"]
        mine = fleet.requests.iloc[idx]
        assert (mine.replica == k).all()
        for col in ("first_scheduled_s", "first_token_s", "finish_s"):
            np.testing.assert_array_equal(mine[col].to_numpy(), alone.requests[col].to_numpy())
        row = fleet.replicas.iloc[k]
        assert row.num_routed == 80 and row.num_steps == alone.summary["num_steps"]
    s = fleet.summary
    assert s["kv_capacity_tokens"] == n_rep * fleet.replicas.kv_capacity_tokens.iloc[0]
    assert s["num_steps"] == fleet.replicas.num_steps.sum()
    assert 0 < s["busy_fraction"] <= 1


@pytest.mark.parametrize("exact", [True, False])
def test_an_arrival_at_a_step_boundary_is_routed_before_that_step(exact):
    """The fleet's clock routes an arrival before any replica's event of its time: a request arriving
    exactly when a step ends joins the step that starts then, as on a lone server that knew it ahead."""
    base = scenario(rate=2.0, n=40, exact=exact)
    requests = load_requests(base)
    steps = run(base, requests=requests).policies["vllm"].steps
    t = float(steps.start_s.iloc[len(steps) // 2])  # a step's start: the very float at which the one before ended
    k = int(np.searchsorted(requests.arrival_s, t, side="right"))
    requests = requests.replace(arrival_s=np.insert(requests.arrival_s, k, t),
                                prompt_tokens=np.insert(requests.prompt_tokens, k, 100),
                                output_tokens=np.insert(requests.output_tokens, k, 20))
    single = run(base, requests=requests)
    assert single.policies["vllm"].requests.first_scheduled_s.iloc[k] == t
    fleet = run(base.model_copy(update={"cluster": ClusterConfig(replicas=1, router="least-outstanding")}),
                requests=requests)
    assert_same_run(single, fleet)


@pytest.mark.parametrize("router", ["round-robin", "random"])
def test_routing_ahead_equals_routing_at_each_arrival(router, monkeypatch):
    """A router that reads no replica state routes every request ahead and each replica runs alone; the
    same fleet with the requests pushed at their arrivals on the shared clock is the same simulation up to
    rounding: here every request's times to the bit. (Pushed, a replica prices a decode span only up to the
    4N-th next fleet arrival (engine.AHEAD), so it may take one span as two: the same steps, their sums
    rounded otherwise.)"""
    from sim.cluster import router as routers

    sc = scenario(rate=6, n=200, cluster={"replicas": 3, "router": router}, horizon_s=60.0,
                  policies=("vllm", "orca-pow2"))
    ahead = run(sc)
    monkeypatch.setattr(routers.ROUTER_CLASSES[router], "live", True)
    pushed = run(sc)
    for name, a in ahead.policies.items():
        b = pushed.policies[name]
        pd.testing.assert_frame_equal(a.requests, b.requests, check_exact=True)
        assert a.summary.keys() == b.summary.keys() and a.summary["num_steps"] == b.summary["num_steps"]
        for k, v in a.summary.items():
            assert v == pytest.approx(b.summary[k], rel=1e-12, abs=1e-15, nan_ok=True), k
        pd.testing.assert_frame_equal(a.timeline, b.timeline, rtol=1e-12)
        assert (a.replicas.num_routed == b.replicas.num_routed).all()


def test_a_pushed_replica_drops_the_requests_it_has_admitted(monkeypatch):
    """A replica fed at each arrival keeps the requests pushed to it only until it admits them (lists
    that grew for the whole run fragmented the fleet's heap): every routed request is admitted or still
    pending at the horizon, and what it holds stays under ``TRIM`` plus the pending ones."""
    from sim.cluster import fleet as F
    from sim.engine import TRIM

    held = []
    results = F.Fleet._results

    def spy(self):
        held.append([(e._dropped, len(e._ids), len(e._ids) - e._next) for e in self.engines])
        return results(self)

    monkeypatch.setattr(F.Fleet, "_results", spy)
    res = run(scenario(rate=6, n=400, cluster={"replicas": 2, "router": "least-outstanding"}, horizon_s=50.0))
    req = res.policies["vllm"].requests
    (engines,) = held
    for k, (dropped, kept, pending) in enumerate(engines):
        assert dropped > 0 and kept < TRIM + pending
        assert dropped + kept == (req.replica == k).sum()


def test_least_outstanding_beats_round_robin_on_a_bursty_workload():
    """Gamma arrivals with cv 3 near saturation: routing to the replica with the fewest outstanding
    requests lowers mean and p99 end-to-end latency against blind round-robin (two seeds)."""
    for seed in (0, 1):
        e2el = {}
        for router in ("round-robin", "least-outstanding"):
            s = run(scenario(rate=5.6, n=500, arrival="gamma", seed=seed, record_steps=False,
                             cluster={"replicas": 4, "router": router})).policies["vllm"].summary
            e2el[router] = (s["mean_e2el_ms"], s["p99_e2el_ms"])
        assert e2el["least-outstanding"][0] < e2el["round-robin"][0], (seed, e2el)
        assert e2el["least-outstanding"][1] < e2el["round-robin"][1], (seed, e2el)


def prefix_scenario(router, load_cap=1.25, replicas=4):
    return parse_scenario({
        "name": "t", "model": "llama-2-7b", "gpu": "a100-40gb", "decompose": False, "record_steps": False,
        "gpu_memory_utilization": 0.6,  # a cache that holds about a third of the prefixes
        "workload": {"arrival": {"kind": "poisson", "rate": 12}, "lengths": "alpaca", "num_requests": 400,
                     "shared_prefixes": {"lengths": [1024 + 16 * i for i in range(32)],
                                         "popularity": [4] * 4 + [1] * 28}},
        "policies": [{"preset": "vllm", "name": "cache", "prefix_caching": True}],
        "cluster": {"replicas": replicas, "router": router, "router_options": {"load_cap": load_cap}}})


def test_prefix_affinity_raises_the_hit_rate_and_its_load_cap_holds():
    """32 shared prefixes, a cache per replica holding about a third of them: round-robin makes every
    replica cache every prefix; prefix affinity partitions them. The load cap trades some hits for balance."""
    hit, fleet = {}, {}
    for key, router, cap in (("rr", "round-robin", 1.25), ("pa", "prefix-affinity", 1.25),
                             ("uncapped", "prefix-affinity", 1e6)):
        r = run(prefix_scenario(router, cap))
        hit[key] = r.policies["cache"].summary["prefix_hit_rate_tokens"]
        fleet[key] = r.summary()["fleet"]["cache"]
    assert hit["pa"] > hit["rr"] + 0.2, hit  # measured: 0.80 vs 0.53
    assert hit["uncapped"] > hit["pa"] + 0.05, hit  # measured: 0.90
    assert fleet["pa"]["num_prefix_affine"] > 0 and fleet["pa"]["num_load_capped"] > 0
    assert fleet["uncapped"]["num_load_capped"] == 0


def test_the_prefix_affinity_cap_bounds_every_affine_choice():
    """Each request that follows its prefix goes to a replica whose outstanding requests, with it, are at
    most ceil(load_cap x the mean); every other request goes to the least loaded replica."""
    from sim.cluster import router as routers

    decisions = []
    route = routers.PrefixAffinity.route

    def spy(self, i, cands):
        s = self.replicas
        before = [s.outstanding(c) for c in cands]
        affine = self.num_affine
        r = route(self, i, cands)
        decisions.append((before, r, self.num_affine > affine, self.options.load_cap))
        return r

    routers.PrefixAffinity.route = spy
    try:
        run(prefix_scenario("prefix-affinity", load_cap=1.1))
    finally:
        routers.PrefixAffinity.route = route
    assert len(decisions) == 400
    for before, r, affine, cap in decisions:
        if affine:
            assert before[r] + 1 <= math.ceil(Fraction(str(cap)) * (sum(before) + 1) / len(before))
        else:
            assert before[r] == min(before)


def test_prefix_affinity_follows_the_prefix_in_a_lightly_loaded_fleet():
    """Requests far apart (each finds the fleet idle): the mean load is under one, and a cap of load_cap x
    the mean without its ceiling redirected every request (to replica 0, the least loaded's tie), so the
    router lost its affinity exactly when following it costs nothing (bounded loads take the ceiling)."""
    sc = prefix_scenario("prefix-affinity")
    sc = sc.model_copy(update={"workload": sc.workload.model_copy(update={
        "arrival": sc.workload.arrival.model_copy(update={"rate": 0.05}), "num_requests": 120})})
    res = run(sc)
    fleet = res.summary()["fleet"]["cache"]
    # measured: 87 affine, 2 capped (a replica still busy with a long request); before: 0 and 89
    assert fleet["num_prefix_affine"] > 80 and fleet["num_load_capped"] <= 5, fleet
    uncapped = run(sc.model_copy(update={"cluster": sc.cluster.model_copy(update={
        "router_options": sc.cluster.router_options.model_copy(update={"load_cap": 1e6})})}))
    assert res.policies["cache"].summary["prefix_hit_rate_tokens"] > \
        uncapped.policies["cache"].summary["prefix_hit_rate_tokens"] - 0.03


def test_heterogeneous_replicas_each_get_their_own_pool_and_speed():
    sc = scenario(rate=6, n=200, record_steps=False, cluster={
        "replicas": [{"gpu": "a100-80gb", "count": 1}, {"gpu": "a100-40gb", "count": 2}],
        "router": "least-outstanding"})
    res = run(sc).policies["vllm"]
    reps = res.replicas
    assert list(reps.gpu) == ["a100-80gb", "a100-40gb", "a100-40gb"]
    assert reps.kv_capacity_tokens.iloc[0] > 2 * reps.kv_capacity_tokens.iloc[1]
    assert res.summary["kv_capacity_tokens"] == reps.kv_capacity_tokens.sum()
    assert reps.num_routed.sum() == res.summary["num_finished"] == 200


def test_fleet_files_are_written(tmp_path):
    from sim import write_results

    res = run(scenario(rate=3, n=60, cluster={"replicas": 2, "router": ["round-robin", "random"]}))
    assert list(res.policies) == ["vllm/round-robin", "vllm/random"]
    paths = write_results(res, tmp_path, report=False)
    reps = pd.read_parquet(paths["replicas"])
    assert len(reps) == 4 and set(reps.policy) == {"vllm/round-robin", "vllm/random"}
    summary = json.loads(paths["summary"].read_text())
    assert summary["fleet"]["vllm/random"]["num_replicas"] == 2
    assert "replica" in pd.read_parquet(paths["requests"]).columns


@settings(max_examples=6, deadline=None)
@given(n_rep=st.integers(1, 4), router=st.sampled_from(["round-robin", "random", "least-outstanding", "least-kv",
                                                         "power-of-two"]),
       rate=st.floats(0.5, 20), seed=st.integers(0, 5), exact=st.booleans())
def test_every_request_is_accounted_for_once(n_rep, router, rate, seed, exact):
    res = run(scenario(rate=rate, n=40, seed=seed, exact=exact, horizon_s=30.0, policies=("vllm", "orca-max"),
                       cluster={"replicas": n_rep, "router": router})).policies
    for p in res.values():
        s, req, reps = p.summary, p.requests, p.replicas
        assert s["num_finished"] + s["num_rejected"] + s["num_unfinished"] == s["num_requests"] == 40
        assert reps.num_routed.sum() == (req.replica >= 0).sum()
        assert reps.num_finished.sum() == s["num_finished"]
        assert (req[req.status == "finished"].replica >= 0).all()


@pytest.mark.parametrize("cluster, message", [
    ({"replicas": 0}, "cluster.replicas: .*at least one replica (got 0)"),
    ({"replicas": []}, "cluster.replicas: .*at least one replica group"),
    ({"replicas": 2, "router": "least-outstandin"}, "unknown router 'least-outstandin'; did you mean "
                                                     "'least-outstanding'"),
    ({"replicas": [{"gpu": "h10", "count": 2}]}, "unknown gpu 'h10'; did you mean 'h100'"),
    ({"replicas": 2, "router_options": {"load_cap": 0.5}}, "load_cap: Input should be greater than or equal to 1"),
    ({"replicas": 10**9}, "cluster.replicas: Input should be less than or equal to 1024 (got 1000000000)"),
    ({"replicas": True}, "cluster.replicas: expected a number, not true"),
    ({"replicas": [{"count": 600}, {"gpu": "h100", "count": 600}]}, "cluster: 1200 replicas in all: at most 1024"),
    ({"prefill": {"replicas": 1000}, "decode": {"replicas": 100}, "kv_transfer": "nvlink"},
     "cluster: 1100 replicas in all: at most 1024"),
    ({"replicas": [{"count": 0}]}, "cluster.replicas[0].count: Input should be greater than 0 (got 0)"),
    # a router twice was silently collapsed into one run
    ({"replicas": 2, "router": ["round-robin", "round-robin"]}, "router 'round-robin' is listed twice"),
])
def test_bad_cluster_input_is_a_clear_error(cluster, message):
    with pytest.raises(ScenarioError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")) as e:
        scenario(cluster=cluster)
    assert len(str(e.value).splitlines()) == 1  # one line: not also the union's branches the value is not
    assert str(e.value).count("(got ") <= 1


def test_affinity_routers_lacking_their_data_fail_in_check_and_before_any_run(tmp_path, monkeypatch):
    import yaml

    import sim.cluster.fleet as fleet
    from sim.run import check_scenario

    cluster = {"replicas": 2, "router": ["round-robin", "prefix-affinity"]}
    s = scenario(n=10, cluster=cluster)
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"name": "t", "model": "opt-13b", "gpu": "a100-40gb", "policies": ["vllm"],
                                    "workload": {"arrival": {"kind": "poisson", "rate": 1}, "lengths": "sharegpt",
                                                 "num_requests": 10}, "cluster": cluster}))
    with pytest.raises(ScenarioError, match=f"{path}: cluster.router: prefix-affinity needs prompt prefix hashes"):
        check_scenario(path)
    monkeypatch.setattr(fleet, "run_fleet", lambda *a, **k: pytest.fail("a router ran"))
    with pytest.raises(ScenarioError, match="prefix-affinity needs prompt prefix hashes"):
        run(s)


def test_a_group_past_the_64th_gets_the_requests_only_it_can_serve():
    """Each request's candidates are the groups that can serve it, however many groups there are (they were
    bits of a 64-bit mask: from the 65th group on, none)."""
    gpu = {"name": "small", "memory_gib": 28.0, "hbm_gb_per_s": 2000, "tflops": 300}
    lone = run(scenario(n=120, rate=5, gpu=gpu)).policies["vllm"]
    only_big = int(lone.summary["num_rejected"])
    assert only_big > 0  # some requests only the A100 (the 65th group) can hold
    s = scenario(n=120, rate=5, cluster={"replicas": [{"gpu": gpu}] * 64 + [{"gpu": "a100-80gb"}],
                                         "router": "least-outstanding"})
    res = run(s).policies["vllm"]
    assert res.summary["num_rejected"] == 0 and res.summary["num_finished"] == 120
    assert (res.requests.replica == 64).sum() >= only_big


def test_affinity_without_what_it_needs_is_a_clear_error():
    with pytest.raises(ScenarioError, match="session-affinity needs the trace's session ids"):
        run(scenario(n=10, cluster={"replicas": 2, "router": "session-affinity"}))
    with pytest.raises(ScenarioError, match="prefix-affinity needs prompt prefix hashes"):
        run(scenario(n=10, cluster={"replicas": 2, "router": "prefix-affinity"}))


def test_a_replica_gpu_that_cannot_hold_the_model_is_a_clear_error(tmp_path):
    import yaml

    from sim.run import check_scenario

    data = {"name": "t", "model": "llama-2-70b", "gpu": "h100", "tensor_parallel": 4,
            "workload": {"arrival": {"kind": "poisson", "rate": 1}, "lengths": "sharegpt", "num_requests": 5},
            "policies": ["vllm"],
            "cluster": {"replicas": [{"count": 2}, {"gpu": "l4", "tensor_parallel": 1, "count": 1}]}}
    with pytest.raises(ScenarioError, match=r"cluster.replicas\[1\] \(l4 tp1\): .*"):
        run(parse_scenario(data))
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ScenarioError, match=r"cluster.replicas\[1\]"):
        check_scenario(path)
    path.write_text(yaml.safe_dump({**data, "cluster": {"replicas": 3, "router": "least-kv"}}))
    assert "fleet: 3 replicas of 4 x h100; router least-kv" in check_scenario(path)


def test_a_sweep_reaches_the_fleet_fields(tmp_path):
    """Fleet size and router are sweep axes like any scenario field; more replicas, more capacity."""
    from sim.executors import SerialExecutor
    from sim.sweep.output import run_sweep
    from sim.sweep.spec import load_sweep

    path = tmp_path / "s.yaml"
    path.write_text("""
name: fleet-sweep
base:
  name: t
  model: opt-13b
  gpu: a100-40gb
  workload: {arrival: {kind: poisson, rate: 3}, lengths: sharegpt, num_requests: 60}
  policies: [vllm]
  cluster: {replicas: 1}
axes:
  cluster.replicas: [1, 2]
  cluster.router: [round-robin, least-outstanding]
""")
    table = run_sweep(load_sweep(path), tmp_path / "out", SerialExecutor()).table
    assert len(table) == 4
    one, two = (table[table["cluster.replicas"] == k] for k in (1, 2))
    assert (two.kv_capacity_tokens.to_numpy() == 2 * one.kv_capacity_tokens.to_numpy()).all()
    assert (two.mean_ttft_ms.to_numpy() < one.mean_ttft_ms.to_numpy()).all()


@pytest.mark.parametrize("router", ["least-outstanding", "power-of-two", "session-affinity", "least-kv"])
def test_routing_reads_no_state_that_decode_spans_change(router):
    """Spans are exact for a single server; a fleet's routers route the same with exact stepping: outstanding
    requests change only at pushes and finishes, and least-kv reads the blocks of the steps a span has begun."""
    kw = dict(rate=6, n=150, cluster={"replicas": 3, "router": router})
    if router == "session-affinity":
        base = scenario(**kw)
        requests = load_requests(base)
        requests = requests.replace(session_id=np.arange(len(requests)) % 7)
        a = run(base, requests=requests).policies["vllm"]
        b = run(scenario(exact=True, **kw), requests=requests).policies["vllm"]
        assert a.requests.groupby(requests.session_id).replica.nunique().max() == 1
    else:
        a = run(scenario(**kw)).policies["vllm"]
        b = run(scenario(exact=True, **kw)).policies["vllm"]
    assert (a.requests.replica == b.requests.replica).all()
    np.testing.assert_allclose(a.requests.finish_s, b.requests.finish_s, rtol=1e-9)


@pytest.mark.parametrize("model, policy", [
    ("opt-13b", {"preset": "vllm", "block_size": 4}),
    ("opt-13b", {"preset": "vllm", "block_size": 4, "prefix_caching": True}),
    ("gemma-3-27b", {"preset": "vllm", "block_size": 4}),  # window pages: steps exactly under this router
    ("opt-13b", "orca-oracle")])
def test_least_kv_routes_inside_decode_spans_as_exact_stepping_does(model, policy):
    """KV grows inside a decode span taken at once (a block per member every block_size steps): least-kv
    reads it at each arrival as stepping holds it, on plain and prefix-cached pages, windowed hybrid pages
    and slabs. Small blocks make many crossings inside spans."""
    runs = []
    for exact in (False, True):
        d = {"name": "t", "model": model, "gpu": "h100",
             "workload": {"arrival": {"kind": "poisson", "rate": 8}, "lengths": "sharegpt", "num_requests": 150,
                          "seed": 1, "shared_prefixes": {"lengths": [512, 256]}},
             "policies": [policy], "decompose": False, "exact": exact,
             "cluster": {"replicas": 3, "router": "least-kv"}}
        runs.append(next(iter(run(parse_scenario(d)).policies.values())))
    (a, b), windowed = runs, model == "gemma-3-27b"
    assert (a.num_events == b.num_events) if windowed else (a.num_events < b.num_events / 2)
    assert a.requests.replica.nunique() == 3
    assert (a.requests.replica == b.requests.replica).all()
    np.testing.assert_allclose(a.requests.finish_s, b.requests.finish_s, rtol=1e-9)


def test_replica_groups_on_their_own_gpu_run_check_and_write(tmp_path):
    """The scenario's top-level GPU cannot hold the model, the replicas' can: `check` and `run` both take
    the replicas' GPU and tensor parallelism, and the summary is written (it was resolved on the top one)."""
    from sim.run import check_scenario, write_results

    d = {"name": "t", "model": "llama-2-13b", "gpu": "l4", "decompose": False,
         "workload": {"arrival": {"kind": "poisson", "rate": 2}, "lengths": "sharegpt", "num_requests": 20},
         "policies": ["vllm"], "cluster": {"replicas": [{"gpu": "h100", "count": 2}]}}
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps(d))
    assert any("fleet: 2 replicas" in line for line in check_scenario(path))
    res = run(parse_scenario(d))
    write_results(res, tmp_path / "out")
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["policies"]["vllm"]["num_finished"] == 20


def test_a_fleet_adds_up_its_replicas_cpu_tier_and_kv_groups():
    """The CPU tier's counts add up over replicas (rates from the sums), and a multi-group model's slots per
    group class are the replicas' summed per bin."""
    base = {"name": "t", "model": "mistral-7b", "gpu": "a100-40gb", "decompose": False,
            "workload": {"arrival": {"kind": "poisson", "rate": 6}, "lengths": "sharegpt", "num_requests": 120,
                         "shared_prefixes": {"lengths": [2048] * 12, "popularity": [1] * 12}, "seed": 2},
            "gpu_memory_utilization": 0.45,
            "policies": [{"preset": "vllm", "name": "tier", "prefix_caching": True, "kv_offload": {"cpu_gib": 1}}],
            "cluster": {"replicas": 2, "router": "round-robin"}}
    res = run(parse_scenario(base)).policies["tier"]
    reps = res.replicas
    assert res.summary["host_to_device_bytes"] == reps.host_to_device_bytes.sum()
    assert res.summary["device_to_host_bytes"] == reps.device_to_host_bytes.sum()
    assert res.summary["prefill_tokens_saved_cpu"] == reps.prefill_tokens_saved_cpu.sum()
    assert res.summary["host_to_device_bytes"] > 0 and res.summary["prefix_hit_rate_cpu"] > 0  # the tier is used
    # the fleet's rate is over the replicas' admitted tokens together: between theirs
    assert min(reps.prefix_hit_rate_cpu) <= res.summary["prefix_hit_rate_cpu"] <= max(reps.prefix_hit_rate_cpu)

    gemma = {"name": "g", "model": "gemma-3-27b", "gpu": "h100", "decompose": False,
             "workload": {"arrival": {"kind": "poisson", "rate": 4}, "lengths": "sharegpt", "num_requests": 60},
             "policies": ["vllm"], "cluster": {"replicas": 2, "router": "round-robin"}}
    one = run(parse_scenario({**gemma, "cluster": {"replicas": 1}})).policies["vllm"]
    two = run(parse_scenario(gemma)).policies["vllm"]
    assert one.groups is not None and two.groups is not None
    assert set(two.groups.group) == set(one.groups.group)
    assert len(two.groups) and (two.groups.slots >= 0).all()


@pytest.mark.parametrize("router", ["round-robin", "least-outstanding"])
def test_every_replica_row_and_the_fleet_share_one_window(router):
    """Every replica is counted from the fleet's first arrival to its end, idle as it left off once its
    work is done: the replicas' rows add up to the fleet (finished requests over the fleet's duration), and
    the fleet's memory shares are the means of theirs. (Each replica's row ran to its own last event, so
    a replica idle for most of the run showed a busy fraction near 1 and throughputs summing past the
    fleet's; the fleet's memory shares depended on where replicas happened to stop.)"""
    res = run(scenario(rate=3.0, n=60, cluster={"replicas": 3, "router": router})).policies["vllm"]
    reps, s = res.replicas, res.summary
    assert (reps.duration_s == s["duration_s"]).all()
    assert reps.request_throughput.sum() == pytest.approx(s["request_throughput"], rel=1e-12)
    assert reps.busy_fraction.mean() == pytest.approx(s["busy_fraction"], rel=1e-12)
    for c in ("token_states", "free"):
        assert reps[f"memory.{c}"].mean() == pytest.approx(s[f"memory.{c}"], rel=1e-9)
    steps = res.steps
    for k in range(3):  # each replica's records tile the window exactly
        mine = steps[steps.replica == k]
        assert mine.start_s.min() == pytest.approx(res.requests.arrival_s.min())
        assert (mine.start_s + mine.duration_s).max() == pytest.approx(res.requests.arrival_s.min() + s["duration_s"])


def test_the_prefix_affinity_cap_is_exact_for_decimal_caps():
    """ceil(1.1 x 50 / 5) is 11, but in floats 1.1 * 50 / 5 = 11.000000000000002 and its ceiling 12: a replica
    holding 11 of 49 outstanding still took a 12th under load_cap 1.1."""
    from types import SimpleNamespace

    from sim.cluster.router import PrefixAffinity
    from sim.workload import PrefixHashes

    class Reps:
        n = 5

        def __init__(self):
            self._loads = [11, 10, 10, 9, 9]

        def loads(self):
            return self._loads

        def least_outstanding(self, cands, loads=None):
            return min(cands, key=(loads or self._loads).__getitem__)

    hashes = PrefixHashes(np.array([7, 7], dtype=np.int64), np.array([0, 1, 2], dtype=np.int64), 16)
    r = PrefixAffinity(Reps(), SimpleNamespace(prefix_hashes=hashes), SimpleNamespace(load_cap=1.1, seed=0))
    r.owners[7] = 1  # replica 0 holds the prefix
    assert r.route(1, (0, 1, 2, 3, 4)) != 0 and r.num_capped == 1


def test_an_option_no_router_of_the_file_reads_is_an_error_there_not_in_a_sweep_over_routers(tmp_path):
    """router_options.seed with round-robin was silently ignored; it is an error in a scenario file, at its line.
    A sweep whose axis changes the router keeps the base's options for the points that read them."""
    import yaml

    from sim.config import load_scenario
    from sim.sweep.spec import load_sweep

    base = {"name": "b", "model": "opt-13b", "gpu": "a100-40gb", "policies": ["vllm"],
            "workload": {"arrival": {"kind": "poisson", "rate": 2.0}, "lengths": "alpaca", "num_requests": 10}}
    for cluster, message in (({"replicas": 2, "router": "least-outstanding", "router_options": {"load_cap": 1.5}},
                              "router_options.load_cap applies to prefix-affinity only; the router here is "
                              "least-outstanding"),
                             ({"replicas": 2, "router_options": {"seed": 3}},
                              "router_options.seed applies to random and power-of-two only; the router here is "
                              "round-robin")):
        (tmp_path / "s.yaml").write_text(yaml.safe_dump({**base, "cluster": cluster}, sort_keys=False))
        with pytest.raises(ScenarioError, match=r"s\.yaml:\d+: cluster\." + message.replace(".", r"\.")):
            load_scenario(tmp_path / "s.yaml")
    (tmp_path / "b.yaml").write_text(yaml.safe_dump({**base, "cluster": {"replicas": 2, "router": "random",
                                                                          "router_options": {"seed": 3}}}))
    (tmp_path / "w.yaml").write_text("base: b.yaml\naxes: {cluster.router: [random, round-robin]}\n")
    assert len(load_sweep(tmp_path / "w.yaml").points) == 2


def test_the_routers_a_scenario_accepts_are_the_routers_there_are():
    """sim.config.ROUTERS (what a scenario may name) and sim.cluster.router.ROUTER_CLASSES (what runs) are kept in
    two places (config does not import the cluster): they must list the same routers, and the options' users
    among them."""
    from sim.cluster.router import NEEDS, ROUTER_CLASSES
    from sim.config import ROUTER_OPTION_USERS, ROUTERS

    assert tuple(ROUTER_CLASSES) == ROUTERS
    assert {r for users in ROUTER_OPTION_USERS.values() for r in users} <= set(ROUTERS) and set(NEEDS) <= set(ROUTERS)
