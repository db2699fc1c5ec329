"""Prefill/decode disaggregation (sim/cluster/disagg.py): a prefill pool and a decode pool on one clock."""

import numpy as np
import pytest

from sim import run
from sim.config import ClusterConfig, ScenarioError, parse_scenario
from sim.run import check_scenario

LINK = {"gb_per_s": 50, "latency_ms": 0.5}
SMALL_GPU = {"name": "small", "memory_gib": 32, "hbm_gb_per_s": 1555, "tflops": 312}  # OPT-13B leaves ~3 GiB of KV


def scenario(cluster, policies=("vllm",), n=120, rate=3.0, model="opt-13b", gpu="a100-40gb", workload=None, **extra):
    w = workload or {"arrival": {"kind": "poisson", "rate": rate}, "lengths": "sharegpt", "num_requests": n, "seed": 0}
    return parse_scenario({"name": "t", "model": model, "gpu": gpu, "workload": w, "policies": list(policies),
                           "decompose": False, "cluster": cluster, **extra})


def pools(prefill=1, decode=1, link=LINK, **more):
    return {"prefill": {"replicas": prefill}, "decode": {"replicas": decode}, "kv_transfer": link, **more}


def one_request(prompt, output):
    return {"arrival": {"kind": "poisson", "rate": 1}, "prompt": {"kind": "fixed", "tokens": prompt},
            "output": {"kind": "fixed", "tokens": output}, "num_requests": 1}


def test_a_single_transfer_takes_bytes_over_bandwidth_plus_latency():
    # OPT-13B: 40 layers, 40 KV heads of 128 at fp16: K and V = 2 x 40 x 40 x 128 x 2 = 819,200 bytes a token
    res = run(scenario(pools(), workload=one_request(1000, 10))).policies["vllm"]
    r = res.requests.iloc[0]
    assert r.status == "finished" and r.generated_tokens == 10
    assert r.transfer_bytes == 1000 * 819_200
    assert r.transfer_ms == pytest.approx(819_200_000 / 50e9 * 1e3 + 0.5, rel=1e-12)  # 16.384 + 0.5 ms
    assert r.decode_wait_ms == 0 and r.transfer_queue_ms == 0  # an idle decode replica admits it at once
    # the first token comes with the KV; token 2 at the decode replica's first step after it
    assert r.first_token_s == pytest.approx(r.prefill_end_s + r.transfer_ms / 1e3, rel=1e-12)
    assert r.ttft_ms == pytest.approx((r.first_token_s - r.arrival_s) * 1e3)
    assert res.fleet["kv_transfer"]["bytes"] == 819_200_000
    # requests holding KV, over time: the prefill replica holds it from its prefill until the transfer ends,
    # the decode replica from the transfer's start (its reservation) to the finish; the idle time while it
    # moves counts on both (it counted zero: neither replica runs a step)
    prefill_s, transfer_s = r.prefill_end_s - r.arrival_s, r.transfer_ms / 1e3
    held = prefill_s + transfer_s + (r.finish_s - r.first_token_s + transfer_s)
    assert res.summary["mean_running_requests"] * res.summary["duration_s"] == pytest.approx(held, rel=1e-9)
    # fp8 KV halves the bytes: Llama-3-8B, 32 layers x 8 KV heads x 128, one byte each
    fp8 = run(scenario(pools(link="infiniband-400g"), policies=[{"preset": "vllm", "kv_cache_dtype": "fp8"}],
                       model="llama-3-8b", gpu="h100", workload=one_request(512, 4))).policies["vllm"].requests.iloc[0]
    assert fp8.transfer_bytes == 512 * 2 * 32 * 8 * 128
    assert fp8.transfer_ms == pytest.approx(512 * 65_536 / 50e9 * 1e3 + 0.02, rel=1e-12)


