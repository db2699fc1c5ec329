"""Published figures drawn beside ours: the PagedAttention paper's memory-waste breakdown (Fig. 2).

Source: Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention",
SOSP 2023 (arXiv 2309.06180), Fig. 2: the average share of KV-cache memory per class during the §6.2
experiments (OPT models, ShareGPT/Alpaca lengths, Poisson arrivals). The paper does not say which model
or dataset the bars average, so a scenario counts as "one of the paper's" when it is that family of
experiment: an OPT model (opt-13b, opt-66b, opt-175b), a synthetic workload with the ``sharegpt`` or
``alpaca`` length preset, and Poisson arrivals.
"""

from __future__ import annotations

from dataclasses import dataclass

PAPER_CITATION = "Kwon et al., SOSP 2023, Fig. 2"
PAPER_MODELS = ("opt-13b", "opt-66b", "opt-175b")
PAPER_LENGTH_PRESETS = ("sharegpt", "alpaca")


@dataclass(frozen=True)
class PublishedBreakdown:
    """One published bar: shares in percent per memory class; ``unclassified_pct`` is what the paper
    gives without a class (vLLM's bar: 96.3 % token states, the rest not broken down)."""

    label: str
    shares_pct: dict[str, float]
    unclassified_pct: float = 0.0


# Keyed by the policy preset that re-implements the system. The paper's "external fragmentation &
# others" is drawn as external fragmentation; its Oracle bar has no internal fragmentation ("—").
FIG2: dict[str, PublishedBreakdown] = {
    "orca-max": PublishedBreakdown("Orca (Max), paper", {"token_states": 20.4, "reservation": 13.3,
                                                         "internal_fragmentation": 57.3,
                                                         "external_fragmentation": 8.9}),
    "orca-pow2": PublishedBreakdown("Orca (Pow2), paper", {"token_states": 26.8, "reservation": 17.9,
                                                           "internal_fragmentation": 13.6,
                                                           "external_fragmentation": 41.6}),
    "orca-oracle": PublishedBreakdown("Orca (Oracle), paper", {"token_states": 38.2, "reservation": 25.2,
                                                               "external_fragmentation": 36.6}),
    "vllm": PublishedBreakdown("vLLM, paper", {"token_states": 96.3}, unclassified_pct=3.7),
}


def is_paper_scenario(scenario: dict) -> bool:
    """True when a run's scenario (summary.json's ``scenario``) is one of the paper's §6.2 setups."""
    workload = scenario.get("workload") or {}
    arrival = workload.get("arrival") or {}
    return (str(scenario.get("model", "")).lower() in PAPER_MODELS
            and workload.get("kind", "synthetic") == "synthetic"
            and workload.get("lengths") in PAPER_LENGTH_PRESETS
            and arrival.get("kind") == "poisson")


# The paper's headline on ShareGPT (§6.2, Fig. 12, OPT-13B/66B/175B): vLLM's sustainable request rate as a
# multiple of each baseline's, as a range over the three models (references.md). None: not given.
SHAREGPT_RATE_RATIOS: dict[str, tuple[float | None, float]] = {
    "orca-oracle": (1.7, 2.7),
    "orca-max": (2.7, 8.0),
    "fastertransformer": (None, 22.0),  # "up to 22x"
}
