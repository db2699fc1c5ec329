"""Writes tests/hostile/cases.yaml: the hostile-input corpus (scenarios, sweeps, traces of every format,
output paths, result folders). Run it to regenerate after adding a case family:

    python tests/hostile/generate.py

Each case: the files to write into a fresh folder, the CLI arguments ({dir} is that folder), and what
must hold: exit code 2, the substrings the message must contain (the file, the key or line), no
traceback (tests/test_hostile_corpus.py).
"""

from __future__ import annotations

from pathlib import Path

import yaml

BASE = {
    "name": "h",
    "model": "opt-13b",
    "gpu": "a100-40gb",
    "workload": {"arrival": {"kind": "poisson", "rate": 2.0}, "lengths": "alpaca", "num_requests": 5, "seed": 0},
    "policies": ["vllm"],
}
BAD_NUMBERS = {"neg": -1, "zero": 0, "huge": 1e300, "inf": float("inf"), "nan": float("nan"), "true": True,
               "text": "many", "list": [1], "tiny": 1e-308}


def set_path(d: dict, path: str, value) -> dict:
    import copy

    d = copy.deepcopy(d)
    node, keys = d, path.split(".")
    for k in keys[:-1]:
        if k.isdigit():
            node = node[int(k)]
        else:
            node = node.setdefault(k, {})
    node[keys[-1]] = value
    return d


def dump(d: dict) -> str:
    return yaml.safe_dump(d, sort_keys=False, allow_unicode=True)


