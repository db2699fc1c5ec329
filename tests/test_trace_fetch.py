"""`sim trace fetch` and where traces are found. Nothing is downloaded from the internet: an HTTP server
on 127.0.0.1, started in the test, serves the files (the real transport, the real checksum logic)."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from cli import app
from conftest import shared_trace
from sim import trace_paths
from sim.config import ScenarioError, load_scenario
from kvsim import load_requests
from traces.catalog import CATALOG, GROUPS, PublicTrace
from traces.fetch import fetch, resolve_names, sha256_of

runner = CliRunner()
CSV = b"TIMESTAMP,ContextTokens,GeneratedTokens\n" + b"".join(
    f"2023-11-16 18:{m:02d}:00.0000000,{100 + m},{10 + m}\n".encode() for m in range(40))


@pytest.fixture
def serve():
    """serve(folder) -> base URL, requests seen; /short/* promises 1,000 bytes and sends 10."""
    servers = []

    def start(folder: Path):
        seen: list[str] = []

        class Handler(SimpleHTTPRequestHandler):
            def __init__(self, *a, **k):
                super().__init__(*a, directory=str(folder), **k)

            def log_message(self, *a):
                pass

            def do_GET(self):
                seen.append(self.path)
                if self.path.startswith("/short/"):
                    self.send_response(200)
                    self.send_header("Content-Length", "1000")
                    self.end_headers()
                    self.wfile.write(b"x" * 10)
                    return
                super().do_GET()

        httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(httpd)
        return SimpleNamespace(url=f"http://127.0.0.1:{httpd.server_address[1]}", seen=seen)

    yield start
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


def entry(url: str, sha256: str | None, file: str = "azure_2023/AzureLLMInferenceTrace_code.csv") -> PublicTrace:
    return PublicTrace("t", file, url, sha256, None, "CC-BY-4.0", "a paper", "a repo", "azure")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def leftovers(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


# ---------------------------------------------------------------------------------------------- checksums


def test_good_checksum_writes_the_file(tmp_path, serve):
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "code.csv").write_bytes(CSV)
    srv = serve(tmp_path / "www")
    seen = []
    r = fetch(entry(f"{srv.url}/code.csv", hashlib.sha256(CSV).hexdigest()), tmp_path / "traces",
              progress=lambda done, total: seen.append((done, total)))
    assert r.downloaded and r.verified
    assert r.path == tmp_path / "traces" / "azure_2023" / "AzureLLMInferenceTrace_code.csv"
    assert r.path.read_bytes() == CSV and r.sha256 == hashlib.sha256(CSV).hexdigest()
    umask = os.umask(0)
    os.umask(umask)
    assert r.path.stat().st_mode & 0o777 == 0o666 & ~umask  # (0600: a shared folder's trace others could not read)
    assert leftovers(tmp_path / "traces") == ["azure_2023", "azure_2023/AzureLLMInferenceTrace_code.csv"]  # no .part
    assert seen[-1] == (len(CSV), len(CSV))  # the progress callback saw every byte of the announced length
    # a second fetch hashes the file there instead of downloading it
    again = fetch(entry(f"{srv.url}/code.csv", hashlib.sha256(CSV).hexdigest()), tmp_path / "traces")
    assert not again.downloaded and again.verified and srv.seen == ["/code.csv"]


def test_bad_checksum_is_an_error_and_leaves_nothing(tmp_path, serve):
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "code.csv").write_bytes(CSV)
    srv = serve(tmp_path / "www")
    with pytest.raises(ScenarioError, match="does not match the catalog's 0000") as e:
        fetch(entry(f"{srv.url}/code.csv", "0" * 64), tmp_path / "traces")
    assert hashlib.sha256(CSV).hexdigest() in str(e.value) and "nothing was written" in str(e.value)
    assert leftovers(tmp_path / "traces") == []  # neither the file, nor a temporary, nor the folders made for it


def test_a_file_already_there_with_another_checksum_is_not_taken(tmp_path, serve):
    dest = tmp_path / "traces" / "azure_2023" / "AzureLLMInferenceTrace_code.csv"
    dest.parent.mkdir(parents=True)
    dest.write_bytes(CSV + b"tampered\n")
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "code.csv").write_bytes(CSV)
    srv = serve(tmp_path / "www")
    good = entry(f"{srv.url}/code.csv", hashlib.sha256(CSV).hexdigest())
    with pytest.raises(ScenarioError, match="already there but its SHA-256 is .* give --force"):
        fetch(good, tmp_path / "traces")
    assert fetch(good, tmp_path / "traces", force=True).downloaded and dest.read_bytes() == CSV


def test_unknown_checksum_keeps_the_file_and_prints_the_computed_one(tmp_path, serve):
    assert CATALOG["burstgpt"].sha256 is None  # no copy was at hand to hash
    www = tmp_path / "www" / "burstgpt"
    www.mkdir(parents=True)
    body = (b"Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
            b"5,ChatGPT,472,18,490,Conversation log\n")
    (www / "BurstGPT_1.csv").write_bytes(body)
    srv = serve(tmp_path / "www")
    r = runner.invoke(app, ["trace", "fetch", "burstgpt", "--dir", str(tmp_path / "t"), "--mirror", srv.url])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert f"SHA-256 {hashlib.sha256(body).hexdigest()}: not verified" in text
    assert (tmp_path / "t" / "burstgpt" / "BurstGPT_1.csv").read_bytes() == body
    assert f"KVSIM_TRACES={tmp_path / 't'}" in r.output.replace("\n", "")  # how scenarios and tests find them


# ---------------------------------------------------------------------------------------------- network errors


@pytest.mark.parametrize("case", ["refused", "http_404", "truncated"])
def test_network_failures_are_one_line_exit_2_and_leave_nothing(tmp_path, serve, case):
    srv = serve(tmp_path)
    url = {"refused": f"http://127.0.0.1:{closed_port()}", "http_404": f"{srv.url}/missing",
           "truncated": f"{srv.url}/short"}[case]
    r = runner.invoke(app, ["trace", "fetch", "azure-2023-conv", "--dir", str(tmp_path / "t"), "--mirror", url])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and r.output.startswith("error: ")
    text = " ".join(r.output.split())
    assert {"refused": "download failed (ConnectionRefusedError", "http_404": "download failed (HTTP 404",
            "truncated": "closed after 10 of 1,000 bytes"}[case] in text, text
    assert "othing was written" in text and leftovers(tmp_path / "t") == []


def test_offline_names_the_url_and_says_offline(tmp_path):
    with pytest.raises(ScenarioError, match=r"download failed \(.*\); offline, or the host unreachable\?"):
        fetch(entry(f"http://127.0.0.1:{closed_port()}/code.csv", None), tmp_path)
    assert leftovers(tmp_path) == []
    with pytest.raises(ScenarioError) as e:  # a file: mirror's missing folder is not the network's doing
        fetch(entry(f"file://{tmp_path}/nowhere/code.csv", None), tmp_path / "t")
    assert "download failed (FileNotFoundError" in str(e.value) and "host unreachable" not in str(e.value)


@pytest.mark.parametrize("flag", ["--dir", "--mirror"])
def test_an_empty_dir_or_mirror_is_refused(tmp_path, monkeypatch, flag):
    """--dir "" wrote into the current folder; --mirror "" fetched from the publisher."""
    from traces.fetch import fetch_command

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ScenarioError, match=f"{flag}: an empty"):
        fetch_command(["azure-2023-conv"], "" if flag == "--dir" else None, mirror="" if flag == "--mirror" else None)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------- the catalog


def test_catalog_names_groups_and_urls():
    assert resolve_names(["tests", "azure-2023-conv"]) == [CATALOG[n] for n in GROUPS["tests"]]
    with pytest.raises(ScenarioError, match="unknown trace 'azure'; expected one of azure-2023-conv"):
        resolve_names(["azure"])
    for t in CATALOG.values():
        assert t.url.startswith("https://") and t.license and t.cite and t.file.count("/") == 1, t.name
        assert t.sha256 is None or (len(t.sha256) == 64 and int(t.sha256, 16) >= 0), t.name
        if "github" in t.url:  # pinned to a full commit, so the bytes never change under the checksum
            assert len(t.url.split("/")[5]) == 40, t.url


@pytest.mark.parametrize("extra, dropped", [(["azure-2023-conv"], "azure-2023-conv"),
                                           (["--mirror", "http://127.0.0.1:9"], "--mirror"), (["--force"], "--force")])
def test_list_with_a_name_or_a_download_option_is_an_error(extra, dropped):
    """`--list NAME` printed the catalog, fetched nothing and exited 0: the name was dropped without a word."""
    r = runner.invoke(app, ["trace", "fetch", "--list", *extra])
    assert r.exit_code == 2 and f"--list lists the traces and downloads nothing: drop {dropped}" in r.output, r.output


def test_the_real_catalog_fetches_from_a_mirror_of_the_shared_traces(tmp_path, serve):
    """Every file the tests read, through `sim trace fetch tests`, served from the shared copy: the
    catalog's checksums are those of the real files."""
    folder = shared_trace(CATALOG["azure-2023-conv"].file).parents[1]
    if not all((folder / CATALOG[n].file).is_file() for n in GROUPS["tests"]):
        pytest.skip(f"not every trace of the 'tests' group is in {folder}")
    srv = serve(folder)
    r = runner.invoke(app, ["trace", "fetch", "tests", "--dir", str(tmp_path), "--mirror", srv.url])
    assert r.exit_code == 0, r.output
    assert " ".join(r.output.split()).count("(downloaded,") == len(GROUPS["tests"])
    for n in GROUPS["tests"]:
        t = CATALOG[n]
        assert sha256_of(tmp_path / t.file) == t.sha256 and f"/{t.file}" in srv.seen, n


# ---------------------------------------------------------------------------------------------- lookup


def test_search_order_explicit_then_env_then_project(tmp_path, monkeypatch):
    rel = "azure_2023/AzureLLMInferenceTrace_conv.csv"
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        (d / rel).parent.mkdir(parents=True)
        (d / rel).write_bytes(CSV)
    monkeypatch.setenv(trace_paths.ENV, str(b))
    assert trace_paths.trace_dirs(a) == [a, b, trace_paths.project_traces()]
    assert trace_paths.find_trace(rel, a) == a / rel and trace_paths.find_trace(rel) == b / rel
    monkeypatch.delenv(trace_paths.ENV)
    assert trace_paths.trace_dirs() == [trace_paths.project_traces()]
    assert trace_paths.find_trace("nowhere/x.csv", a) is None


def test_an_installed_package_looks_beside_the_current_project_folder(tmp_path, monkeypatch):
    """After `pip install .` the package lives in site-packages, and ../shared/traces beside it was a folder
    inside the venv: the README's commands, run in the project's folder, found no trace."""
    assert trace_paths.project_traces() == trace_paths.ROOT.parent / "shared" / "traces"  # a checkout
    site = tmp_path / "venv" / "lib" / "python3" / "site-packages"
    site.mkdir(parents=True)
    monkeypatch.setattr(trace_paths, "ROOT", site)
    monkeypatch.chdir(tmp_path / "venv")
    assert trace_paths.project_traces() == tmp_path / "shared" / "traces"


def test_scenario_traces_prefix_searches_the_traces_folders(tmp_path, monkeypatch):
    (tmp_path / "t" / "mine").mkdir(parents=True)
    (tmp_path / "t" / "mine" / "trace.csv").write_bytes(CSV)
    s = tmp_path / "s.yaml"
    s.write_text("name: t\nmodel: opt-13b\ngpu: a100-40gb\n"
                 "workload: {kind: trace, path: 'traces:mine/trace.csv'}\npolicies: [vllm]\n")
    monkeypatch.setenv(trace_paths.ENV, str(tmp_path / "t"))
    t = load_requests(load_scenario(s))
    assert len(t) == 40 and int(t.prompt_tokens[0]) == 100
    monkeypatch.setenv(trace_paths.ENV, str(tmp_path / "elsewhere"))
    r = runner.invoke(app, ["check", str(s)])
    assert r.exit_code == 2 and "Traceback" not in r.output
    text = " ".join(r.output.split())
    assert "workload.path: traces:mine/trace.csv: not found in the traces folders ($KVSIM_TRACES (" in text
    assert "sim trace fetch --list" in text


@pytest.mark.parametrize("rel", ["../../../etc/passwd", "/etc/passwd", "mine/../../x.csv"])
def test_a_traces_path_that_leads_out_of_the_traces_folders_is_refused(tmp_path, monkeypatch, rel):
    """traces:../../../etc/passwd read a file outside the traces folders."""
    (tmp_path / "t").mkdir()
    (tmp_path / "x.csv").write_bytes(CSV)  # (mine/../../x.csv from t/ is this file)
    s = tmp_path / "s.yaml"
    s.write_text(f"name: t\nmodel: opt-13b\ngpu: a100-40gb\nworkload: {{kind: trace, path: 'traces:{rel}'}}\n"
                 "policies: [vllm]\n")
    monkeypatch.setenv(trace_paths.ENV, str(tmp_path / "t"))
    r = runner.invoke(app, ["check", str(s)])
    assert r.exit_code == 2 and f"{s}:4: workload.path: traces:REL names a file inside the traces folders; " \
        f"{rel!r} leads out of them" in " ".join(r.output.split()), r.output
