"""Prepare, on this machine, what the device check needs on the GPU machine beyond its image, in ``.device/``
(git-ignored, carried by the device tool's ``carry``):

    .device/wheels/*.whl      pydantic, pydantic-core, annotated-types, typing-extensions, typing-inspection,
                              simpy, pyyaml: the simulator's imports that the image lacks (or has too old),
                              for CPython 3.12 x86-64 (manylinux), at the versions installed here
    .device/azure_conv.csv    the first rows of the Azure LLM inference trace 2023 (conversation), byte for
                              byte (CC-BY-4.0: Patel et al., Splitwise, ISCA 2024)
    .device/MANIFEST.json     what is there, sizes and SHA-256, and the remote command

The image (Python 3.12, torch 2.11, triton 3.6) already has numpy, pandas, pyarrow, typer, rich and
nvidia-ml-py; plotly is not needed (the check writes no HTML report). Then, with the device tool::

    run(command=REMOTE_COMMAND, carry=[".device"], timeout_s=540)

    python gpu/device_bundle.py                  # wheels + trace slice + manifest; prints sizes and the command
    python gpu/device_bundle.py --no-wheels      # the trace slice only (no network)
    python gpu/device_bundle.py --command        # print the remote command only

Everything that travels (tracked and untracked, not ignored, files + ``.device``) must stay under 64 MiB:
the script measures it and fails above ``--max-mib``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from gpu.check import AZURE, AZURE_HEADER, BUNDLE_TRACE  # noqa: E402 (what the check reads, named once there)

BUNDLE = ROOT / Path(BUNDLE_TRACE).parent  # .device
TRACE_NAME = Path(BUNDLE_TRACE).name
# distribution name here -> the name pip downloads (the image lacks the first five's and the simulator imports them)
WHEELS = ("pydantic", "pydantic-core", "annotated-types", "typing-extensions", "typing-inspection", "simpy", "PyYAML")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
LIMIT_MIB = 64.0
MAX_FILES_BACK = 8
CARRY = (BUNDLE.name,)

# The device tool's command (2,000 characters at most; run in the repository root; $OUT comes back, 8 files at
# most). Installs the wheels into /tmp/site (no index, no dependencies resolved: the bundle is complete), runs
# the check under `timeout` (SIGTERM at 450 s, SIGKILL 15 s later: under 8 minutes; the check's own budget is
# 420 s and it writes its JSON after every section), then copies the profile, the validation and nvidia-smi,
# and packs the work folder (the replay's scenario, requests, and both runs' tables: steps measured and
# predicted, for analysis here). Files back: pip.log, device_check.json (+ .tmp only if killed mid-write),
# check.log, profile.json, validation.json, nvidia-smi.txt, work.tgz.
REMOTE_COMMAND = (
    "set -o pipefail; export PYTHONUNBUFFERED=1; "
    "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "
    f"{BUNDLE.name}/wheels/*.whl > $OUT/pip.log 2>&1 || {{ tail -20 $OUT/pip.log; exit 3; }}; "
    "export PYTHONPATH=/tmp/site; "
    f"timeout -k 15 450 python3 gpu/check.py --device cuda --trace {BUNDLE_TRACE} "
    "--out $OUT/device_check.json --work /tmp/dc --budget-s 420 2>&1 | tee $OUT/check.log; rc=$?; "
    "cp /tmp/dc/profile.json /tmp/dc/validation/validation.json $OUT/ 2>/dev/null; "
    "tar czf $OUT/work.tgz -C /tmp dc 2>/dev/null; "
    "nvidia-smi > $OUT/nvidia-smi.txt 2>&1; exit $rc"
)
FILES_BACK = ("pip.log", "device_check.json", "device_check.json.tmp", "check.log", "profile.json",
              "validation.json", "nvidia-smi.txt", "work.tgz")


def git_source() -> dict | None:
    """The checkout's commit and the files that differ from it (what the device will run), or None
    outside a git checkout. The device check copies this into its provenance."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    try:
        return {"commit": git("rev-parse", "HEAD"),
                "changed": [line[3:] for line in git("status", "--porcelain").splitlines()]}
    except (OSError, subprocess.CalledProcessError):
        return None


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def find_azure(explicit: str | None) -> Path:
    """The full Azure conv CSV: ``--trace``, ``$KVSIM_TRACES``, or the shared traces beside (or inside) the
    checkout."""
    env = os.environ.get("KVSIM_TRACES", "").strip()
    places = [Path(explicit)] if explicit else (
        ([Path(env).expanduser() / Path(AZURE).relative_to("traces")] if env else [])
        + [ROOT.parent / "shared" / AZURE, ROOT / "shared" / AZURE])
    for p in places:
        if p.is_file():
            return p
    raise SystemExit("the Azure conv trace (AzureLLMInferenceTrace_conv.csv) is in none of: "
                     + ", ".join(map(str, places)) + " (give --trace)")