def scenario_cases() -> list[dict]:
    cases = []
    # (key path, the bad values that must be refused) -- every numeric field of a scenario
    fields = {
        "workload.arrival.rate": ["neg", "zero", "huge", "inf", "nan", "true", "text", "list", "tiny"],
        "workload.num_requests": ["neg", "zero", "huge", "inf", "nan", "true", "text", "list"],
        "workload.seed": ["neg", "huge", "inf", "nan", "true", "text", "list"],
        "workload.duration_s": ["neg", "zero", "huge", "inf", "nan", "true", "text"],
        "tensor_parallel": ["neg", "zero", "huge", "inf", "nan", "true", "text"],
        "gpu_memory_utilization": ["neg", "zero", "huge", "inf", "nan", "true", "text"],
        "runtime_overhead_gib": ["neg", "huge", "inf", "nan", "true", "text"],
        "activation_reserve_tokens": ["neg", "zero", "huge", "inf", "nan", "true"],
        "horizon_s": ["neg", "zero", "huge", "inf", "nan", "true"],
        "startup_s": ["neg", "huge", "inf", "nan", "true"],
        "timeline_bin_s": ["neg", "zero", "huge", "inf", "nan", "true"],
        "step_time.gpu_overhead_s": ["neg", "huge", "inf", "nan", "true"],
        "step_time.matmul_efficiency": ["neg", "zero", "huge", "inf", "nan", "true"],
        "step_time.paged_block_cost_tokens": ["neg", "huge", "inf", "nan", "true"],
        "step_time.swap_copy_overhead_s": ["neg", "huge", "inf", "nan"],
    }
    for path, bads in fields.items():
        for b in bads:
            d = set_path(BASE, path, BAD_NUMBERS[b])
            if path.startswith("step_time."):
                d["step_time"]["kind"] = "roofline"
            cases.append({"id": f"scenario/{path}={b}", "files": {"s.yaml": dump(d)},
                          "args": ["check", "{dir}/s.yaml"], "contains": ["s.yaml", path.split(".")[-1]]})
    policy_fields = {"block_size": ["neg", "zero", "huge", "inf", "true", "text"],
                     "max_num_seqs": ["neg", "zero", "huge", "true", "text"],
                     "max_num_batched_tokens": ["neg", "zero", "huge", "true"],
                     "swap_space_gib": ["neg", "huge", "inf", "nan", "true"],
                     "watermark": ["neg", "huge", "inf", "nan", "true"]}
    for key, bads in policy_fields.items():
        for b in bads:
            d = dict(BASE, policies=[{"preset": "vllm", key: BAD_NUMBERS[b]}])
            cases.append({"id": f"scenario/policies.{key}={b}", "files": {"s.yaml": dump(d)},
                          "args": ["check", "{dir}/s.yaml"], "contains": ["s.yaml", f"policies[0].{key}"]})
    lengths = {"prompt.tokens": ["neg", "zero", "huge", "true", "text"], "output.tokens": ["neg", "zero", "huge", "true"],
               "prompt.mean": ["neg", "zero", "huge", "inf", "nan", "true"], "prompt.cv": ["neg", "zero", "huge", "inf"]}
    for key, bads in lengths.items():
        for b in bads:
            part, field = key.split(".")
            dist = ({"kind": "fixed", "tokens": 5} if field == "tokens" else {"kind": "lognormal", "mean": 50, "cv": 1})
            wl = {"arrival": {"kind": "poisson", "rate": 1}, "num_requests": 5,
                  "prompt": {"kind": "fixed", "tokens": 5}, "output": {"kind": "fixed", "tokens": 5}}
            wl[part] = dict(dist, **{field: BAD_NUMBERS[b]})
            cases.append({"id": f"scenario/workload.{key}={b}", "files": {"s.yaml": dump(dict(BASE, workload=wl))},
                          "args": ["check", "{dir}/s.yaml"], "contains": ["s.yaml", f"workload.{key}"]})
    structural = {
        "unknown_top_key": (dict(BASE, modle="x"), ["s.yaml", "modle"]),
        "unknown_policy_key": (dict(BASE, policies=[{"preset": "vllm", "blok_size": 8}]), ["blok_size"]),
        "unknown_preset": (dict(BASE, policies=["vlm"]), ["vlm"]),
        "unknown_model": (dict(BASE, model="opt-13"), ["s.yaml:2", "opt-13b"]),
        "unknown_gpu": (dict(BASE, gpu="h10"), ["s.yaml:3", "h100"]),
        "missing_workload": ({k: v for k, v in BASE.items() if k != "workload"}, ["workload"]),
        "missing_policies": ({k: v for k, v in BASE.items() if k != "policies"}, ["policies"]),
        "empty_policies": (dict(BASE, policies=[]), ["policies"]),
        "duplicate_policy_names": (dict(BASE, policies=["vllm", "vllm"]), ["unique"]),
        "policies_not_list": (dict(BASE, policies="vllm"), ["policies"]),
        "workload_not_mapping": (dict(BASE, workload=[1, 2]), ["workload"]),
        "arrival_kind_unknown": (set_path(BASE, "workload.arrival.kind", "poison"), ["arrival"]),
        "lengths_preset_unknown": (set_path(BASE, "workload.lengths", "sharegtp"), ["lengths"]),
        "step_time_kind_unknown": (dict(BASE, step_time={"kind": "rooflin"}), ["step_time"]),
        "engine_unknown": (dict(BASE, step_time={"kind": "roofline", "engine": "vllm-9"}), ["engine"]),
        "profile_missing_file": (dict(BASE, step_time={"kind": "profile", "path": "nope.json"}), ["nope.json"]),
        "profile_tp2": (dict(BASE, tensor_parallel=2, step_time={"kind": "profile", "path": "p.json"}),
                        ["tensor_parallel"]),
        "trace_missing_file": (dict(BASE, workload={"kind": "trace", "path": "nope.csv"}), ["nope.csv"]),
        "model_json_missing": (dict(BASE, model="nope/config.json"), ["config.json"]),
        "top_level_list": ([1, 2, 3], ["s.yaml"]),
        "top_level_scalar": ("just text", ["s.yaml"]),
        "uniform_low_gt_high": (dict(BASE, workload={"arrival": {"kind": "poisson", "rate": 1}, "num_requests": 5,
                                                     "prompt": {"kind": "uniform", "low": 9, "high": 2},
                                                     "output": {"kind": "fixed", "tokens": 5}}), ["low"]),
        "sampling_n_one": (dict(BASE, sampling={"kind": "parallel", "n": 1}), ["sampling"]),
        "model_does_not_fit": (dict(BASE, model="opt-175b", gpu="l4"), ["opt-175b"]),
    }
    for name, (d, contains) in structural.items():
        cases.append({"id": f"scenario/{name}", "files": {"s.yaml": dump(d) if not isinstance(d, str) else d},
                      "args": ["check", "{dir}/s.yaml"], "contains": contains})
    yaml_text = {
        "alias_bomb": "".join(f"{c}: &{c} [{', '.join(['*' + p] * 10) if p else '1, 1, 1, 1, 1, 1, 1, 1, 1, 1'}]\n"
                              for p, c in zip(["", "a", "b", "c", "d", "e", "f", "g"], "abcdefgh")),
        "self_alias": "a: &a\n  b: *a\n",
        "deep_list": "a: " + "[" * 3000 + "]" * 3000 + "\n",
        "duplicate_key": "name: a\nmodel: opt-13b\nname: b\n",
        "unclosed": "name: [unclosed\n",
        "tab_indent": "name: a\n\tmodel: x\n",
        "python_tag": "name: !!python/object/apply:os.system ['echo hi']\n",
        "binary": "\x00\x01\x02",
    }
    for name, text in yaml_text.items():
        cases.append({"id": f"yaml/{name}", "files": {"s.yaml": text}, "args": ["check", "{dir}/s.yaml"],
                      "contains": ["s.yaml"]})
    return cases