def test_tensor_parallel_ranks_send_their_shares_in_parallel():
    """One link per GPU: at tensor parallelism t on both sides each rank moves 1/t of a GQA model's KV, so
    the stream takes bytes / (t x bandwidth); a decode pool of more ranks than the prefill pool's is
    bounded by the senders; MLA's latent is whole on every rank, so it gains nothing."""
    per_token = 2 * 32 * 8 * 128 * 2  # Llama-3-8B: 32 layers, 8 KV heads of 128, bf16
    for tp_p, tp_d, links in ((1, 1, 1), (2, 2, 2), (4, 4, 4), (8, 8, 8), (2, 4, 2), (4, 2, 2)):
        c = {"prefill": {"replicas": 1, "tensor_parallel": tp_p}, "decode": {"replicas": 1, "tensor_parallel": tp_d},
             "kv_transfer": "nvlink"}
        r = run(scenario(c, model="llama-3-8b", gpu="h100",
                         workload=one_request(1000, 4))).policies["vllm"].requests.iloc[0]
        assert r.transfer_bytes == 1000 * per_token  # the whole model's, once
        assert r.transfer_ms == pytest.approx(1000 * per_token / (links * 450e9) * 1e3 + 0.01, rel=1e-12), (tp_p, tp_d)
    mla = 61 * (512 + 64) * 2  # DeepSeek-V3: the latent and the rope key, every rank holds all of it
    c = {"prefill": {"replicas": 1}, "decode": {"replicas": 1}, "kv_transfer": "nvlink"}
    r = run(scenario(c, model="deepseek-v3", gpu="h200", tensor_parallel=8,
                     workload=one_request(1000, 4))).policies["vllm"].requests.iloc[0]
    assert r.transfer_ms == pytest.approx(1000 * mla / 450e9 * 1e3 + 0.01, rel=1e-12)


def _two_at_once(prefill, decode):
    """Two requests arriving together, prefilled together, sent from and to the pools' replicas in turn."""
    w = {"arrival": {"kind": "poisson", "rate": 1e9}, "prompt": {"kind": "fixed", "tokens": 500},
         "output": {"kind": "fixed", "tokens": 4}, "num_requests": 2, "seed": 0}
    c = {"prefill": {"replicas": prefill}, "decode": {"replicas": decode}, "kv_transfer": LINK,
         "router": "round-robin"}
    return run(scenario(c, workload=w, startup_s=0.01)).policies["vllm"].requests  # both queued at the start


def test_a_decode_replica_receives_one_stream_at_a_time():
    """Two prefill replicas sending to one decode replica share its link: the second transfer waits for
    the first one's stream (not for its latency), as two sends from one prefill replica do."""
    stream = 500 * 819_200 / 50e9 * 1e3
    for req in (_two_at_once(2, 1), _two_at_once(1, 2)):
        assert np.ptp(req.prefill_end_s) < 1e-6 and (req.decode_wait_ms == 0).all()  # both ready at once
        first, second = req.sort_values("transfer_queue_ms").itertuples()
        assert first.transfer_ms == second.transfer_ms == pytest.approx(stream + 0.5, rel=1e-12)
        start = lambda r: r.prefill_end_s + (r.decode_wait_ms + r.transfer_queue_ms) / 1e3
        assert start(second) == pytest.approx(start(first) + stream / 1e3, abs=1e-9)
        assert second.first_token_s - first.first_token_s == pytest.approx(stream / 1e3, abs=1e-9)


def test_the_decode_pool_draws_from_its_own_random_stream():
    """Both pools' random routers seeded alike made the decode pool repeat the prefill pool's draws: a
    request's decode replica was its prefill replica's index for 99 % of requests (expected about 25 %)."""
    for router in ("random", "power-of-two"):
        c = {"prefill": {"replicas": 4}, "decode": {"replicas": 4}, "kv_transfer": LINK, "router": router,
             "router_options": {"seed": 7}}
        req = run(scenario(c, n=300, rate=4.0, model="llama-3-8b", gpu="h100")).policies["vllm"].requests
        moved = req[req.replica >= 0]
        same = (moved.replica - 4 == moved.prefill_replica).mean()  # (decode replicas are 4-7: after the prefill pool)
        assert 0.15 < same < 0.4, (router, same)


def test_a_waiting_transfer_keeps_its_memory_on_the_prefill_replica():
    """Back-pressure: a decode replica with room for about three requests; the prefill replica keeps each
    prefilled request's KV until the decode side admits it and the transfer ends, and that memory counts."""
    w = {"arrival": {"kind": "poisson", "rate": 50}, "prompt": {"kind": "fixed", "tokens": 800},
         "output": {"kind": "fixed", "tokens": 200}, "num_requests": 12, "seed": 1}
    c = {"prefill": {"replicas": 1}, "decode": {"replicas": 1, "gpu": SMALL_GPU}, "kv_transfer": LINK}
    res = run(scenario(c, workload=w)).policies["vllm"]
    req = res.requests
    assert (req.status == "finished").all()
    assert req.decode_wait_ms.max() > 1000  # waited seconds for a decode slot
    released = req.prefill_end_s + (req.decode_wait_ms + req.transfer_queue_ms + req.transfer_ms) / 1e3
    steps = res.steps[res.steps.replica == 0]  # the prefill replica
    idle = steps[(steps.num_steps == 0) & (steps.duration_s > 0)]
    assert len(idle) > 0
    for row in idle.itertuples():  # while idle, it holds exactly the prompts of the requests not yet transferred
        held = (req.prefill_end_s <= row.start_s) & (released >= row.start_s + row.duration_s - 1e-9)
        assert row.mem_token_states == pytest.approx(req.prompt_tokens[held].sum())
    pre = res.replicas[res.replicas.pool == "prefill"].iloc[0]
    assert pre.kv_in_use > 0.05 and res.fleet["prefill"]["kv_in_use"] == pre.kv_in_use


