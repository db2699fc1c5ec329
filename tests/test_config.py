"""Scenario validation: every mistake is one clear line naming the file, line and key path."""

import re
import textwrap

import pytest

from sim.config import POLICY_PRESETS, ScenarioError, load_scenario, parse_scenario

BASE = """\
name: t
model: opt-13b
gpu: a100-40gb
workload:
  arrival: {kind: poisson, rate: 2.0}
  lengths: sharegpt
  num_requests: 10
policies: [vllm]
"""


def write(tmp_path, text):
    p = tmp_path / "s.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def err(tmp_path, text) -> str:
    with pytest.raises(ScenarioError) as e:
        load_scenario(write(tmp_path, text))
    return str(e.value)


def test_valid_scenario_loads(tmp_path):
    s = load_scenario(write(tmp_path, BASE))
    assert s.policies[0].name == "vllm" and s.policies[0].allocator.kind == "paged"
    assert s.workload.prompt.mean == pytest.approx(161.31)


@pytest.mark.parametrize("bad,expect", [
    (BASE + "colour: red\n", "s.yaml:9: colour: unknown key"),
    # a trace workload's key on a generated one (the hint read: "did you mean 'rate_scale'?")
    (BASE.replace("  num_requests: 10", "  num_requests: 10\n  rate_scale: 2"),
     "workload.rate_scale: unknown key here: 'rate_scale' is a key of kind: trace"),
    (BASE.replace("rate: 2.0", "rate: -1"), "s.yaml:5: workload.arrival.rate: Input should be greater than or equal to 0.000000001 (got -1)"),
    (BASE.replace("rate: 2.0", "rate: fast"), "workload.arrival.rate: Input should be a valid number"),
    (BASE.replace("rate: 2.0", "rate: 0"), "workload.arrival.rate: Input should be greater than or equal to 0.000000001"),
    (BASE.replace("kind: poisson", "kind: weibull"), "workload.arrival"),
    (BASE.replace("num_requests: 10", "num_requests: 0"), "workload.num_requests: Input should be greater than 0"),
    (BASE.replace("  num_requests: 10\n", ""), "needs a stop"),
    (BASE.replace("[vllm]", "[vllm, turbo]"), "s.yaml:8: policies[1]: unknown preset 'turbo'"),
    # a key YAML reads as a boolean (its location read "[1]", like a list index), a number as a key
    (BASE + "on: 1\n", "(top level): the key True is not text; YAML reads on, off, yes and no as booleans"),
    (BASE + "1: 2\n", "(top level): the key 1 is not text; quote it"),
    # a 20,000-character value, quoted twice in full, made a 40 KB line
    (BASE.replace("gpu: a100-40gb", "gpu: " + "a" * 20_000), "aaaa... (20,002 characters))"),
    # a preset given as a list or a mapping (a TypeError traceback: not hashable)
    (BASE.replace("[vllm]", "[{preset: [vllm]}]"), "policies[0]: unknown preset ['vllm']"),
    (BASE.replace("[vllm]", "[{preset: {name: vllm}}]"), "policies[0]: unknown preset {'name': 'vllm'}"),
    (BASE.replace("[vllm]", "[]"), "policies: List should have at least 1 item"),
    # (pydantic's "Unable to extract tag using discriminator 'kind'")
    (BASE.replace("{kind: poisson, rate: 2.0}", "{rate: 2.0}"),
     "s.yaml:5: workload.arrival: no 'kind' given: expected kind: gamma | poisson"),
    (BASE.replace("[vllm]", "[vllm, vllm]"), "policy names must be unique"),
    (BASE.replace("[vllm]", "[{preset: vllm, block_size: 0}]"), "policies[0].block_size: Input should be greater than 0"),
    (BASE.replace("[vllm]", "[{preset: orca-max, allocator: {reserve: half}}]"),
     "policies[0].allocator.reserve: Input should be 'max', 'pow2' or 'oracle' (got 'half')"),
    (BASE.replace("[vllm]", "[{preset: vllm, preemption: pause}]"), "policies[0].preemption"),
    (BASE.replace("[vllm]", "[{preset: fastertransformer, allocator: {kind: paged}}]"),
     "static batching reserves memory per batch"),
    (BASE.replace("model: opt-13b", "model: gpt-5"), "unknown model 'gpt-5'"),
    (BASE.replace("gpu: a100-40gb", "gpu: tpu"), "unknown gpu 'tpu'"),
    (BASE.replace("gpu: a100-40gb", "gpu: {name: x, memory_gib: 10}"), "gpu.hbm_gb_per_s: required key is missing"),
    (BASE + "gpu_memory_utilization: 1.5\n", "gpu_memory_utilization: Input should be less than or equal to 1"),
    (BASE + "tensor_parallel: 0\n", "tensor_parallel: Input should be greater than 0"),
    (BASE.replace("lengths: sharegpt", "lengths: sharegpt\n  prompt: {kind: fixed, tokens: 5}"), "not both"),
    (BASE.replace("lengths: sharegpt", "prompt: {kind: uniform, low: 9, high: 3}\n  output: {kind: fixed, tokens: 1}"),
     "high (3) must be >= low (9)"),
    (BASE.replace("lengths: sharegpt", "prompt: {kind: lognormal, mean: 100, cv: 1, max: 50}\n  output: {kind: fixed, tokens: 1}"),
     "mean (100.0) must be below max (50)"),
    (BASE.replace("[vllm]", "[{preset: orca-oracle, prefix_caching: true}]"),
     "prefix_caching shares blocks: it needs the paged allocator"),
    (BASE.replace("[vllm]", "[{preset: orca-oracle, kv_offload: {cpu_gib: 64}}]"),
     "kv_offload moves evicted prefix-cache blocks to the CPU: it needs the paged allocator"),
    (BASE.replace("[vllm]", "[{preset: vllm, kv_offload: {cpu_gib: 64}}]"),
     "kv_offload keeps evicted prefix-cache blocks: it needs prefix_caching: true"),
    (BASE.replace("[vllm]", "[{preset: vllm, prefix_caching: true, kv_offload: {cpu_gib: 0}}]"),
     "kv_offload.cpu_gib: Input should be greater than 0"),
    (BASE.replace("[vllm]", "[{preset: vllm, prefix_caching: true, kv_offload: {gib: 1}}]"),
     "kv_offload.gib"),
    (BASE + "sampling: {kind: parallel, n: 1}\n", "sampling.n: Input should be greater than or equal to 2"),
    (BASE + "sampling: {kind: beam, width: 64}\n", "sampling.width: Input should be less than or equal to 63"),
    (BASE + "sampling: {kind: beam, width: 4, keep_probability: 1.5}\n", "sampling.keep_probability"),
    (BASE + "sampling: {kind: greedy}\n", "sampling"),
    (BASE.replace("num_requests: 10", "num_requests: 10\n  shared_prefixes: {lengths: [64, 128], popularity: [1]}"),
     "popularity has 1 weights for 2 lengths"),
    (BASE.replace("num_requests: 10", "num_requests: 10\n  shared_prefixes: {lengths: []}"),
     "workload.shared_prefixes.lengths: List should have at least 1 item"),
    # finished nothing, and said nothing
    (BASE + "startup_s: 10\nhorizon_s: 10\n", "s.yaml:9: startup_s: must be below horizon_s (10 s)"),
    ("[1, 2]\n", "expected a mapping of scenario keys"),
    ("name: [unclosed\n", "not valid YAML"),
])
def test_bad_scenarios_name_the_key(tmp_path, bad, expect):
    msg = err(tmp_path, bad)
    assert expect in msg, msg
    assert "Traceback" not in msg


