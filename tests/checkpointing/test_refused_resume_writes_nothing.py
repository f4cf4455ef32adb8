"""A refused resume is decided before anything is written: not megatron's index cache, not the
logs, not a checkpoint."""

import os

from run_helpers import run_pt


def tree(folder):
    """Every file under ``folder`` with its size and modification time."""
    out = {}
    for base, _dirs, files in os.walk(folder):
        for name in files:
            path = os.path.join(base, name)
            stat = os.stat(path)
            out[os.path.relpath(path, folder)] = (stat.st_size, stat.st_mtime_ns)
    return out


def test_a_refused_resume_leaves_the_output_folder_as_it_was(tmp_path):
    out = tmp_path / "run"
    run_pt(out, "--train_iters", "2", "--eval_steps", "1", "--eval_iters", "1")
    before = tree(out)
    assert any(k.startswith("data_cache") for k in before)  # the cache the check must spare
    # Another seed gives another sample order: megatron would build new index files for it.
    refused = run_pt(out, "--train_iters", "4", "--seed", "7", "--resume", check=False)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "refusing to resume" in refused.stderr and "--seed: checkpoint 42, now 7" in (
        refused.stderr)
    assert "Traceback" not in refused.stderr
    assert tree(out) == before