def test_a_request_the_decode_pool_can_never_hold_is_rejected_up_front():
    w = {"arrival": {"kind": "poisson", "rate": 5}, "prompt": {"kind": "uniform", "low": 100, "high": 1000},
         "output": {"kind": "uniform", "low": 100, "high": 1000}, "num_requests": 40, "seed": 3}
    c = {"prefill": {"replicas": 1}, "decode": {"replicas": 1, "gpu": dict(SMALL_GPU, memory_gib=28.5)},
         "kv_transfer": LINK}
    res = run(scenario(c, workload=w)).policies["vllm"]
    req, s = res.requests, res.summary
    blocks = res.replicas[res.replicas.pool == "decode"].iloc[0].kv_capacity_tokens // 16
    room = blocks - int(0.01 * blocks)  # vLLM's admission watermark
    too_big = -(-(req.prompt_tokens + req.output_tokens - 1) // 16) > room
    assert 0 < too_big.sum() < len(req)
    assert (req.status[too_big] == "rejected").all() and (req.reason[too_big] == "exceeds_kv_pool").all()
    assert (req.status[~too_big] == "finished").all()  # the run ends: no request waits for room that never comes
    assert s["num_rejected"] == too_big.sum() and s["num_finished"] == (~too_big).sum()


def test_a_request_over_the_models_length_is_rejected_for_that_as_on_one_server():
    """The prefill pool sees one output token: a prompt that fits the model's length but not that pool's KV
    gave `exceeds_kv_pool`, hiding that prompt + output exceed the length, which a colocated server says
    (and `sim plan` holds only the former against a deployment)."""
    from sim.config import parse_scenario

    reasons = {}
    for cluster in ({"prefill": {"replicas": 1}, "decode": {"replicas": 1}, "kv_transfer": "nvlink"}, {"replicas": 1}):
        s = parse_scenario({"name": "d", "decompose": False, "model": "opt-13b", "gpu": "a100-40gb",
                            "gpu_memory_utilization": 0.65, "policies": ["vllm"], "cluster": cluster,
                            "workload": {"arrival": {"kind": "poisson", "rate": 1}, "num_requests": 3, "seed": 1,
                                         "prompt": {"kind": "fixed", "tokens": 1700},
                                         "output": {"kind": "fixed", "tokens": 400}}})
        res = run(s).policies["vllm"]
        assert res.summary["num_rejected"] == res.summary["num_rejected_max_model_len"] == 3
        reasons[len(cluster)] = list(res.requests.reason)
    assert reasons[3] == reasons[1] == ["exceeds_max_model_len"] * 3


def test_one_prefill_and_one_decode_replica_finish_every_request_consistently():
    res = run(scenario(pools(), n=150, rate=3.0)).policies["vllm"]
    req, s = res.requests, res.summary
    assert (req.status == "finished").all() and (req.generated_tokens == req.output_tokens).all()
    assert s["num_finished"] == 150 and s["num_requests"] == 150
    # time order of a request's life, and the metrics built on it
    assert (req.first_scheduled_s >= req.arrival_s).all() and (req.prefill_end_s > req.first_scheduled_s).all()
    assert (req.first_token_s >= req.prefill_end_s).all() and (req.finish_s >= req.first_token_s).all()
    many = req.output_tokens > 1
    waited = (req.decode_wait_ms + req.transfer_queue_ms + req.transfer_ms) / 1e3
    assert np.allclose(req.first_token_s[many], (req.prefill_end_s + waited)[many], rtol=0, atol=1e-9)
    assert np.allclose(req.e2el_ms - req.ttft_ms, req.tpot_ms * (req.output_tokens - 1), equal_nan=True)
    assert s["mean_ttft_ms"] == pytest.approx(req.ttft_ms.mean())
    assert res.fleet["kv_transfer"]["num_transfers"] == many.sum()
    assert set(res.replicas.pool) == {"prefill", "decode"} and res.replicas.num_routed.tolist() == [150, many.sum()]
    # decode spans cut where a landing KV would cut stepping: the same run stepped exactly, to rounding
    exact = run(scenario(pools(), n=150, rate=3.0, exact=True)).policies["vllm"].requests
    assert np.allclose(exact.finish_s, req.finish_s, rtol=0, atol=1e-9)
    assert np.allclose(exact.first_token_s, req.first_token_s, rtol=0, atol=1e-9)


def test_only_transfers_begun_before_the_horizon_are_counted():
    """A slow link queues transfers past a 5 s horizon: those never begin in the run, so neither the
    request table nor the fleet's kv_transfer figures count them."""
    res = run(scenario(pools(link={"gb_per_s": 0.05}), n=60, rate=5.0, horizon_s=5)).policies["vllm"]
    req, moved = res.requests, res.requests[res.requests.transfer_ms.notna()]
    start = req.prefill_end_s + (req.decode_wait_ms + req.transfer_queue_ms) / 1e3
    assert len(moved) > 0 and (start[moved.index] < 5).all()
    assert req.decode_wait_ms.notna().sum() > len(moved)  # admitted by the decode pool, link busy past 5 s
    assert res.fleet["kv_transfer"]["num_transfers"] == len(moved)
    assert res.fleet["kv_transfer"]["bytes"] == moved.transfer_bytes.sum()
    assert (req.transfer_bytes[req.transfer_ms.isna()] == 0).all()


def test_a_one_token_request_ends_on_its_prefill_replica():
    w = {"arrival": {"kind": "poisson", "rate": 4}, "prompt": {"kind": "uniform", "low": 10, "high": 500},
         "output": {"kind": "fixed", "tokens": 1}, "num_requests": 30}
    res = run(scenario(pools(), workload=w)).policies["vllm"]
    req = res.requests
    assert (req.status == "finished").all() and (req.generated_tokens == 1).all()
    assert (req.replica == -1).all() and req.transfer_ms.isna().all() and (req.transfer_bytes == 0).all()
    assert (req.first_token_s == req.prefill_end_s).all() and (req.finish_s == req.first_token_s).all()
    assert res.fleet["kv_transfer"]["num_transfers"] == 0 and res.fleet["decode"]["busy_fraction"] == 0


def test_paged_and_contiguous_decode_pools_both_run():
    res = run(scenario(pools(prefill=1, decode=2, router="least-outstanding"), n=100, rate=4.0,
                       policies=("vllm", "orca-oracle", "orca-max"))).policies
    for name, r in res.items():
        assert r.summary["num_finished"] == 100, name
        assert r.fleet["decode"]["num_replicas"] == 2 and r.fleet["split"] == "disaggregated"
        mem = sum(r.summary[f"memory.{c}"] for c in ("token_states", "reservation", "internal_fragmentation",
                                                      "external_fragmentation", "free"))
        assert mem == pytest.approx(1.0)
    # contiguous slabs reserve the whole request on the decode side: more of it is reservation than paged's
    assert res["orca-max"].summary["memory.reservation"] > res["vllm"].summary["memory.reservation"]
    assert res["orca-max"].fleet["kv_transfer"]["mean_decode_wait_ms"] > res["vllm"].fleet["kv_transfer"][
        "mean_decode_wait_ms"]


def test_prefix_caching_on_the_prefill_pool():
    w = {"arrival": {"kind": "poisson", "rate": 4}, "lengths": "sharegpt", "num_requests": 80,
         "shared_prefixes": {"lengths": [256, 512], "popularity": [2, 1]}}
    res = run(scenario(pools(prefill=2, decode=2, router="prefix-affinity"), workload=w,
                       policies=[{"preset": "vllm", "prefix_caching": True}])).policies["vllm"]
    assert res.summary["num_finished"] == 80 and res.summary["prefix_hit_rate_tokens"] > 0.1


def test_sim_check_describes_the_pools(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("""
name: t
model: llama-3-8b
gpu: a100-80gb
workload: {arrival: {kind: poisson, rate: 1}, lengths: sharegpt, num_requests: 10}
policies: [vllm]
cluster:
  prefill: {replicas: 2, gpu: h100}
  decode: {replicas: 3}
  kv_transfer: nvlink
""")
    lines = check_scenario(path)
    assert ("fleet, disaggregated: prefill: 2 replicas of 1 x h100; decode: 3 replicas of 1 x a100-80gb; KV transfer "
            "nvlink 450 GB/s "
            "+ 0.01 ms; router round-robin") in lines


# ---------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("cluster, message", [
    ({"prefill": {"replicas": 0}, "decode": {"replicas": 1}, "kv_transfer": LINK},
     r"cluster\.prefill\.replicas: a pool needs at least one replica \(got 0\)"),
    ({"prefill": {"replicas": 1}, "decode": {"replicas": 1}, "kv_transfer": "infiniband"}, "unknown link 'infiniband'"),
    ({"prefill": {"replicas": 1}, "kv_transfer": LINK}, "prefill without decode"),
    ({"decode": {"replicas": 1}, "kv_transfer": LINK}, "decode without prefill"),
    ({"replicas": 4, "prefill": {"replicas": 1}, "decode": {"replicas": 1}, "kv_transfer": LINK}, "not both"),
    ({"prefill": {"replicas": 1}, "decode": {"replicas": 1}}, "need kv_transfer"),
    ({"replicas": 2, "kv_transfer": "nvlink"}, "kv_transfer is the link between"),
    # (1e-12 GB/s was taken: a time to first token of 10^14 s)
    ({"prefill": {"replicas": 1}, "decode": {"replicas": 1}, "kv_transfer": {"gb_per_s": 1e-12}},
     r"kv_transfer\.gb_per_s: Input should be greater than or equal to 0\.001"),
])
def test_bad_cluster_is_a_clear_error(cluster, message):
    with pytest.raises(ScenarioError, match=message):
        scenario(cluster)


