"""Sweeps: a base scenario, axes of values for any of its fields, and an optional capacity search.

A sweep file::

    name: opt-13b-sharegpt
    base: opt-13b-sharegpt.yaml            # a scenario file (relative to this file), or a scenario mapping
    axes:                                  # crossed (cartesian product), in this order
      workload.arrival.rate: [0.5, 1, 1.5]
      seed: [0, 1, 2]                      # shorthand for workload.seed
    zip:                                   # each group: values taken together (same lengths); crossed with the rest
      - {block_size: [16, 32], preemption: [swap, recompute]}
    capacity:                              # per policy: the highest rate whose run meets the SLO
      slo: {mean_normalized_latency_s: 0.2}          # a number is an upper bound; or {max: x} / {min: y}
      min: 0.05
      max: 8
      tolerance: 0.02

An axis path names a scenario field by its dotted path (``workload.arrival.rate``, ``gpu``,
``tensor_parallel``, ``policies``). A policy's field applies to every policy of the scenario as
``policies.*.block_size``, or to one policy as ``policies.<name>.block_size``; a bare policy field
(``block_size``, ``preemption``, ``allocator.placement``) is short for ``policies.*.<field>``.

The unit of work is one *task*: one point of the grid and one of its policies, i.e. a scenario with a
single policy (a policy's results do not depend on the other policies of a scenario: each runs alone
on the same requests). A task is keyed by a hash of its resolved scenario, so finished tasks are found
again on a second run (resume), and a capacity probe that lands on a grid point reuses it.

Capacity search, per policy and per combination of the other axes: the sweep's own runs along the
capacity axis bracket the answer when the axis is swept; otherwise probing starts at ``start``
(default ``min``) and doubles up to ``max`` or halves down to ``min`` until a passing and a failing
rate bracket it. Then bisection, until the bracket is at most ``tolerance`` wide: the sustainable rate
is the bracket's passing end. Every probe count is bounded, so a search always ends: "none" when even
``min`` fails, "above max" when ``max`` passes.

Modules, one concern each: ``spec`` (the file, axes, loading), ``tasks`` (a point's policy as a keyed
task), ``capacity`` (the search), ``drive`` (running tasks on an executor, resume), ``tables`` (the
tidy tables), ``output`` (a sweep end to end, written to a folder). Import each name from its module:
this package re-exports none, so each has one path (``from sim.sweep.output import run_sweep``).
"""