TRACES = {  # format: (file name, header, a good row)
    "azure": ("t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens", "2023-11-16 18:15:46.6805900,374,44"),
    "azure2024": ("t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens", "2024-05-10 00:00:00.0,10,5"),
    "burstgpt": ("t.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type",
                 "5,ChatGPT,472,18,490,Conversation log"),
    "vidur": ("t.csv", "arrived_at,num_prefill_tokens,num_decode_tokens", "0.5,100,20"),
    "lengths": ("t.csv", "num_prefill_tokens,num_decode_tokens", "100,20"),
}


def trace_cases() -> list[dict]:
    cases = []
    for fmt, (fname, head, good) in TRACES.items():
        cols = head.split(",")
        for bad, value in {"neg": "-5", "text": "x", "frac": "2.5", "huge": "1e20", "over2_31": "2147483649",
                           "nan": "NaN", "inf": "inf", "empty": ""}.items():
            for ci, col in enumerate(cols):
                if not any(w in col.lower() for w in ("token", "prefill", "decode")) or "total" in col.lower():
                    continue
                row = good.split(",")
                row[ci] = value
                cases.append({"id": f"trace/{fmt}/{col.replace(' ', '_')}={bad}",
                              "files": {fname: f"{head}\n{good}\n{','.join(row)}\n"},
                              "args": ["trace", "info", "{dir}/" + fname], "contains": [f"{fname}:3", col]})
        cases.append({"id": f"trace/{fmt}/extra_field", "files": {fname: f"{head}\n{good}\n{good},9\n"},
                      "args": ["trace", "info", "{dir}/" + fname], "contains": [fname]})
        cases.append({"id": f"trace/{fmt}/duplicate_column",
                      "files": {fname: f"{head},{cols[-1]}\n{good},1\n"},
                      "args": ["trace", "info", "{dir}/" + fname], "contains": [fname, "more than once"]})
    jsonl = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
    for name, line in {"not_json": '{"timestamp": 1, "input_length": 5\n', "list": "[1, 2]\n",
                       "bool_tokens": '{"timestamp": 1, "input_length": true, "output_length": 1}\n',
                       "string_tokens": '{"timestamp": 1, "input_length": "5x", "output_length": 1}\n',
                       "hash_ids_text": '{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": "ab"}\n',
                       "hash_ids_mixed": '{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [1, "x"]}\n',
                       "time_back": '{"timestamp": -5, "input_length": 5, "output_length": 1}\n',
                       "missing_output": '{"timestamp": 1, "input_length": 5, "hash_ids": [1]}\n',
                       "huge_tokens": '{"timestamp": 1, "input_length": 1e20, "output_length": 1}\n'}.items():
        cases.append({"id": f"trace/mooncake/{name}", "files": {"t.jsonl": jsonl + line},
                      "args": ["trace", "info", "{dir}/t.jsonl"], "contains": ["t.jsonl:2"]})
    for name, text in {"empty": "", "header_only": "TIMESTAMP,ContextTokens,GeneratedTokens\n",
                       "unknown_columns": "a,b,c\n1,2,3\n", "binary": "\x00\xff\x00garbage",
                       "bad_timestamp": "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-13-45 99:00:00,5,5\n",
                       "unsorted": "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:47,5,5\n"
                                   "2023-11-16 18:15:46,5,5\n",
                       "all_zero_output": "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:47,5,0\n"}.items():
        cases.append({"id": f"trace/file/{name}", "files": {"t.csv": text},
                      "args": ["trace", "info", "{dir}/t.csv"], "contains": ["t.csv"]})
    cases.append({"id": "trace/file/missing", "files": {}, "args": ["trace", "info", "{dir}/nope.csv"],
                  "contains": ["nope.csv"]})
    cases.append({"id": "trace/file/folder", "files": {"d/x": ""}, "args": ["trace", "info", "{dir}/d"],
                  "contains": ["d"]})
    return cases


