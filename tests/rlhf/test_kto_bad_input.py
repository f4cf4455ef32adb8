"""Bad KTO input: one line naming the flag, file and row, exit 2, before any work."""

import json
import subprocess
import sys

import pytest

from rlhf_helpers import run_flags
from run_helpers import ROOT, child_env


def test_data_with_one_class_only_is_refused_in_one_line(tiny_hf, tmp_path):
    folder, _ = tiny_hf
    data = tmp_path / "kto.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "completion": "b", "label": True}) + "\n"
                            for p in ("a", "c", "d")))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "swift_mcore", "rlhf", "--rlhf_type", "kto", "--model",
         str(folder), "--dataset", str(data), "--output_dir", str(out), "--train_iters", "1",
         *run_flags()],
        capture_output=True, text=True, timeout=240, cwd=ROOT, env=child_env())
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"swift-mcore rlhf: error: --dataset {data}: all 3 rows are desirable (label true); "
        f"--rlhf_type kto needs both desirable and undesirable answers"]
    assert not (out / "checkpoint").exists() and not (out / "metrics.jsonl").exists()


def test_one_class_is_refused_across_files_and_for_undesirable_rows(tmp_path):
    from swift_mcore.data.sources import Source
    from swift_mcore.data.unpaired import read_unpaired
    from swift_mcore.errors import ArgumentError

    files = []
    for name in ("a.jsonl", "b.jsonl"):
        files.append(tmp_path / name)
        files[-1].write_text(json.dumps({"prompt": "a", "completion": "b", "label": False})
                             + "\n")
    sources = [Source(str(f), "json") for f in files]
    with pytest.raises(ArgumentError, match=r"all 2 rows are undesirable \(label false\)"):
        read_unpaired(sources)
    files[1].write_text(json.dumps({"prompt": "a", "completion": "b", "label": True}) + "\n")
    assert [r.desirable for r in read_unpaired(sources)] == [False, True]


@pytest.mark.parametrize("row, message", [
    ({"prompt": "a", "completion": "b", "label": 1},
     "row 3: 'label' must be true \\(desirable\\) or false \\(undesirable\\), got 1"),
    ({"prompt": "a", "completion": "b", "label": "true"}, "row 3: 'label' must be true"),
    ({"prompt": "a", "label": True}, "row 3: no 'completion'; a KTO row has "
                                     "prompt/completion/label, or messages \\+ label"),
    ({"completion": "b", "label": False}, "row 3: no 'prompt'"),
    ({"prompt": "a", "completion": "b"}, "row 3: no 'label' \\(the row has 'prompt', "
                                         "'completion'\\)"),
    ({"prompt": "a", "completion": 5, "label": True}, "row 3: 'completion' must be text"),
    ({"messages": [{"role": "user", "content": "a"}], "label": True},
     "row 3: the last message must be the assistant's"),
    ({"prompt": "a", "chosen": "b"}, "row 3: no 'rejected' answer"),
    ({"prompt": [{"role": "user", "content": "a"}], "completion": "b", "label": True},
     "row 3: 'prompt' is a list of messages but 'completion' is text"),
])
def test_malformed_rows_name_the_row(row, message):
    from swift_mcore.data.unpaired import to_unpaired
    from swift_mcore.errors import ArgumentError

    with pytest.raises(ArgumentError, match=message):
        to_unpaired(row, "--dataset d.jsonl, row 3")


def test_prompts_that_fill_max_length_are_counted_and_refused(tiny_hf):
    from transformers import AutoTokenizer

    from swift_mcore.data.unpaired import UnpairedReport, encode_unpaired, to_unpaired
    from swift_mcore.errors import ArgumentError

    hf = AutoTokenizer.from_pretrained(str(tiny_hf[0]))
    rows = [{"prompt": "x", "completion": "y", "label": True},
            {"prompt": "def add(a, b): " * 8, "completion": "y", "label": False}]
    unpaired = [u for i, r in enumerate(rows)
                for u in to_unpaired(r, f"--dataset d.jsonl, row {i}")]
    with pytest.raises(ArgumentError, match=r"^1 of 2 rows have a prompt of --max_length 16 "
                                            r"tokens or more.*\(first: --dataset d.jsonl, "
                                            r"row 1\)"):
        encode_unpaired(unpaired, hf, 16, "keep_start", UnpairedReport())
    report = UnpairedReport()
    assert len(encode_unpaired(unpaired, hf, 16, "keep_end", report)) == 2
    assert (report.truncated, report.desirable) == (1, 1)


def test_unbalanced_classes_get_trls_weight_advice():
    from swift_mcore.data.unpaired import UnpairedReport, weight_advice

    report = UnpairedReport(pairs=4, desirable=3)
    assert weight_advice(report, 1.0, 1.0) == (
        "3 desirable and 1 undesirable rows: the KTO paper recommends either "
        "--desirable_weight in [0.33, 0.44] or --undesirable_weight in [2.26, 3.0] (not both)")
    assert weight_advice(report, 0.4, 1.0) is None
    assert weight_advice(UnpairedReport(pairs=4, desirable=2), 1.0, 1.0) is None
