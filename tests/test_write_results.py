"""The result tables' ``policy`` column, built at once as a categorical, is what tagging each policy's
rows and converting the whole column would give (dtype, categories and their order), empty tables too."""

import pandas as pd
import pytest

from sim.run import _policy_column


@pytest.mark.parametrize("lengths", [{"vllm": 3, "orca-max": 2, "fastertransformer": 1},
                                     {"b": 2, "a": 0, "c": 1}, {"only": 0}, {"x": 0, "y": 0}, {"z": 4}])
def test_policy_column_is_the_tagged_rows_as_a_category(lengths):
    frames = {n: pd.DataFrame({"v": pd.Series(range(k), dtype="int64")}) for n, k in lengths.items()}
    tagged = pd.concat([f.assign(policy=n) for n, f in frames.items()], ignore_index=True)
    expected = tagged["policy"].astype("category")
    got = pd.Series(_policy_column(frames), name="policy")
    pd.testing.assert_series_equal(got, expected, check_exact=True)
    assert list(got.cat.categories) == sorted(n for n, k in lengths.items() if k)