def test_a_pool_whose_gpu_cannot_hold_the_model_is_an_error_naming_the_pool():
    c = {"prefill": {"replicas": 1}, "decode": {"replicas": 2, "gpu": "l4"}, "kv_transfer": LINK}
    with pytest.raises(ScenarioError, match=r"cluster\.decode \(l4 tp1\): .*does not fit"):
        run(scenario(c, n=5))


@pytest.mark.parametrize("extra, policies, model, message", [
    ({"sampling": {"kind": "parallel", "n": 2}}, ("vllm",), "opt-13b", "parallel samples"),
    ({}, ("fastertransformer",), "opt-13b", "static batching"),
    ({}, ("vllm",), "gemma-3-27b", "several KV groups"),
])
def test_what_disaggregation_does_not_simulate_is_an_error(extra, policies, model, message):
    gpu = "h100" if model == "gemma-3-27b" else "a100-40gb"
    with pytest.raises(ScenarioError, match=r"cluster\.prefill .*" + message):
        run(scenario(pools(), policies=policies, model=model, gpu=gpu, n=5, **extra))


def test_a_disaggregated_scenario_reads_back_from_its_dump():
    """Sweeps and summary.json write the scenario out whole; it must validate again (a sweep's zip of
    cluster.prefill.replicas and cluster.decode.replicas compares splits)."""
    c = scenario(pools(prefill=2, decode=3, link="nvlink")).cluster
    again = ClusterConfig.model_validate(c.model_dump(mode="json"))
    assert again == c and again.disaggregated and again.replicas is None


