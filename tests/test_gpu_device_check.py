"""The device check as a fail-soft job: each section isolated (a failure injected in one leaves the others'
figures in the JSON), a kill leaves a valid JSON saying where it stopped, the budget is enforced; the
bundle's remote command within the device tool's limits and written in the README; the padded decode
step that the CUDA graphs capture computes what the eager step computes."""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import shared_trace
from gpu_helpers import require_backend

ROOT = Path(__file__).resolve().parents[1]
AZURE = "azure_2023/AzureLLMInferenceTrace_conv.csv"

torch = require_backend()


def run_check(tmp_path, *args) -> tuple[int, dict]:
    """gpu/check.py --device cpu --quick in this process (the CPU path; the kernel cases in a child)."""
    from gpu import check

    out = tmp_path / "check.json"
    rc = check.main(["--device", "cpu", "--quick", "--out", str(out), "--trace", str(shared_trace(AZURE)), *args])
    return rc, json.loads(out.read_text())


def test_a_failure_in_kernels_or_replay_leaves_bandwidth_and_calibration(tmp_path):
    rc, fig = run_check(tmp_path, "--inject-failure", "kernels", "--inject-failure", "replay")
    st = {n: s["status"] for n, s in fig["sections"].items()}
    assert st == {"kernels": "error", "bandwidth": "ok", "calibration": "ok", "replay": "error",
                  "validation": "error"} and rc == 1
    for name in ("kernels", "replay"):
        assert "injected failure in " + name in fig["sections"][name]["error"]
        assert "InjectedFailure" in fig["sections"][name]["traceback"]
    assert "no result from replay" in fig["sections"]["validation"]["error"]  # names what it depends on
    assert fig["bandwidth"]["decode_attention"] and fig["calibration"]["num_points"] > 0
    assert fig["injected_failures"] == ["kernels", "replay"]


def test_a_failure_in_bandwidth_or_calibration_leaves_kernels_and_replay(tmp_path):
    rc, fig = run_check(tmp_path, "--inject-failure", "bandwidth", "--inject-failure", "calibration")
    st = {n: s["status"] for n, s in fig["sections"].items()}
    assert st == {"kernels": "ok", "bandwidth": "error", "calibration": "error", "replay": "ok",
                  "validation": "error"} and rc == 1
    k = fig["kernels"]
    assert k["complete"] and k["num_failed"] == 0 and k["broken_case_caught"] is True
    assert fig["replay"]["sizing"]["rule"].startswith("no calibrated profile")  # sized without a prediction
    assert fig["replay"]["sizing"]["num_requests"] == fig["settings"]["min_requests"]
    assert set(fig["replay"]["policies"]) == {"vllm", "orca-max"}
    assert "no result from calibration" in fig["sections"]["validation"]["error"]


def test_the_whole_check_passes_with_the_default_relative_out(tmp_path, monkeypatch):
    """As the README runs it (the default ``--out``, relative): the replay reads the calibrated profile
    through the scenario it writes in the work folder, so the profile's path must not be relative."""
    from gpu import check

    monkeypatch.chdir(tmp_path)
    rc = check.main(["--device", "cpu", "--quick", "--trace", str(shared_trace(AZURE))])
    fig = json.loads((tmp_path / "runs" / "device_check_cpu.json").read_text())  # not the committed GPU record
    assert {n: s["status"] for n, s in fig["sections"].items()} == dict.fromkeys(check.SECTIONS, "ok") and rc == 0
    assert (tmp_path / "runs" / "device_check_cpu_files" / "profile.json").is_file()
    assert not (tmp_path / "reports").exists()
    assert fig["replay"]["sizing"]["rule"] != "" and not fig["replay"]["sizing"]["rule"].startswith("no calibrated")


