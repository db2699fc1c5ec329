"""Figures and HTML pages built from result tables (summary.json, requests/steps parquet).

Nothing here computes a metric the simulator owns: it reads them and draws them."""


class ResultsError(ValueError):
    """A folder a report cannot be built from; the message is one line naming the folder and what is wrong.
    (Here, not in ``reports.results``: the command line catches it without loading pandas.)"""
