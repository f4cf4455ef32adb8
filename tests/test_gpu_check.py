"""benchmarks/gpu_check.sh --dry_run: it names every GPU path, and each command's flags parse
and resolve as on a GPU with Transformer Engine (the decisions each path is about)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_dry_run_parses_every_command():
    env = {**os.environ, "PYTHON": sys.executable,
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry_run"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    names = [p["name"] for p in result["paths"]]
    for wanted in ("TE spec", "resume", "THD", "LoRA on the TE spec", "fp16", "--use_distributed_optimizer", "FP8",
                   "--profile",
                   "recompute full", "recompute selective", "sequence parallel", "grouped GEMM",
                   "1B Llama", "sliding windows"):
        assert any(wanted in name for name in names), wanted
    assert all(p["status"] == "parses" for p in result["paths"]), result["paths"]
    assert proc.stdout.count("would run: ") == len(names)
    assert "| path | result |" in proc.stdout


def test_dry_run_reports_a_bad_command(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" /
                                                  "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = gpu_check  # its dataclasses look their module up
    spec.loader.exec_module(gpu_check)
    bad = gpu_check.Path("bad", "pt", ["--recompute_method", "block"], [], output="bad")
    wrong = gpu_check.Path("wrong decision", "pt", [], [], output="w",
                           decisions={"precision": "fp32"})
    gpu_check.dry_run([bad, wrong], str(tmp_path))
    assert bad.status == "FAIL" and "--recompute_method chooses the layers" in bad.note
    assert wrong.status == "FAIL" and "precision='fp32' (got 'bf16')" in wrong.note