@pytest.mark.parametrize("preset", ["orca-max", "orca-oracle-mixed", "fastertransformer"])
def test_swap_on_a_contiguous_policy_is_an_error_in_a_scenario_file(tmp_path, preset):
    """The contiguous allocator never swaps (the policy ran as recompute, saying nothing); a sweep's
    preemption axis over every policy still reaches contiguous ones (tests/test_sweep.py)."""
    msg = err(tmp_path, BASE.replace("policies: [vllm]", f"policies: [vllm, {{preset: {preset}, preemption: swap}}]"))
    assert msg.startswith(f"{tmp_path / 's.yaml'}:8: policies[1] ({preset}): preemption: swap copies"), msg
    assert "only the paged allocator does" in msg


def test_swap_with_no_swap_space_is_an_error_in_a_scenario_file(tmp_path):
    """Every preemption was recomputed, saying nothing (a sweep's axis may still reach 0)."""
    msg = err(tmp_path, BASE.replace("policies: [vllm]", "policies: [{preset: vllm, preemption: swap, swap_space_gib: 0}]"))
    assert "policies[0] (vllm): preemption: swap with swap_space_gib: 0 has no room to swap to" in msg, msg


def test_a_bare_folder_name_as_model_says_how_to_write_the_path(tmp_path):
    """`model: sub` (a folder holding config.json) was refused with "expected ... or a path to a config.json (or a
    folder holding one)": a folder it had just refused; a bare name is read as a catalog name."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "config.json").write_text("{}")
    msg = err(tmp_path, BASE.replace("model: opt-13b", "model: sub"))
    assert "unknown model 'sub'" in msg and "(a path has a '/': ./sub)" in msg, msg


@pytest.mark.parametrize("over, key", [({"name": "a\nb"}, "name"), ({"name": "\x1b[31mred"}, "name"),
                                      ({"policies": [{"preset": "vllm", "name": "x\ty"}]}, "policies[0].name"),
                                      ({"gpu": {"name": "g\x00", "memory_gib": 80, "hbm_gb_per_s": 2000, "tflops": 300}},
                                       "gpu.name")])
def test_names_are_printable(make_scenario, over, key):
    """A newline in a name split the console table's title and progress lines; an escape sequence reached the
    terminal as a command (the name printed in red)."""
    with pytest.raises(ScenarioError, match=re.escape(f"{key}: a name holds control characters")):
        make_scenario(**over)
    make_scenario(name="é 漢 [b]run[/b] <i>")  # any printable text


@pytest.mark.parametrize("policy, key", [("{preset: vllm, name: off}", "policies[1].name"),
                                         ("{preset: vllm, name: x, kv_cache_dtype: no}", "policies[1].kv_cache_dtype")])
def test_a_yaml_boolean_where_text_goes_says_to_quote_it(tmp_path, policy, key):
    """`name: off` said "Input should be a valid string (got False)": the user wrote no False."""
    msg = err(tmp_path, BASE.replace("policies: [vllm]", f"policies: [vllm, {policy}]"))
    assert f"{key}: " in msg and "(got False); YAML reads on, off, yes and no as true and false: quote such a " \
        "value" in msg, msg


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ScenarioError, match="no such scenario file"):
        load_scenario(tmp_path / "nope.yaml")


def test_every_preset_validates():
    for name in POLICY_PRESETS:
        s = parse_scenario({"name": "x", "model": "opt-13b", "gpu": "a100-40gb",
                            "workload": {"arrival": {"kind": "poisson", "rate": 1}, "lengths": "alpaca", "num_requests": 5},
                            "policies": [name]})
        assert s.policies[0].preset == name


def test_preset_fields_are_overridable():
    s = parse_scenario({"name": "x", "model": "opt-13b", "gpu": "a100-40gb",
                        "workload": {"arrival": {"kind": "poisson", "rate": 1}, "lengths": "alpaca", "num_requests": 5},
                        "policies": [{"preset": "vllm", "name": "v32", "block_size": 32, "preemption": "swap",
                                      "allocator": {"watermark": 0.05}},
                                     {"preset": "orca-oracle", "allocator": {"placement": "first-fit"}}]})
    v, o = s.policies
    assert (v.name, v.block_size, v.preemption, v.allocator.watermark) == ("v32", 32, "swap", 0.05)
    assert (o.allocator.reserve, o.allocator.placement) == ("oracle", "first-fit")


def test_model_from_config_path_relative_to_scenario(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4,'
                                                 '"intermediate_size": 512, "vocab_size": 1000, "max_position_embeddings": 512}')
    s = load_scenario(write(tmp_path, BASE.replace("model: opt-13b", "model: m/config.json")))
    assert s.model_spec().num_layers == 2
    s2 = load_scenario(write(tmp_path, BASE.replace("model: opt-13b", "model: missing/config.json")))
    with pytest.raises(ScenarioError, match="no such model config file"):
        s2.model_spec()


NUMERIC_BAD = [  # (workload or top-level override, key named in the message, what it says)
    ({"workload": {"arrival": {"kind": "poisson", "rate": 1}, "lengths": "alpaca", "num_requests": 5, "seed": -1}},
     "workload.seed", "greater than or equal to 0"),
    ({"workload": {"arrival": {"kind": "poisson", "rate": 1}, "lengths": "alpaca", "num_requests": 10**30}},
     "workload.num_requests", "less than or equal to"),
    ({"workload": {"arrival": {"kind": "poisson", "rate": 1e-308}, "lengths": "alpaca", "num_requests": 5}},
     "workload.arrival.rate", "greater than or equal to"),
    ({"workload": {"arrival": {"kind": "poisson", "rate": float("inf")}, "lengths": "alpaca", "num_requests": 5}},
     "workload.arrival.rate", "finite"),
    ({"workload": {"arrival": {"kind": "gamma", "rate": 1, "cv": 1e200}, "lengths": "alpaca", "num_requests": 5}},
     "workload.arrival.cv", "less than or equal to 100"),
    ({"workload": {"arrival": {"kind": "gamma", "rate": 1, "cv": 1e-200}, "lengths": "alpaca", "num_requests": 5}},
     "workload.arrival.cv", "greater than or equal to"),
    ({"workload": {"arrival": {"kind": "poisson", "rate": 1}, "lengths": "alpaca", "num_requests": True}},
     "workload.num_requests", "not true"),
    ({"workload": {"arrival": {"kind": "poisson", "rate": 1}, "num_requests": 5,
                   "prompt": {"kind": "lognormal", "mean": 1e20, "cv": 1}, "output": {"kind": "fixed", "tokens": 5}}},
     "workload.prompt.mean", "less than or equal to"),
    ({"workload": {"arrival": {"kind": "poisson", "rate": 1}, "num_requests": 5,
                   "prompt": {"kind": "fixed", "tokens": False}, "output": {"kind": "fixed", "tokens": 5}}},
     "workload.prompt.tokens", "not false"),
    ({"policies": [{"preset": "vllm", "swap_space_gib": float("inf")}]}, "policies[0].swap_space_gib", "finite"),
    ({"runtime_overhead_gib": float("nan")}, "runtime_overhead_gib", "finite"),
    ({"step_time": {"kind": "roofline", "gpu_overhead_s": float("inf")}}, "step_time.gpu_overhead_s", "finite"),
    ({"horizon_s": 1e300}, "horizon_s", "less than or equal to"),
    ({"tensor_parallel": True}, "tensor_parallel", "not true"),
    # an inline GPU of 1e-12 GB/s or TFLOP/s ran, its first token 6.6e13 s (two million years) after arrival
    *[({"gpu": {"name": "g", "memory_gib": 80, "hbm_gb_per_s": 2000, "tflops": 300, key: 1e-12}}, f"gpu.{key}",
       "greater than or equal to 0.001") for key in ("hbm_gb_per_s", "tflops", "host_gb_per_s", "interconnect_gb_per_s")],
]


def test_an_inline_gpu_needs_a_name(make_scenario):
    """An empty name was taken (the report and the console showed the GPU as nothing)."""
    with pytest.raises(ScenarioError, match=re.escape("gpu.name: String should have at least 1 character")):
        make_scenario(gpu={"name": "", "memory_gib": 80, "hbm_gb_per_s": 2000, "tflops": 300})


@pytest.mark.parametrize("over, key, what", NUMERIC_BAD)
def test_numbers_are_finite_bounded_and_not_booleans(make_scenario, over, key, what):
    with pytest.raises(ScenarioError, match=re.escape(key) + ".*" + re.escape(what)):
        make_scenario(**over)