SWEEP_BASE = {"name": "w", "base": BASE, "axes": {"block_size": [8, 16]}}
CAP = {"slo": {"mean_normalized_latency_s": 1.0}, "min": 1, "max": 2, "relative_tolerance": 0.1}


def sweep_cases() -> list[dict]:
    cases = []
    bad = {
        "unknown_key": dict(SWEEP_BASE, axis={"a": [1]}),
        "axis_not_list": dict(SWEEP_BASE, axes={"block_size": 8}),
        "axis_empty": dict(SWEEP_BASE, axes={"block_size": []}),
        "axis_unknown_field": dict(SWEEP_BASE, axes={"blok_size": [8]}),
        "axis_bad_value": dict(SWEEP_BASE, axes={"block_size": [0, 16]}),
        "axis_bool_value": dict(SWEEP_BASE, axes={"block_size": [True]}),
        "base_missing": {"name": "w", "axes": {"block_size": [8]}},
        "base_file_missing": dict(SWEEP_BASE, base="nope.yaml"),
        "zip_unequal": dict(SWEEP_BASE, zip={"workload.seed": [1, 2], "workload.arrival.rate": [1]}),
        "slo_unknown_metric": dict(SWEEP_BASE, capacity=dict(CAP, slo={"mean_nonsense": 1})),
        "slo_nan": dict(SWEEP_BASE, capacity=dict(CAP, slo={"mean_normalized_latency_s": float("nan")})),
        "slo_inf": dict(SWEEP_BASE, capacity=dict(CAP, slo={"mean_normalized_latency_s": {"max": float("inf")}})),
        "slo_text": dict(SWEEP_BASE, capacity=dict(CAP, slo={"mean_normalized_latency_s": "fast"})),
        "slo_bool": dict(SWEEP_BASE, capacity=dict(CAP, slo={"mean_normalized_latency_s": True})),
        "slo_empty": dict(SWEEP_BASE, capacity=dict(CAP, slo={})),
        "capacity_bounds_inverted": dict(SWEEP_BASE, capacity=dict(CAP, min=5, max=1)),
        "capacity_bound_huge": dict(SWEEP_BASE, capacity=dict(CAP, min=1e-300, max=1e300)),
        "capacity_bound_inf": dict(SWEEP_BASE, capacity=dict(CAP, max=float("inf"))),
        "capacity_bound_zero": dict(SWEEP_BASE, capacity=dict(CAP, min=0)),
        "capacity_no_tolerance": dict(SWEEP_BASE, capacity={k: v for k, v in CAP.items() if k != "relative_tolerance"}),
        "capacity_unknown_key": dict(SWEEP_BASE, capacity=dict(CAP, rate={"low": 1})),
        "base_bad_number": dict(SWEEP_BASE, base=set_path(BASE, "workload.arrival.rate", -1)),
        "not_mapping": [1, 2],
    }
    for name, d in bad.items():
        key = "capacity" if name.startswith(("slo", "capacity")) else ""
        cases.append({"id": f"sweep/{name}", "files": {"w.yaml": dump(d) if not isinstance(d, list) else "[1, 2]\n"},
                      "args": ["sweep", "{dir}/w.yaml", "--out", "{dir}/out", "-j", "1", "--no-report"],
                      "contains": ["w.yaml"] + ([key] if key else [])})
    return cases