def test_a_kill_leaves_a_valid_json_saying_where_it_stopped(tmp_path):
    out = tmp_path / "check.json"
    p = subprocess.Popen([sys.executable, str(ROOT / "gpu" / "check.py"), "--device", "cpu", "--quick", "--out",
                          str(out)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while not out.exists() and time.time() < deadline:  # the first write: kernels running
            time.sleep(0.1)
        assert out.exists(), "no JSON written"
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        p.kill()
    fig = json.loads(out.read_text())
    assert fig["sections"]["kernels"]["status"] == "terminated" and fig["provenance"]["device_type"] == "cpu"
    assert not (tmp_path / "check.json.tmp").exists()


def test_the_budget_is_enforced(tmp_path):
    """A budget under the reserve: every section is recorded as not run, and the JSON is complete."""
    rc, fig = run_check(tmp_path, "--budget-s", "5")
    assert {s["status"] for s in fig["sections"].values()} == {"not_run"} and rc == 0
    assert len(fig["targets"]) == 7 and all(t["measured"] is None for t in fig["targets"])


@pytest.mark.parametrize("args, message", [
    (["--budget-s", "0"], "--budget-s 0.0: expected seconds above 0"),
    (["--budget-s", "nan"], "--budget-s nan: expected seconds above 0"),
    (["--layers", "0"], "--layers 0: expected 1 to "),
    (["--layers", "100000"], "--layers 100000: expected 1 to "),
    (["--out", "{tmp}"], "is a folder (give the name of a file to write)"),
    (["--out", "{tmp}/f/x.json"], "its folder {tmp}/f: exists and is not a folder"),
    (["--work", "{tmp}/f"], "exists and is not a folder"),
    # a typo skipped the trace sections (exit 0 on the CPU); an empty file was a pandas error naming no file
    (["--trace", "{tmp}/nope.csv"], "--trace {tmp}/nope.csv: no such file"),
    (["--trace", "{tmp}/f"], "--trace {tmp}/f: not the Azure LLM inference trace (expected the header TIMESTAMP,")])
def test_bad_flags_stop_before_anything_runs(tmp_path, capsys, args, message):
    """Checked up front: a bad --out failed only when the figures were written, after a GPU's whole budget."""
    from gpu import check

    _refused(check.main, ["--device", "cpu", "--quick"], "c.json", tmp_path, capsys, args, message)


def _refused(main, fixed: list[str], default_out: str, tmp_path, capsys, args, message) -> None:
    """``main(fixed + args)`` (``--out`` default_out unless given; ``{tmp}`` in args is tmp_path, which holds a
    file ``f``) exits 2 with ``message`` and writes nothing."""
    (tmp_path / "f").write_text("")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    out = [] if "--out" in args else ["--out", str(tmp_path / default_out)]
    with pytest.raises(SystemExit) as e:
        main([*fixed, *out, *args])
    assert e.value.code == 2 and message.replace("{tmp}", str(tmp_path)) in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # nothing written


def test_unknown_injected_section_is_refused(tmp_path, monkeypatch):
    from gpu import check

    monkeypatch.setenv("KVSIM_INJECT_FAILURE", "kernel")
    with pytest.raises(SystemExit):
        check.main(["--device", "cpu", "--out", str(tmp_path / "c.json")])


# ------------------------------------------------------------------------------------------ bundle


def test_the_remote_command_fits_the_device_tool_and_is_the_readmes():
    from gpu.device_bundle import CARRY, FILES_BACK, REMOTE_COMMAND, check_command

    check_command()
    assert len(REMOTE_COMMAND) <= 2000 and len(FILES_BACK) <= 8 and len(CARRY) <= 8
    for f in ("device_check.json", "check.log", "pip.log", "profile.json", "validation.json"):
        assert "$OUT/" + f in REMOTE_COMMAND or f in REMOTE_COMMAND
    assert "--no-index --no-deps" in REMOTE_COMMAND and "--target /tmp/site" in REMOTE_COMMAND
    assert "PYTHONPATH=/tmp/site" in REMOTE_COMMAND and "--budget-s 420" in REMOTE_COMMAND
    readme = (ROOT / "README.md").read_text()
    assert REMOTE_COMMAND in readme, "the README's device command is not gpu/device_bundle.py's REMOTE_COMMAND"
    p = subprocess.run(["git", "check-ignore", "-q", ".device/wheels/x.whl"], cwd=ROOT)
    assert p.returncode == 0, ".device/ must be git-ignored (it is carried, not committed)"
    with pytest.raises(ValueError, match="at most 2000"):
        check_command("x" * 2001)
    with pytest.raises(ValueError, match="timeout"):
        check_command(REMOTE_COMMAND.replace("timeout -k 15 450", "timeout -k 15 470"))


@pytest.mark.parametrize("args, message", [(["--out", "{tmp}/f"], "exists and is not a folder"),
                                           (["--out", "{tmp}/f/x"], "cannot create the folder"),
                                           (["--max-mib", "nan"], "--max-mib nan: expected MiB above 0")])
def test_bundle_bad_flags_are_one_line(tmp_path, capsys, args, message):
    from gpu import device_bundle

    _refused(device_bundle.main, ["--no-wheels"], "b", tmp_path, capsys, args, message)


def test_a_bundle_outside_device_is_measured_too(tmp_path, capsys):
    """--max-mib holds wherever --out is (a bundle elsewhere was not measured at all)."""
    from gpu import device_bundle

    csv = tmp_path / "azure.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "2023-11-16 18:15:46.6805900,374,44\n" * 3)
    args = ["--no-wheels", "--trace", str(csv), "--rows", "2", "--out", str(tmp_path / "b")]
    assert device_bundle.main([*args, "--max-mib", "0.0001"]) == 1
    assert "too large" in capsys.readouterr().err
    assert device_bundle.main([*args, "--max-mib", "1000"]) == 0
    assert f"once {tmp_path / 'b'} is moved to .device" in capsys.readouterr().out


def test_the_bundle_records_the_commit_the_device_runs(tmp_path, monkeypatch):
    from gpu import check, device_bundle

    src = device_bundle.git_source()
    assert re.fullmatch(r"[0-9a-f]{40}", src["commit"]) and isinstance(src["changed"], list)
    (tmp_path / ".device").mkdir()
    (tmp_path / ".device" / "MANIFEST.json").write_text(json.dumps({"source": src}))
    monkeypatch.setattr(check, "ROOT", tmp_path)
    assert check.bundle_source() == src
    monkeypatch.setattr(check, "ROOT", tmp_path / "nowhere")
    assert check.bundle_source() is None


def test_the_trace_slice_is_the_traces_first_rows(tmp_path):
    from gpu.azure import azure_requests
    from gpu.device_bundle import write_trace_slice

    src = shared_trace(AZURE)
    info = write_trace_slice(src, tmp_path / "slice.csv", 50)
    lines = (tmp_path / "slice.csv").read_bytes().splitlines(keepends=True)
    with open(src, "rb") as f:
        want = [next(f) for _ in range(51)]
    assert lines == want and info["rows"] == 50 and info["license"] == "CC-BY-4.0"
    a, b = azure_requests(tmp_path / "slice.csv", 50), azure_requests(src, 50)
    assert (a.prompt_tokens == b.prompt_tokens).all() and (a.arrival_s == b.arrival_s).all()
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(SystemExit, match="not the Azure LLM inference trace"):
        write_trace_slice(bad, tmp_path / "x.csv", 1)
    one = tmp_path / "one.csv"
    one.write_bytes(lines[0] + lines[1])
    with pytest.raises(SystemExit, match="only 1 rows, fewer than --rows 5"):
        write_trace_slice(one, tmp_path / "y.csv", 5)


# ------------------------------------------------------------------------------------------ graphs


@pytest.mark.parametrize("groups", [False, True], ids=["one-group", "two-groups"])
def test_the_padded_decode_step_computes_the_eager_step(groups):
    """``DecodeGraphs`` pads a decode batch to its bucket (slots -1, block 0) and reads a block table as
    wide as its context bucket; run eagerly (capture=False, the CPU), it must give the eager step's tokens
    and leave the pool exactly as the eager step does: padding writes nothing. Two KV groups (layer 0 a
    window of 2 keys, the hybrid allocator's way): a slot row and tables per group, block 0 of the window
    group's decode tables dropped (-1)."""
    from gpu.executor import DecodeGraphs, TorchExecutor, step_log_summary
    from gpu.kv_cache import KvCache, KvGroups
    from gpu.model import LlamaModel, ModelShape
    from sim.core import StepPlan
    from sim.kv import KvPool

    shape = ModelShape("t", 2, 64, 4, 2, 16, 96, 128, 256, layer_windows=(2, 0) if groups else ())
    model = LlamaModel.random(shape, "cpu", torch.float32, seed=3)
    pool = KvPool(10, 16, 2 * 2 * 2 * 16 * 4, 0, 0, 0)
    prompts = {0: 5, 1: 18, 2: 3}
    runs = {}
    for graphs in (False, True):
        layers = KvGroups((0, 1), (0, 0), 1) if groups else None  # two groups: pages of one layer each
        cache = KvCache(shape, pool, torch.device("cpu"), torch.float32, layers)
        ex = TorchExecutor(model, cache, prompts, paged=True, attention="triton", decode_graphs=graphs)
        order = list(range(10))[::-1]  # blocks handed out from the top, so block 0 is nobody's
        tables = {0: order[0:1], 1: order[1:3], 2: order[3:4]}
        other = {0: order[4:5], 1: order[5:7], 2: order[7:8]}  # the full group's (two groups)
        ids, new = (0, 1, 2), (5, 18, 3)

        def plan(news, cached):
            extra = {}
            if groups:  # a decode at 18 sees keys 17, 18: block 0 of sequence 1 dropped from the window group
                window = [[-1, *tables[i][1:]] if c >= 18 else tables[i] for i, c in zip(ids, cached)]
                extra["group_tables"] = [window, [other[i] for i in ids]]
            return StepPlan.from_entries(ids, news, cached, 3, 16, block_tables=tuple(tables[i] for i in ids),
                                         extra=extra)

        tokens = [ex.run(plan(new, (0, 0, 0)))]
        for step in range(2):
            cached = tuple(n + step for n in new)
            ex.step_time_s(plan((1, 1, 1), cached))
        tokens.append([ex.tokens[i][-2:] for i in ids])
        runs[graphs] = (tokens, cache.kv.clone(), ex)
    assert runs[True][0] == runs[False][0]
    assert torch.equal(runs[True][1], runs[False][1])
    assert not runs[True][1][:, :, 0].any()  # block 0 (the padding's) never written
    ex = runs[True][2]
    assert isinstance(ex.graphs, DecodeGraphs) and set(ex.graphs.entries) == {(4, 512)}
    ex.release()
    assert ex.graph_info["buckets"] == [(4, 512)] and ex.graph_info["disabled"] is None and ex.graphs is None
    log = step_log_summary(ex.step_log)
    assert log["graph"]["num_steps"] == 2 and log["graph"]["median_gpu_s"] is None  # the CPU: host time only
    assert log["graph"]["median_host_s"] > 0 and log["graph"]["host_bound_fraction"] is None


def test_a_steps_host_work_is_outside_its_timing(monkeypatch):
    """Everything a step does on the host (its inputs as lists, staged in pinned tensors, or a decode graph's
    buffer filled) happens before the timed part starts, which holds only copies and launches. Filling
    the graph buffer's block tables inside the CUDA events once made paged decode steps on an H200 read
    1.9x slower than contiguous ones at 256 sequences."""
    from gpu import executor
    from gpu.executor import DecodeGraphs, TorchExecutor
    from gpu.kv_cache import KvCache
    from gpu.model import LlamaModel, ModelShape
    from sim.core import StepPlan
    from sim.kv import KvPool

    timing, calls = [False], []
    real_timed = executor.host_and_device_s

    def timed(device, fn):
        timing[0] = True
        try:
            return real_timed(device, fn)
        finally:
            timing[0] = False

    def spy(cls, name):
        real = getattr(cls, name)

        def wrapped(self, *a, **k):
            calls.append((name, timing[0]))
            return real(self, *a, **k)
        monkeypatch.setattr(cls, name, wrapped)

    monkeypatch.setattr(executor, "host_and_device_s", timed)
    for cls, name in ((TorchExecutor, "host_inputs"), (TorchExecutor, "stage"), (DecodeGraphs, "fill")):
        spy(cls, name)
    shape = ModelShape("t", 1, 64, 4, 2, 16, 96, 128, 256)
    for paged in (True, False):
        cache = KvCache(shape, KvPool(8, 16, 2 * 2 * 16 * 4, 0, 0, 0), torch.device("cpu"), torch.float32)
        ex = TorchExecutor(LlamaModel.random(shape, "cpu", torch.float32, seed=1), cache, {0: 5, 1: 9},
                           paged=paged, attention="triton", decode_graphs=True)

        def plan(news, cached):
            where = {"block_tables": ((7,), (6,))} if paged else {"slab_starts": (0, 64)}
            return StepPlan.from_entries((0, 1), news, cached, 2, 16, **where)

        ex.step_time_s(plan((5, 9), (0, 0)))  # eager: a prefill
        ex.step_time_s(plan((1, 1), (5, 9)))  # a decode graph's bucket
    assert {name for name, _ in calls} == {"host_inputs", "stage", "fill"}
    assert not [c for c in calls if c[1]], calls


def test_every_way_of_measuring_a_ceiling_runs_and_the_best_is_taken(monkeypatch):
    """The copy and read ceilings are the best of several ways (torch's copy, a Triton copy kernel, Triton
    sums of three grid shapes, torch's sum), each checked for its result; a way that fails is recorded
    with its error and the others still give the figure."""
    from gpu import bench

    ceil = bench.ceilings(torch.device("cpu"), 1 << 16, 5, every_way=True)
    for kind, ways in (("copy", 2), ("read", 4)):
        rows = ceil[kind]["variants"]
        assert len(rows) == ways and all(r["gb_per_s"] > 0 for r in rows)
        assert ceil[kind]["gb_per_s"] == max(r["gb_per_s"] for r in rows)
    monkeypatch.setattr(bench, "stream_copy", lambda x, y, block=0: None)  # a copy that copies nothing
    ceil = bench.ceilings(torch.device("cpu"), 1 << 16, 5, every_way=True)
    bad = [r for r in ceil["copy"]["variants"] if "error" in r]
    assert len(bad) == 1 and "not its input" in bad[0]["error"] and ceil["copy"]["way"] == "torch copy_"


def test_the_decode_grid_times_each_shape_at_both_pipeline_depths():
    """On a GPU every grid point is timed at the default depth and at Triton's 3 stages; each row's paging
    overhead is against the contiguous kernel launched alike; the targets read the default rows."""
    import time as _time

    from gpu import bench, check

    ceil = {"copy": {"gb_per_s": 1.0}, "read": {"gb_per_s": 1.0}}
    rows = bench.decode_grid(torch.device("cpu"), (4, 2, 16), (2,), (64,), ceil, rounds=1, rep_ms=1,
                             deadline=_time.perf_counter() + 600, stage_variants=True)
    by = {r["variant"]: r for r in rows}
    assert set(by) == {"paged", "contiguous", "paged_3_stages", "contiguous_3_stages"}
    assert by["paged_3_stages"]["num_stages"] == by["contiguous_3_stages"]["num_stages"] == 3
    for v in ("paged", "paged_3_stages"):
        twin = by[v.replace("paged", "contiguous")]
        assert by[v]["paging_overhead"] == by[v]["time_s"] / twin["time_s"] == twin["paging_overhead"]
    for r in rows:
        r["batch"], r["context"] = 64, 4096  # as if measured at the targets' shape
    got = check.targets({"bandwidth": {"decode_attention": rows}})
    assert got[1]["measured"] == by["paged"]["paging_overhead"]  # the default launch's row, not 3 stages'


@pytest.mark.parametrize("args, message", [
    (["--device", "cpu"], "needs a GPU"),
    (["--device", "foo"], "expected cuda or cpu"),
    (["--points", "1x0"], "BATCHxCONTEXT pairs of positive integers"),
    (["--points", "abc"], "BATCHxCONTEXT pairs of positive integers"),
])
def test_decode_breakdown_bad_input_is_one_line(tmp_path, capsys, args, message):
    from gpu import decode_breakdown

    try:
        rc = decode_breakdown.main(["--out", str(tmp_path / "b.json"), *args])
    except SystemExit as e:  # argparse's error
        rc = e.code
    assert rc == 2 and message in capsys.readouterr().err and not (tmp_path / "b.json").exists()


def test_decode_graph_buckets():
    from gpu.executor import BATCH_BUCKETS, DecodeGraphs

    g = DecodeGraphs.__new__(DecodeGraphs)
    g.max_batch, g.cache = BATCH_BUCKETS[-1], type("C", (), {"block_size": 16})()
    assert g.bucket(1, 1) == (1, 512) and g.bucket(3, 513) == (4, 1024) and g.bucket(200, 4096) == (256, 4096)
    assert g.bucket(BATCH_BUCKETS[-1] + 1, 10) is None  # past the largest bucket: eager
    with pytest.raises(ValueError, match="need the triton attention"):
        from gpu.executor import TorchExecutor
        from gpu.kv_cache import KvCache
        from gpu.model import LlamaModel, ModelShape
        from sim.kv import KvPool

        shape = ModelShape("t", 1, 64, 4, 2, 16, 96, 128, 256)
        cache = KvCache(shape, KvPool(4, 16, 1, 0, 0, 0), torch.device("cpu"), torch.float32)
        TorchExecutor(LlamaModel.random(shape, "cpu", torch.float32), cache, {}, paged=True, attention="torch",
                      decode_graphs=True)


def _gpu_check(tmp_path, trace=None, missing=()):
    """A Check for device "cuda" on this machine: only the decisions (no CUDA call is made)."""
    from gpu import check

    ctx = check.Check(torch.device("cuda"), dict(check.SETTINGS["cuda"]), tmp_path / "c.json", tmp_path, 400, set(),
                      trace, ["/nowhere/a.csv", "/nowhere/b.csv"], False)
    ctx.fig = {"preflight": {"missing_packages": list(missing)}, "sections": {}}
    return ctx


def test_on_a_gpu_a_missing_trace_or_package_is_an_error_naming_it(tmp_path):
    ctx = _gpu_check(tmp_path)
    ctx.section("calibration", ["calibration", "replay", "validation"])
    rec = ctx.fig["sections"]["calibration"]
    assert rec["status"] == "error" and "/nowhere/a.csv, /nowhere/b.csv" in rec["error"]
    ctx.section("validation", ["validation"])  # it reads the replay of the trace: named the same way
    assert "/nowhere/a.csv" in ctx.fig["sections"]["validation"]["error"]
    ctx = _gpu_check(tmp_path, trace=Path("t.csv"), missing=("simpy", "pynvml"))
    ctx.section("replay", ["replay", "validation"])
    rec = ctx.fig["sections"]["replay"]
    assert rec["status"] == "error" and rec["error"].startswith("needs simpy, not installed")
    assert json.loads((tmp_path / "c.json").read_text())["sections"]["replay"]["status"] == "error"


def test_a_failed_or_unfinished_kernel_check_sends_the_gpu_to_the_torch_path(tmp_path):
    from gpu.check import REPLAY_KERNELS

    ctx = _gpu_check(tmp_path)
    rows = [{"kernel": k, "layout": layout, "dtype": dt, "ok": True} for k, layout, dt in sorted(REPLAY_KERNELS)]
    for kernels, status, backend, reason in (({"num_failed": 0, "rows": rows}, "ok", "triton", None),
                                             ({"num_failed": 0, "rows": rows}, "error", "triton", None),  # cut short
                                             ({"num_failed": 2, "rows": rows}, "ok", "torch", "2 kernel check(s) failed"),
                                             ({"num_failed": 0, "rows": rows[1:]}, "error", "torch",
                                              "did not complete (error): 1 of the replay's kernels unchecked"),
                                             (None, "error", "torch", "did not complete (error)")):
        ctx.fig.update(kernels=kernels, sections={"kernels": {"status": status}})
        ctx.choose_attention()
        assert ctx.attention == backend and ctx.fig["attention"]["fallback"] == (backend == "torch")
        if reason:
            assert reason in ctx.fig["attention"]["reason"] and "PyTorch attention" in ctx.fig["attention"]["reason"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer of a machine without a CUDA device")
def test_no_cuda_device_is_one_error_and_a_json_saying_so(tmp_path, monkeypatch):
    """`--device cuda` where torch sees no CUDA device: exit 2, one line, and the JSON written with the
    error (it was a traceback and no JSON; without pydantic the ImportError stood in for the cause)."""
    from gpu import check
    import gpu.device

    out = tmp_path / "check.json"
    assert check.main(["--device", "cuda", "--out", str(out)]) == 2
    assert "sees no CUDA device" in json.loads(out.read_text())["error"]
    assert check.main(["--device", "cuda:x", "--out", str(out)]) == 2
    assert "expected cpu, cuda or cuda:N" in json.loads(out.read_text())["error"]
    monkeypatch.setitem(sys.modules, "sim.config", None)  # as on the device image before its wheels: no pydantic
    assert "sees no CUDA device" in str(gpu.device._user_error("--device cuda: torch sees no CUDA device"))


@pytest.mark.parametrize("text,message", [
    ("TIMESTAMP,Ctx,GeneratedTokens\n2023-11-16 18:15:46.68,5,3\n", "missing column(s) ContextTokens"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,5,3\n2023-11-16 18:15:47.68,x,3\n",
     "t.csv:3: ContextTokens = 'x', expected a whole number of tokens >= 0"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,5,-3\n",
     "t.csv:2: GeneratedTokens = -3, expected a whole number"),  # (clipped to 1, silently)
    ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,5,3\n", "t.csv:2: TIMESTAMP = 'yesterday', expected a date"),
])
def test_the_device_checks_trace_reader_names_file_line_and_column(tmp_path, text, message):
    """It raised KeyError: ContextTokens or a TypeError, naming no file."""
    from gpu.azure import azure_requests

    (tmp_path / "t.csv").write_text(text)
    with pytest.raises(ValueError, match=re.escape(message)):
        azure_requests(tmp_path / "t.csv", 10)


def test_a_trace_of_a_header_alone_is_refused(tmp_path):
    from gpu.check import azure_trace_problem

    p = tmp_path / "h.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    assert azure_trace_problem(p) == "no requests after the header"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n")
    assert azure_trace_problem(p) is None and azure_trace_problem(tmp_path) == "not a file"
