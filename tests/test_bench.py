"""``edgemesh bench codecs`` writes the report layout the issue fixes, and a PNG beside it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from edgemesh.common.codecs import available_codecs

CODEC_KEYS = {"compression_ratio", "bytes_per_step", "relative_error", "encode_gbps", "decode_gbps",
              "final_accuracy"}


def test_bench_codecs_report_layout(tmp_path: Path) -> None:
    report = tmp_path / "codecs.json"
    result = subprocess.run(
        [sys.executable, "-m", "edgemesh.services.cli", "bench", "codecs", "--report", str(report),
         "--rounds", "3", "--elements", "200000"],
        capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(report.read_text())
    assert data["memcpy_gbps"] > 0
    assert set(data["codecs"]) == set(available_codecs())
    for name, entry in data["codecs"].items():
        assert CODEC_KEYS <= entry.keys(), name
        assert entry["compression_ratio"] >= 1.0 or name == "qsgd"
        assert 0.0 <= entry["final_accuracy"] <= 1.0
        assert entry["encode_gbps"] > 0 and entry["decode_gbps"] > 0
    assert data["codecs"]["none"]["relative_error"] == 0.0
    assert data["codecs"]["fp16"]["compression_ratio"] == 2.0
    if {"grid", "threshold"} <= set(available_codecs()):
        same = data["same_density"]
        assert {"density", "grid_bytes", "threshold_bytes"} <= same.keys()
        assert same["grid_bytes"] < same["threshold_bytes"]
    assert report.with_suffix(".png").stat().st_size > 1000
