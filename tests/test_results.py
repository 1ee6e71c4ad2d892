"""Results are data: one JSON-lines file per benchmark, every row stamped with its run's machine, date, commit and
settings, and RESULTS.md's data tables are what `scripts/results.py` makes of those files (no run-named files)."""

import datetime
import importlib.util
import io
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def results_module():
    spec = importlib.util.spec_from_file_location("results", ROOT / "scripts" / "results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_results_file_is_one_benchmark_s_data_or_its_plot():
    results = results_module()
    data = {path.resolve() for path, _ in results.BENCHMARKS.values()}
    for folder in [ROOT / "benchmarks" / "results", *ROOT.glob("packages/*/benchmarks/results")]:
        for path in folder.iterdir():
            assert path.resolve() in data or re.fullmatch(r"[a-z_]+(-[a-z0-9-]+)?\.png", path.name), path
    assert all(path.is_file() for path in data)


def test_every_row_carries_its_run_s_stamp():
    results = results_module()
    for name in results.BENCHMARKS:
        rows = results.read(name)
        assert rows, name
        for row in rows:
            assert isinstance(row["machine"], str), (name, row)
            assert row["machine"], (name, row)
            datetime.date.fromisoformat(row["date"])
            assert re.fullmatch(r"[0-9a-f]{7,40}", row["commit"]), (name, row)
            assert isinstance(row["settings"], str), (name, row)


def test_the_data_tables_are_what_the_data_make():
    results = results_module()
    text = results.RESULTS_MD.read_text()
    assert set(re.findall(r"<!-- data:(\w+) -->", text)) == set(results.BENCHMARKS)
    assert results.rendered(text) == text, "run: python scripts/results.py tables"


def test_record_stamps_and_appends_a_run(tmp_path, monkeypatch):
    results = results_module()
    data = tmp_path / "step_vs_trl.jsonl"
    data.write_text(json.dumps({"machine": "m", "date": "2026-01-01", "commit": "abcdef0", "settings": "",
                                "case": "old", "speedup": 1.5, "memory_ratio": 0.5}) + "\n")  # fmt: skip
    monkeypatch.setitem(results.BENCHMARKS, "step_vs_trl", (data, results.step_vs_trl))
    output = '{"case": "default", "speedup": 2.0, "memory_ratio": 0.6, "machine": "ignored"}\nnot JSON: a log line\n'
    monkeypatch.setattr(sys, "stdin", io.StringIO(output))
    assert results.record("step_vs_trl", "quick", "cpu-2x-test") == 0
    old, new = results.read("step_vs_trl")
    assert old["case"] == "old"
    assert {k: new[k] for k in ("machine", "settings", "case", "speedup")} == {
        "machine": "cpu-2x-test", "settings": "quick", "case": "default", "speedup": 2.0}  # fmt: skip
    assert new["date"] == datetime.date.today().isoformat()
    assert re.fullmatch(r"[0-9a-f]{7,40}", new["commit"])
    assert "| cpu-2x-test | " in results.table("step_vs_trl").splitlines()[2]  # the newest run first
    assert "default 2.00×" in results.table("step_vs_trl")
