"""A refused resume is decided before anything is written: not megatron's index cache, not the
logs, not a checkpoint. The refused command runs in this process (cli.main on a one-rank
gloo group, as test_planted_pickles.py's refusals): the same checks, no second start-up."""

import os

from run_helpers import TINY, run_pt


def tree(folder):
    """Every file under ``folder`` with its size and modification time."""
    out = {}
    for base, _dirs, files in os.walk(folder):
        for name in files:
            path = os.path.join(base, name)
            stat = os.stat(path)
            out[os.path.relpath(path, folder)] = (stat.st_size, stat.st_mtime_ns)
    return out


def test_a_refused_resume_leaves_the_output_folder_as_it_was(tmp_path, gloo_group, capsys):
    from swift_mcore.cli import main

    out = tmp_path / "run"
    run_pt(out, "--train_iters", "2", "--eval_steps", "1", "--eval_iters", "1")
    before = tree(out)
    assert any(k.startswith("data_cache") for k in before)  # the cache the check must spare
    # Another seed gives another sample order: megatron would build new index files for it.
    capsys.readouterr()
    code = main(["pt", *TINY, "--output_dir", str(out), "--train_iters", "4", "--seed", "7",
                 "--resume"])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert "refusing to resume" in err and "--seed: checkpoint 42, now 7" in err
    assert "Traceback" not in err
    assert tree(out) == before