def write_trace_slice(src: Path, dst: Path, rows: int) -> dict:
    """The header and the first ``rows`` rows of ``src``, byte for byte (the check reads the first rows)."""
    if rows < 1:
        raise SystemExit(f"--rows must be positive, got {rows}")
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(src, "rb") as f, open(dst, "wb") as g:
        header = f.readline()
        if not header.startswith(AZURE_HEADER):
            raise SystemExit(f"{src}: not the Azure LLM inference trace (header {header[:60]!r})")
        g.write(header)
        n = 0
        for line in f:
            if n == rows:
                break
            g.write(line)
            n += 1
    if n < rows:
        raise SystemExit(f"{src} has only {n} rows, fewer than --rows {rows}")
    return {"file": dst.name, "source": str(src), "source_sha256": sha256(src), "rows": n, "bytes": dst.stat().st_size,
            "sha256": sha256(dst), "license": "CC-BY-4.0",
            "cite": "Patel et al., Splitwise: Efficient generative LLM inference using phase splitting, ISCA 2024 "
                    "(Azure/AzurePublicDataset, AzureLLMInferenceTrace_conv.csv)"}


def pinned_versions() -> dict[str, str]:
    """The versions installed here (the tests ran with these), by pip's distribution name."""
    out = {}
    for name in WHEELS:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            raise SystemExit(f"{name} is not installed here: install the project (pip install -e .) first") from None
    return out


def download_wheels(dst: Path, versions: dict[str, str], python: str = "3.12") -> list[dict]:
    """``pip download`` each wheel for CPython ``python`` on x86-64 Linux, no dependencies (the list is the
    closure), binary only; the folder is emptied first so that only one version of each remains."""
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    abi = "cp" + python.replace(".", "")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", python,
           "--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none", "-d", str(dst)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    cmd += [f"{n}=={v}" for n, v in versions.items()]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"pip download failed ({' '.join(cmd)}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    wheels = sorted(dst.glob("*.whl"))
    got = {w.name.split("-")[0].lower().replace("_", "-") for w in wheels}
    want = {n.lower().replace("_", "-") for n in versions}
    if got != want:
        raise SystemExit(f"pip downloaded {sorted(got)}, expected {sorted(want)}")
    for w in wheels:
        tags = w.name[:-4].split("-")[-3:]
        if tags[0] not in ("py3", "py2.py3", abi) and not tags[0].startswith("cp3"):
            raise SystemExit(f"{w.name}: not a wheel for CPython {python}")
        if tags[2] not in ("any",) and "x86_64" not in tags[2]:
            raise SystemExit(f"{w.name}: not a wheel for x86-64 Linux")
    return [{"file": w.name, "bytes": w.stat().st_size, "sha256": sha256(w)} for w in wheels]


