"""Without CUDA the CLI has megatron's torch.compile'd fusions decorated as plain functions
(runtime/cpu.before_import): no inductor import per process."""

import os
import subprocess
import sys

from run_helpers import ROOT, child_env

PROBE = ("import os, sys; {setup}; import megatron.core.fusions.fused_bias_geglu as m; "
         "print(hasattr(m.geglu, '_torchdynamo_orig_callable'), "
         "os.environ.get('TORCHDYNAMO_DISABLE'))")


def probe(setup: str, **env) -> str:
    # An earlier test's in-process cli.main may have set the variable in this process.
    clean = {k: v for k, v in child_env().items() if k != "TORCHDYNAMO_DISABLE"}
    proc = subprocess.run([sys.executable, "-c", PROBE.format(setup=setup)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**clean, "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": "",
                               **env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.split()[-2:]


def test_the_cli_leaves_megatrons_fusions_uncompiled_without_cuda():
    # What `python -m swift_mcore` does: the package, then cli.main before any command.
    setup = "import swift_mcore.cli; assert 'megatron.core' not in sys.modules; " \
            "from swift_mcore.runtime import cpu; cpu.before_import()"
    assert probe(setup) == ["False", "1"]
    # Left alone, megatron wraps them in torch.compile.
    assert probe("pass") == ["True", "None"]


def test_a_users_own_dynamo_setting_is_kept(monkeypatch):
    from swift_mcore.runtime import cpu, hardware

    monkeypatch.setattr(hardware, "cuda_available", lambda: False)
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")
    cpu.before_import()
    assert os.environ["TORCHDYNAMO_DISABLE"] == "0"
    monkeypatch.delenv("TORCHDYNAMO_DISABLE")
    monkeypatch.setattr(hardware, "cuda_available", lambda: True)
    cpu.before_import()  # with CUDA megatron's compiled fusions stay
    assert "TORCHDYNAMO_DISABLE" not in os.environ
    cpu.before_import(cuda=True)  # the caller's answer wins over the hardware's
    assert "TORCHDYNAMO_DISABLE" not in os.environ
