import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.metrics import TIMELINE_COLUMNS, ItlHistogram, RequestLog, Timeline, _median_p99


def test_timeline_splits_time_exactly_and_doubles_bins():
    tl = Timeline(bin_s=1.0, max_bins=8)
    times = np.array([0.5, 0.7, 2.3])
    rows = np.column_stack([times, 2 * times, times, np.ones(3), np.zeros((3, 4)), 10 * times, np.zeros((3, 7)),
                            3 * times])
    totals = list(rows.sum(axis=0))
    by_bin = lambda w: zip(np.cumsum(times), rows)  # noqa: E731  (a row per step: finer than bins is fine too)
    tl.add(0.0, times, totals, by_bin)  # a span across bin edges: each row in the bin where it ends
    tl.add(3.5, np.array([20.0]), [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 20.0 * 50, 0, 0, 0, 0])  # idle gap: split by time
    assert tl.bin_s == 4.0  # 23.5 s fit in at most 8 bins
    df = tl.frame(capacity=50, end_s=23.5)
    assert df.busy_s.sum() == pytest.approx(3.5)
    assert df.seq_s.sum() == pytest.approx(7.0)
    assert df.mem_token_states_slot_s.sum() == pytest.approx(35.0)
    assert df.running_request_s.sum() == pytest.approx(10.5)  # 3 requests holding KV for 3.5 s
    assert df.mean_running_requests.iloc[0] == pytest.approx(10.5 / 4.0)  # all of it in the first 4 s bin
    assert df.mem_free_slot_s.sum() == pytest.approx(1000.0)
    assert df["memory.free"].iloc[-1] == pytest.approx(1.0)  # the gap's last bin is all free
    assert df.num_steps.sum() == 3 and df.num_steps.iloc[0] == 3  # all three steps end before 4 s
    assert df.bin_s.iloc[-1] == pytest.approx(23.5 - df.bin_start_s.iloc[-1])


def test_itl_histogram_quantiles_within_bin_precision():
    h = ItlHistogram()
    rng = np.random.default_rng(0)
    v = rng.lognormal(-3.5, 0.5, 50_000)
    for x in v[:20_000]:
        h.add(float(x))
    h.add_gaps([0.0, *np.cumsum(v[20_000:]).tolist()], 1)  # a span's step ends: its gaps are the values
    assert h.mean() == pytest.approx(v.mean(), rel=1e-9)  # (up to the rounding of the ends)
    for q in (0.5, 0.99):
        assert h.quantile(q) == pytest.approx(np.quantile(v, q), rel=3e-3)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(1e-5, 10.0), min_size=1, max_size=60), st.sampled_from([0.0, 0.25, 0.5, 0.9, 0.99, 1.0]))
def test_itl_quantiles_follow_numpys_rule_on_small_samples(values, q):
    """Linear between the ranks around q (n - 1), as np.percentile (vLLM's benchmark takes np.median and
    np.percentile of the gaps): the nearest rank below gave 10 ms for the median of 10 and 110 ms."""
    h = ItlHistogram()
    for x in values:
        h.add(x)
    assert h.quantile(q) == pytest.approx(np.percentile(values, 100 * q), rel=3e-3)


def test_request_frame_never_writes_through_to_the_shared_request_table():
    """The request table is built over the log's own columns (no copy: memory at 10^6 requests), but the
    request table's columns, shared by every policy's log, are copied: a frame changed in place leaves the
    next policy's requests as they were."""
    arrival, prompt, output = np.array([0.0, 1.0, 2.0]), np.array([5, 6, 7]), np.array([2, 3, 4])
    log = RequestLog(arrival, prompt, output)
    df = log.frame()
    df.loc[0, "arrival_s"] = 9.0
    df.loc[0, "prompt_tokens"] = 9
    df.loc[0, "output_tokens"] = 9
    assert arrival.tolist() == [0.0, 1.0, 2.0] and prompt.tolist() == [5, 6, 7] and output.tolist() == [2, 3, 4]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(0, 1e7, allow_nan=False) | st.integers(0, 60).map(float), min_size=1, max_size=400))
def test_median_and_p99_are_numpys_to_the_bit(values):
    """The summary's median and p99 (computed without ``np.median``/``np.percentile``, which import
    ``numpy.ma``) equal numpy's exactly, ties and all sizes included."""
    v = np.array(values)
    assert _median_p99(v.copy()) == (float(np.median(v)), float(np.percentile(v, 99)))


def test_itl_gaps_are_the_differences_of_consecutive_ends_each_weighted():
    h = ItlHistogram()
    ends = [1.0, 1.25, 1.75, 2.0]
    h.add_gaps(ends, 3)
    h.add(0.5, 2)
    assert h.count == 0 and h.mean() == pytest.approx((3 * (0.25 + 0.5 + 0.25) + 2 * 0.5) / 11)
    assert h.count == 11


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(1e-3, 3.0), min_size=1, max_size=80), st.sampled_from([0.25, 1.0]))
def test_timeline_bins_hold_the_time_of_the_steps_across_their_edges(durations, bin_s):
    """Steps back to back, each holding the whole pool: every bin they fill is busy for its width and its
    memory classes sum to 100 % (a step across an edge was charged to the bin where it ends: the mooncake
    routing scenario showed 25 % to 167 % per bin), while each step counts once, in the bin where it ends."""
    cap = 10
    tl = Timeline(bin_s=bin_s, max_bins=64)
    t = 0.0
    cols = {c: i for i, c in enumerate(TIMELINE_COLUMNS)}
    for d in durations:
        row = [0.0] * len(TIMELINE_COLUMNS)
        row[cols["busy_s"]], row[cols["num_steps"]] = d, 1
        row[cols["mem_token_states_slot_s"]], row[cols["mem_free_slot_s"]] = 0.25 * cap * d, 0.75 * cap * d
        tl.add(t, [d], row)
        t += d
    df = tl.frame(capacity=cap, end_s=t)
    assert np.allclose(df.busy_s, df.bin_s)
    full = df[df.bin_s > 1e-9]  # (a last step ending on an edge counts in a bin of no width after it)
    shares = sum(full[f"memory.{c}"] for c in ("token_states", "reservation", "internal_fragmentation",
                                                "external_fragmentation", "free"))
    assert np.allclose(shares, 1.0) and np.allclose(full["memory.token_states"], 0.25)
    ends = np.cumsum(durations)
    assert df.num_steps.tolist() == np.bincount((ends // tl.bin_s).astype(int), minlength=len(df)).tolist()