def travelling_bytes(bundle: Path) -> dict:
    """What the device tool sends: tracked and untracked, not ignored, files of the checkout, plus the
    carried bundle (git decides what is ignored, as the tool does). A bundle elsewhere than ``.device`` is
    counted as if it were carried there (its files not counted twice if it lies in the checkout)."""
    p = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                       capture_output=True, check=True)
    bundle = bundle.resolve()
    tree = sum(f.stat().st_size for f in (ROOT / n for n in p.stdout.decode().split("\0") if n)
               if f.is_file() and not f.resolve().is_relative_to(bundle))
    carried = sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file())
    return {"tree_bytes": tree, "bundle_bytes": carried, "total_mib": (tree + carried) / 2**20}


def check_command(cmd: str = REMOTE_COMMAND) -> None:
    """The command's limits: 2,000 characters, at most 8 files back, under 8 minutes of `timeout`."""
    import re

    if len(cmd) > 2000:
        raise ValueError(f"the remote command has {len(cmd)} characters (at most 2000)")
    if len(FILES_BACK) > MAX_FILES_BACK:
        raise ValueError(f"{len(FILES_BACK)} files back (at most {MAX_FILES_BACK})")
    m = re.search(r"timeout -k (\d+) (\d+) ", cmd)
    if not m or int(m.group(1)) + int(m.group(2)) >= 480:
        raise ValueError("the check must run under `timeout -k K T` with K + T < 480 s")
    if len(CARRY) > 8:
        raise ValueError("at most 8 carried paths")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(BUNDLE), help="the bundle folder (default .device, git-ignored)")
    ap.add_argument("--trace", default=None, help="the full Azure conv CSV (default ../shared/traces/...)")
    ap.add_argument("--rows", type=int, default=2000, help="rows of the trace slice (default 2000)")
    ap.add_argument("--python", default="3.12", help="the device image's Python (default 3.12)")
    ap.add_argument("--no-wheels", action="store_true", help="the trace slice and manifest only (no network)")
    ap.add_argument("--command", action="store_true", help="print the remote command and exit")
    ap.add_argument("--max-mib", type=float, default=LIMIT_MIB, help="fail if what travels exceeds this")
    a = ap.parse_args(argv)
    check_command()
    if a.command:
        print(REMOTE_COMMAND)
        return 0
    if not (math.isfinite(a.max_mib) and a.max_mib > 0):  # (nan, 0, -1 passed)
        ap.error(f"--max-mib {a.max_mib}: expected MiB above 0")
    from sim.config import ScenarioError
    from sim.outputs import out_dir

    try:  # (a file was a FileExistsError traceback)
        out = out_dir(a.out, "--out")
    except ScenarioError as e:
        ap.error(str(e))
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"python": a.python, "trace": write_trace_slice(find_azure(a.trace), out / TRACE_NAME, a.rows)}
    if not a.no_wheels:
        versions = pinned_versions()
        manifest["wheels"] = download_wheels(out / "wheels", versions, a.python)
        manifest["versions"] = versions
    manifest["source"] = git_source()
    manifest["remote_command"] = REMOTE_COMMAND
    manifest["carry"] = list(CARRY)
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
    size = travelling_bytes(out)  # (a bundle elsewhere was not measured, so --max-mib did nothing)
    wheels = sum(w["bytes"] for w in manifest.get("wheels", []))
    print(f"{out}: trace slice {manifest['trace']['rows']} rows ({manifest['trace']['bytes'] / 2**10:.0f} KiB), "
          f"{len(manifest.get('wheels', []))} wheels ({wheels / 2**20:.2f} MiB)")
    elsewhere = "" if out.resolve() == BUNDLE.resolve() else f" once {out} is moved to {BUNDLE.name} (only it is carried)"
    print(f"travels{elsewhere}: checkout {size['tree_bytes'] / 2**20:.2f} MiB + bundle "
          f"{size['bundle_bytes'] / 2**20:.2f} MiB = {size['total_mib']:.2f} MiB (limit {a.max_mib:g} MiB)")
    if size["total_mib"] > a.max_mib:
        print(f"too large: {size['total_mib']:.1f} MiB travels, more than {a.max_mib:g}", file=sys.stderr)
        return 1
    print(f"carry: {list(CARRY)}\ncommand ({len(REMOTE_COMMAND)} characters):\n{REMOTE_COMMAND}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
