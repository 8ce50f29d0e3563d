"""scripts/bench.py's plumbing: every scenario parses into a config, the Makefile runs each
one, and the host scenario (one process, fake process group) reports a table. Figures are
not asserted: speed and memory are measured by the benchmarks, not by tests."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench  # noqa: E402


def test_every_scenario_parses_and_has_a_make_target() -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = re.search(r"^BENCHES := (.*)$", makefile, re.M)
    assert targets and set(targets.group(1).split()) == set(bench.SCENARIOS)
    for name, sc in bench.SCENARIOS.items():
        scenario, cfg, _ = bench.parse_args([name, "--no-write"])
        assert scenario is sc
        for key, value in sc.defaults.items():
            assert getattr(cfg, key) == value, (name, key)
        cols = [c.key for c in sc.cols]
        assert len(cols) == len(set(cols)), name


def test_host_scenario_reports_each_system_against_fsdp2() -> None:
    cmd = [
        sys.executable, str(ROOT / "scripts" / "bench.py"), "host", "--systems",
        "unwrapped,fsdp_lite,fsdp2", "--precisions", "fp32", "--layers", "2", "--rounds", "1",
        "--steps", "1", "--warmup", "1", "--no-write",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("| ")]
    rows = {line.split("|")[1].strip(): line for line in lines}
    assert set(rows) >= {"unwrapped", "fsdp_lite", "fsdp2"}
    assert rows["fsdp2"].count("1.00x") == 2  # the reference row, per-unit step and fwd+bwd
    assert "bench-host:begin" in out.stdout and "scripts/bench.py host" in out.stdout