def output_cases() -> list[dict]:
    s = dump(BASE)
    return [
        {"id": "out/run_out_is_file", "files": {"s.yaml": s, "f": "x"},
         "args": ["run", "{dir}/s.yaml", "--out", "{dir}/f", "--no-report"], "contains": ["f", "not a folder"]},
        {"id": "out/run_out_under_file", "files": {"s.yaml": s, "f": "x"},
         "args": ["run", "{dir}/s.yaml", "--out", "{dir}/f/sub", "--no-report"], "contains": ["f/sub"]},
        {"id": "out/sweep_out_is_file", "files": {"w.yaml": dump(SWEEP_BASE), "f": "x"},
         "args": ["sweep", "{dir}/w.yaml", "--out", "{dir}/f"], "contains": ["not a folder"]},
        {"id": "out/report_out_is_folder", "files": {"s.yaml": s}, "run": True,
         "args": ["report", "{dir}/run", "--out", "{dir}"], "contains": ["is a folder"]},
        {"id": "out/convert_out_is_folder", "files": {"t.csv": "num_prefill_tokens,num_decode_tokens\n5,5\n"},
         "args": ["trace", "convert", "{dir}/t.csv", "{dir}"], "contains": ["is a folder"]},
        {"id": "out/profiles_out_is_file", "files": {"f": "x"},
         "args": ["profiles", "validate", "{dir}", "--out", "{dir}/f"], "contains": ["f"]},
        {"id": "result/not_a_folder", "files": {}, "args": ["report", "{dir}/nope"], "contains": ["nope"]},
        {"id": "result/empty_folder", "files": {"e/.keep": ""}, "args": ["report", "{dir}/e"], "contains": ["e"]},
        {"id": "result/summary_truncated", "files": {"s.yaml": s}, "run": True,
         "replace": {"run/summary.json": '{"scenario": {"na'}, "args": ["report", "{dir}/run"],
         "contains": ["summary.json"]},
        {"id": "result/summary_policies_not_objects", "files": {"s.yaml": s}, "run": True,
         "replace": {"run/summary.json": '{"scenario": {}, "policies": {"vllm": 5}}'},
         "args": ["report", "{dir}/run"], "contains": ["policies.vllm"]},
        {"id": "result/summary_metric_text", "files": {"s.yaml": s}, "run": True,
         "replace": {"run/summary.json": '{"scenario": {}, "policies": {"vllm": {"request_throughput": "fast"}}}'},
         "args": ["report", "{dir}/run"], "contains": ["request_throughput"]},
        {"id": "result/requests_not_parquet", "files": {"s.yaml": s}, "run": True,
         "replace": {"run/requests.parquet": "not parquet"}, "args": ["report", "{dir}/run"],
         "contains": ["requests.parquet"]},
        {"id": "result/timeline_missing", "files": {"s.yaml": s}, "run": True,
         "replace": {"run/timeline.parquet": None}, "args": ["report", "{dir}/run"],
         "contains": ["timeline.parquet"]},
        {"id": "model/config_binary", "files": {"s.yaml": dump(dict(BASE, model="m.json")), "m.json": "\x00\xff"},
         "args": ["check", "{dir}/s.yaml"], "contains": ["m.json"]},
        {"id": "model/config_not_object", "files": {"s.yaml": dump(dict(BASE, model="m.json")), "m.json": "[1]"},
         "args": ["check", "{dir}/s.yaml"], "contains": ["m.json"]},
        {"id": "model/config_missing_key", "files": {"s.yaml": dump(dict(BASE, model="m.json")),
                                                     "m.json": '{"hidden_size": 64}'},
         "args": ["check", "{dir}/s.yaml"], "contains": ["m.json", "num_attention_heads"]},
        {"id": "model/config_negative", "files": {"s.yaml": dump(dict(BASE, model="m.json")),
                                                  "m.json": '{"hidden_size": -64, "num_attention_heads": 4}'},
         "args": ["check", "{dir}/s.yaml"], "contains": ["m.json", "hidden_size"]},
        {"id": "steptime/bad_model", "files": {}, "args": ["steptime", "opt-13", "--gpu", "h100"],
         "contains": ["opt-13b"]},
        {"id": "steptime/bad_tokens", "files": {}, "args": ["steptime", "opt-13b", "--gpu", "h100", "--tokens", "x"],
         "contains": ["--tokens"]},
    ]


def main() -> None:
    cases = scenario_cases() + trace_cases() + sweep_cases() + output_cases()
    ids = [c["id"] for c in cases]
    assert len(ids) == len(set(ids)), "case ids must be unique"
    out = Path(__file__).with_name("cases.yaml")
    out.write_text("# Generated by tests/hostile/generate.py: the hostile-input corpus (one case per entry).\n"
                   + yaml.safe_dump(cases, sort_keys=False, allow_unicode=True, width=120))
    print(f"{len(cases)} cases -> {out}")


if __name__ == "__main__":
    main()