def test_a_policy_a_pool_cannot_run_is_an_error_before_anything_runs():
    """`sim run` simulated the policies before it, then stopped (all that work lost); `sim check` already
    refused it. Every policy is resolved on every pool before the first run."""
    started = []
    with pytest.raises(ScenarioError, match="static batching is not simulated"):
        run(scenario(pools(), policies=["vllm", "fastertransformer"], n=20),
            progress=lambda name, done, total: started.append(name))
    assert started == []


def test_requests_number_replicas_as_the_replica_table_does():
    """``requests.replica`` and ``prefill_replica`` are rows of ``replicas.parquet`` (prefill pool first): the
    decode replica was its index within its pool, so joining the tables landed on prefill replicas."""
    c = {"prefill": {"replicas": 1}, "decode": {"replicas": 3}, "kv_transfer": LINK}
    res = run(scenario(c, n=60, rate=4.0, model="llama-3-8b", gpu="h100")).policies["vllm"]
    req, reps = res.requests, res.replicas.set_index("replica")
    moved = req[req.replica >= 0]
    assert set(moved.replica) <= {1, 2, 3} and (reps.loc[moved.replica, "pool"] == "decode").all()
    assert (reps.loc[req.prefill_replica, "pool"] == "prefill").all()
    assert (moved.groupby("replica").size() == reps.loc[sorted(set(moved.replica)), "num_routed"]).all()
    # a prefill replica makes first tokens only: no TPOT (it read 0 ms, from the requests' whole output lengths)
    assert reps.loc[reps.pool == "prefill", "median_tpot_ms"].isna().all()
    assert reps.loc[reps.pool == "decode", "median_tpot_ms"].gt(0).all()
