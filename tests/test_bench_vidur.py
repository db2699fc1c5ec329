"""benchmarks/bench_vidur.py's inputs for Vidur, without Vidur: the trace it replays is the requests
``sim run`` simulates (same truncation), and the attention profile it writes is one Vidur's filters keep."""

import csv
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_vidur", ROOT / "benchmarks" / "bench_vidur.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_vidur_trace_is_the_scenarios_requests(tmp_path):
    b = _bench()
    azure = tmp_path / "azure.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:15:46.6805900,374,44\n"
                     "2023-11-16 18:15:50.9951690,5000,10\n"  # prompt over the 4,096-token model: cut
                     "2023-11-16 18:15:51.5000000,4000,500\n")  # prompt fits, output cut to what is left
    t = b.scenario_requests(b.scenario(azure))
    out = tmp_path / "vidur.csv"
    b.write_vidur_trace(t.arrival_s, t.prompt_tokens, t.output_tokens, out)
    rows = list(csv.DictReader(out.open()))
    assert list(rows[0]) == ["Date", "Time", "PromptTokenCount", "CompletionTokenCount"]
    assert [r["Date"] for r in rows] == [b.VIDUR_DATE] * 3
    assert [round(float(r["Time"]), 6) for r in rows] == [0.0, 4.314579, 4.81941]
    assert [(int(r["PromptTokenCount"]), int(r["CompletionTokenCount"])) for r in rows] == [
        (374, 44), (4095, 1), (4000, 96)]
    # Vidur's trace replay asserts every request fits its max_tokens
    assert all(int(r["PromptTokenCount"]) + int(r["CompletionTokenCount"]) <= b.MAX_TOKENS for r in rows)


def test_attention_profile_has_what_vidur_trains_on(tmp_path):
    b = _bench()
    out = tmp_path / "attention.csv"
    b.write_attention_profile(out)
    rows = list(csv.DictReader(out.open()))
    # the columns Vidur 0.0.26 filters on must hold the model's shape (Llama-2-70B, TP 4, blocks of 16)
    assert {(r["n_embd"], r["n_q_head"], r["n_kv_head"], r["block_size"], r["num_tensor_parallel_workers"])
            for r in rows} == {("8192", "64", "8", str(b.BLOCK_SIZE), str(b.TP))}
    prefill = [r for r in rows if r["prefill_chunk_size"] != "0"]
    decode = [r for r in rows if r["prefill_chunk_size"] == "0"]
    assert prefill and decode
    assert all(float(r["time_stats.attn_prefill.median"]) > 0 for r in prefill)
    assert all(int(r["prefill_chunk_size"]) + int(r["kv_cache_size"]) <= 4096 for r in prefill)

    def decode_ms(batch, kv):
        (r,) = [r for r in decode if r["batch_size"] == str(batch) and r["kv_cache_size"] == str(kv)]
        return float(r["time_stats.attn_decode.median"])

    # decode attention reads every cached key: more keys, more sequences -> more time
    assert 0 < decode_ms(1, 256) < decode_ms(1, 4096) < decode_ms(128, 4096)
    assert max(int(r["batch_size"]) for r in decode) == b.MAX_SEQS
