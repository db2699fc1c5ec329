"""A user's YAML (scenario, sweep, step_time block) that would hang, explode or be read wrongly: each is
one clear error, exit 2, naming the file and the line."""

from __future__ import annotations

import os
import time

import pytest
from typer.testing import CliRunner

from cli import app

BOMB = "".join(f"{c}: &{c} [{', '.join(['*' + p] * 10) if p else '1, 1, 1, 1, 1, 1, 1, 1, 1, 1'}]\n"
               for p, c in zip(["", "a", "b", "c", "d", "e", "f", "g"], "abcdefgh"))
CASES = {
    "alias_bomb": (BOMB, "expands to more than 100,000 values"),
    "self_alias": ("a: &a\n  b: *a\n", "line 1: an alias refers to a node that contains it"),
    "deep_list": ("a: " + "[" * 10000 + "]" * 10000 + "\n", "nested"),
    "deep_map": ("a:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 80)) + "  " * 80 + "x: 1\n", "nested"),
    "duplicate_key": ("name: a\nmodel: opt-13b\nname: b\n", "line 3: duplicate key 'name' (first at line 1)"),
    "duplicate_nested": ("workload:\n  seed: 1\n  seed: 2\n", "line 3: duplicate key 'seed'"),
    "not_yaml": ("name: [unclosed\n", "not valid YAML"),
    "binary": (b"\x00\xff\xfe\x81garbage", "binary.yaml:1: not UTF-8 text (byte 0xff at column 2"),
    # said "cannot read as text (UnicodeDecodeError: UnicodeDecodeError)": no line, no byte
    "latin1": (b"name: x\nmodel: opt-13b\ngpu: h\xe9100\n", "latin1.yaml:3: not UTF-8 text (byte 0xe9 at column 7"),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("command", ["check", "sweep"])
def test_hostile_yaml_is_one_clear_error(tmp_path, name, command):
    text, message = CASES[name]
    f = tmp_path / f"{name}.yaml"
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    t0 = time.perf_counter()
    r = CliRunner().invoke(app, [command, str(f)] + (["--out", str(tmp_path / "o")] if command == "sweep" else []))
    assert r.exit_code == 2, r.output
    assert message in r.output and str(f) in r.output.replace("\n", "")
    assert "Traceback" not in r.output
    assert time.perf_counter() - t0 < 10


def test_bom_is_accepted(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_bytes("\ufeffname: bom\nmodel: opt-13b\ngpu: a100-40gb\nworkload: {arrival: {kind: poisson, rate: 1}, lengths: alpaca, num_requests: 5}\n"
                  "policies: [vllm]\n".encode())
    r = CliRunner().invoke(app, ["check", str(f)])
    assert r.exit_code == 0, r.output


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_fifo_is_refused_not_read(tmp_path):
    f = tmp_path / "s.yaml"
    os.mkfifo(f)
    r = CliRunner().invoke(app, ["check", str(f)])
    assert r.exit_code == 2 and "not a regular file" in r.output


def test_folder_is_refused(tmp_path):
    r = CliRunner().invoke(app, ["check", str(tmp_path)])
    assert r.exit_code == 2 and "not a regular file" in r.output


SCENARIO = ("name: n\nmodel: opt-13b\ngpu: a100-40gb\npolicies: [vllm]\n"
            "workload: {{arrival: {{kind: poisson, rate: 1}}, lengths: alpaca, num_requests: {}}}\n")


@pytest.mark.parametrize("value, expect", [
    # YAML 1.1's base-60 numbers: 90 requests ran; now text, which the field says it cannot read
    ("1:30", "workload.num_requests: Input should be a valid integer, unable to parse string as an integer "
             "(got '1:30')"),
    ("1:30.5", "(got '1:30.5')"),
    # YAML 1.1's octal: 8 requests ran; YAML 1.2 reads 010 as ten (0o10 is eight)
    ("010", "10 requests"), ("0o10", "8 requests"), ("1_0", "10 requests")])
def test_numbers_are_read_as_yaml_1_2_does(tmp_path, value, expect):
    f = tmp_path / "s.yaml"
    f.write_text(SCENARIO.format(value))
    r = CliRunner().invoke(app, ["check", str(f)])
    assert r.exit_code == (0 if expect.endswith("requests") else 2) and expect in r.output.replace("\n", ""), r.output
