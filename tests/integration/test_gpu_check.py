"""``make gpu-check``'s plumbing, dry-run on the CPU: every part it runs here reports PASS
(or SKIP where it needs CUDA), the summary file holds each part and the verdict, and a
failing part fails the command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _gpu_check(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, str]:
    out = tmp_path / "gpu_check.md"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("OUT", None)
    proc = subprocess.run(
        [sys.executable, "tests/gpu/gpu_check.py", "--dry-run", "--out", str(out), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    return proc, out.read_text() if out.exists() else ""


def test_dry_run_writes_every_part_and_the_verdict(tmp_path: Path) -> None:
    parts = "w1,w2,fake8,syncs,bench"
    proc, summary = _gpu_check(tmp_path, "--parts", parts, "--budget", "240")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for part in parts.split(","):
        assert f"## {part}" in summary, summary
    assert summary.count("PASS W=1 gloo") == 9, summary  # one per w1_checks case
    assert "PASS W=2 gloo on one device" in summary
    assert "SKIP host syncs" in summary and "| fsdp_lite |" in summary
    assert "FAIL" not in summary and "## verdict\n\nPASS" in summary, summary


def test_a_part_past_its_share_is_stopped_and_fails(monkeypatch) -> None:
    import io

    monkeypatch.syspath_prepend(str(ROOT / "tests" / "gpu"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    import gpu_check

    summary = io.StringIO()
    failed = gpu_check._run_part("bench", dry=True, limit=1.0, summary=summary)
    assert failed == 1 and "FAIL bench: stopped after its 1 s share" in summary.getvalue()


def test_dry_run_of_the_measurements(tmp_path: Path) -> None:
    """``make gpu-measure``'s parts run through (tables, targets, the largest-model cases
    each in a process of its own) on the CPU, ready for a lent GPU."""
    proc, summary = _gpu_check(tmp_path, "--parts", "hostbound,offload", "--budget", "400")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| fsdp_lite | " in summary and "| unwrapped | " in summary, summary
    assert "fsdp_lite::pre_forward" in summary and "FSDP::pre_forward" in summary, summary
    assert summary.count("| trained |") == 2, summary  # both systems (one shape when dry)
    targets = [ln for ln in summary.splitlines() if ln.startswith("INFO target (dry run")]
    for what in ("host per unit <= 0.3x FSDP2's", "0.95x unwrapped", "s/step <= FSDP2's",
                 "GPU peak <= FSDP2's"):  # fmt: skip
        assert any(what in ln for ln in targets), summary
    assert "FAIL" not in summary and "## verdict\n\nPASS" in summary, summary


def test_a_measured_system_that_fails_is_reported_and_the_others_go_on(monkeypatch) -> None:
    """On a lent GPU one system's error (an out-of-memory) must not cost the others'
    figures: it is a FAIL line, and the targets that compare it are not judged."""
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "gpu"))
    import gpu_measure_cases as g

    def run(system: str) -> dict:
        if system == "fsdp2":
            raise RuntimeError("CUDA out of memory.\nTried to allocate ...")
        return {"s": 1.0}

    results, failed = g._interleaved(("fsdp_lite", "fsdp2", "unwrapped"), 2, run)
    assert {s: len(r) for s, r in results.items()} == {"fsdp_lite": 2, "unwrapped": 2}
    assert failed == {"fsdp2": "RuntimeError: CUDA out of memory."}
    assert list(g._failures("offload", failed)) == [
        "FAIL offload: fsdp2 raised RuntimeError: CUDA out of memory."
    ]
    line = g._judge(lambda: True, "offload: s/step", ("fsdp_lite", "fsdp2"), results, dry=False)
    assert line == "INFO target not judged (fsdp2 failed): offload: s/step"
    assert g._judge(lambda: True, "x", ("fsdp_lite",), results, dry=False) == "PASS target: x"
