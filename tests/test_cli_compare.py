"""`python -m zero_core compare`: the tables, the JSON, and one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from zero_core.cli import main


def test_compare_prints_the_four_tables_and_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "compare.json"
    code = main(
        ["compare", "--world-size", "3", "--steps", "2", "--preset", "micro", "--no-progress", "--json", str(out)]
    )
    text = capsys.readouterr().out
    assert code == 0
    for title in ("Model states per GPU", "Equivalence", "Compute per GPU", "Memory breakdown"):
        assert title in text
    assert text.count("1.0000") >= 4, "every stage's measured/formula ratio is printed as 1.0000"
    data = json.loads(out.read_text())
    assert data["schema"] == "zero-course/compare/1"
    assert [s["stage"] for s in data["stages"]] == [0, 1, 2, 3]
    assert all(e["bit_identical"] for e in data["equivalence"])
    assert data["stages"][3]["comm_psi_per_step"] > data["stages"][0]["comm_psi_per_step"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--world-size", "0"], "--world-size"),
        (["--world-size", "100000"], "--world-size"),
        (["--steps", "0"], "--steps"),
        (["--stages", "0,5"], "--stages"),
        (["--stages", "one"], "--stages"),
        (["--preset", "huge"], "--preset"),
        (["--world-size", "two"], "--world-size"),
        (["--json", "/no/such/folder/x.json"], "--json"),
    ],
)
def test_bad_input_gets_one_line_and_exit_code_2(args: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        code = main(["compare", *args, "--no-progress"])
        raise SystemExit(code)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_the_module_runs_as_a_command() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "zero_core",
            "compare",
            "--world-size",
            "2",
            "--steps",
            "1",
            "--preset",
            "micro",
            "--stages",
            "0,3",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "ZeRO-3" in result.stdout and "ZeRO-1" not in result.stdout
