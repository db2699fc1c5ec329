"""The public traces the readers take, where their publishers host them, and the checksum of each.

Every URL names the upstream file at a fixed commit of its official repository (GitHub's raw file
links), so a download is the same bytes every time; the Azure 2024 week-long traces are published as
links to Azure blob storage in the dataset's page (``AzureLLMInferenceDataset2024.md``), which are used
as given. ``file`` is the path inside a traces folder: the layout of ``../shared/traces``, which the
tests, benchmarks and scenarios (``path: traces:FILE``) search (see ``sim.trace_paths``).

Checksums (SHA-256): of the files in ``../shared/traces`` (listed in its README, each byte-identical
to upstream at the commit named), and for ``azure-2023-code`` and ``vidur-splitwise-code`` of the blob
in the upstream repository at the same commit. ``None`` where no copy was at hand to hash (BurstGPT,
the Mooncake tool-agent and arXiv traces, the Azure 2024 week-long files): ``sim trace fetch`` then
prints the SHA-256 it computed and says the file could not be verified.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PublicTrace:
    name: str
    file: str  # path inside a traces folder
    url: str
    sha256: str | None  # None: not known, the download cannot be verified
    size_bytes: int | None
    license: str
    cite: str
    source: str  # repository @ commit : path (or the page that publishes the link)
    format: str  # the reader that takes it (`sim trace info` detects it)


def _github(repo: str, commit: str, path: str) -> str:
    return f"https://raw.githubusercontent.com/{repo}/{commit}/{path}"


AZURE = ("Azure/AzurePublicDataset", "b469a113cedca53ddc3bdea71a143dc4b7d8700c")
VIDUR = ("microsoft/vidur", "7d47513363ec447a741ac5e47241580b47724fbf")
MOONCAKE = ("kvcache-ai/Mooncake", "3b5a594133958449a1feaf1c9e0fc1b553e34a28")
SARATHI = ("microsoft/sarathi-serve", "72339db5b120614033b317880ad3a05a5e4c9415")
ETALON = ("project-etalon/etalon", "d5f18de15a2227a2d469365afc4fa9e2df0c631d")
BURSTGPT = ("HPMLL/BurstGPT", "e92f533b6c85ea7f4164fb3d97d1aa2c3edacbc8")
AZURE_2024_BLOB = "https://azurepublicdatasettraces.blob.core.windows.net/azurellminfererencetrace"

SPLITWISE = "Patel et al., Splitwise, ISCA 2024"
MOONCAKE_CITE = "Qin et al., Mooncake, FAST 2025"


def _entry(name: str, file: str, repo_commit: tuple[str, str] | None, path: str, sha256: str | None,
           size: int | None, license: str, cite: str, fmt: str, url: str | None = None) -> PublicTrace:
    if repo_commit is not None:
        repo, commit = repo_commit
        url, source = _github(repo, commit, path), f"{repo} @ {commit[:8]} : {path}"
    else:
        source = path
    return PublicTrace(name, file, url, sha256, size, license, cite, source, fmt)


CATALOG: dict[str, PublicTrace] = {t.name: t for t in [
    _entry("azure-2023-conv", "azure_2023/AzureLLMInferenceTrace_conv.csv", AZURE,
           "data/AzureLLMInferenceTrace_conv.csv",
           "2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8", 719_188, "CC-BY-4.0", SPLITWISE,
           "azure"),
    _entry("azure-2023-code", "azure_2023/AzureLLMInferenceTrace_code.csv", AZURE,
           "data/AzureLLMInferenceTrace_code.csv",
           "54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6", 320_117, "CC-BY-4.0", SPLITWISE,
           "azure"),
    _entry("azure-2024-conv", "azure_2024/AzureLLMInferenceTrace_conv_1week.csv", None,
           "Azure/AzurePublicDataset : AzureLLMInferenceDataset2024.md (download link)", None, None, "CC-BY-4.0",
           "Stojkovic et al., DynamoLLM, HPCA 2025", "azure",
           url=f"{AZURE_2024_BLOB}/AzureLLMInferenceTrace_conv_1week.csv"),
    _entry("azure-2024-code", "azure_2024/AzureLLMInferenceTrace_code_1week.csv", None,
           "Azure/AzurePublicDataset : AzureLLMInferenceDataset2024.md (download link)", None, None, "CC-BY-4.0",
           "Stojkovic et al., DynamoLLM, HPCA 2025", "azure",
           url=f"{AZURE_2024_BLOB}/AzureLLMInferenceTrace_code_1week.csv"),
    _entry("burstgpt", "burstgpt/BurstGPT_1.csv", BURSTGPT, "data/BurstGPT_1.csv", None, None, "CC-BY-4.0",
           "Wang et al., BurstGPT, KDD 2025", "burstgpt"),
    _entry("mooncake-conversation", "mooncake/conversation_trace.jsonl", MOONCAKE,
           "FAST25-release/traces/conversation_trace.jsonl",
           "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df", 3_029_533, "Apache-2.0",
           MOONCAKE_CITE, "mooncake"),
    _entry("mooncake-synthetic", "mooncake/synthetic_trace.jsonl", MOONCAKE,
           "FAST25-release/traces/synthetic_trace.jsonl",
           "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131", 1_136_313, "Apache-2.0",
           MOONCAKE_CITE, "mooncake"),
    _entry("mooncake-toolagent", "mooncake/toolagent_trace.jsonl", MOONCAKE,
           "FAST25-release/traces/toolagent_trace.jsonl", None, None, "Apache-2.0", MOONCAKE_CITE, "mooncake"),
    _entry("mooncake-arxiv", "mooncake/mooncake_trace.jsonl", MOONCAKE,
           "FAST25-release/arxiv-trace/mooncake_trace.jsonl", None, None, "Apache-2.0", MOONCAKE_CITE, "mooncake"),
    _entry("vidur-splitwise-conv", "vidur/splitwise_conv.csv", VIDUR, "data/processed_traces/splitwise_conv.csv",
           "439e4138b7e384f316de614c071f7162be05b8af0cef866f82faacd1b0472249", 382_729,
           "MIT (repository); the data is the Azure 2023 conv trace, CC-BY-4.0",
           f"{SPLITWISE}; Agrawal et al., Vidur, MLSys 2024", "vidur"),
    _entry("vidur-splitwise-code", "vidur/splitwise_code.csv", VIDUR, "data/processed_traces/splitwise_code.csv",
           "f266b907d109d471c61283ab69771c17ad79a18b33ff6e96aa546346f52767a6", 166_195,
           "MIT (repository); the data is the Azure 2023 code trace, CC-BY-4.0",
           f"{SPLITWISE}; Agrawal et al., Vidur, MLSys 2024", "vidur"),
    _entry("sharegpt-lengths", "lengths/sharegpt_8k_filtered_stats_llama2_tokenizer.csv", SARATHI,
           "data/processed_traces/sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
           "6d6c296302a853e2669a674a96f269283e60c57e60363bd450588a1066919f9f", 949_600, "Apache-2.0",
           "Agrawal et al., Sarathi-Serve, OSDI 2024", "lengths"),
    _entry("arxiv-lengths", "lengths/arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv", VIDUR,
           "data/processed_traces/arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",
           "9d3580538d915ca75e4aaaa54590b42dbb17abc6d74c8913310cf07c232adcdc", 884_932, "MIT",
           "Agrawal et al., Vidur, MLSys 2024", "lengths"),
    _entry("bwb-lengths", "lengths/bwb_stats_llama2_tokenizer_filtered_v2.csv", ETALON,
           "data/processed_traces/bwb_stats_llama2_tokenizer_filtered_v2.csv",
           "389419d2f2e55149b5d6ccfedb881572798d39650436ab86fd61f3c40337a990", 1_123_791, "Apache-2.0",
           "Agrawal et al., Etalon 2024", "lengths"),
]}

# Names that stand for several traces. `tests`: the files the tests, benchmarks and README examples read
# (those of ../shared/traces, about 8 MB); `all`: every trace above, the week-long Azure 2024 files included
# (several hundred MB each).
GROUPS: dict[str, list[str]] = {
    "tests": ["azure-2023-conv", "vidur-splitwise-conv", "mooncake-conversation", "mooncake-synthetic",
              "sharegpt-lengths", "arxiv-lengths", "bwb-lengths"],
    "all": list(CATALOG),
}
