"""`swift-mcore preprocess`: every input format round-trips, any worker count writes the same
bytes, bad input is refused naming the file, and a failed run leaves the old output alone."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from swift_mcore.errors import ArgumentError
from swift_mcore.data import encoding, sources
from swift_mcore.data.indexed import check_indexed
from swift_mcore.preprocess import PreprocessArguments, parse, preprocess

from data_helpers import make_documents
from run_helpers import read_documents

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["def f(x):\n    return x + 1\n", "naïve café ✓", "", "plain words here", None, "z"]


def run(*argv):
    return preprocess(parse([*map(str, argv), "--progress_bar", "false"]))


def expected_ids(tokenizer, texts, eod=True):
    return [tokenizer.encode(t) + ([tokenizer.eod] if eod else []) for t in texts if t]


def write_every_format(folder):
    """The same six values in each format; the .txt holds one document per line, so it gets
    texts without newlines."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(exist_ok=True)
    with open(folder / "a.jsonl", "w", encoding="utf-8") as fh:
        for t in TEXTS:
            fh.write(json.dumps({"id": 1, "text": t}) + "\n")
    (folder / "b.json").write_text(json.dumps([{"text": t} for t in TEXTS]), encoding="utf-8")
    pq.write_table(pa.table({"text": TEXTS, "n": list(range(len(TEXTS)))}),
                   str(folder / "c.parquet"))
    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(str(folder / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS[:2]}),
                          "test": datasets.Dataset.from_dict({"text": ["other"]})}
                         ).save_to_disk(str(folder / "saved_dict"))
    lines = [t.replace("\n", " ") if t else "" for t in TEXTS]
    (folder / "d.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return lines


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("inputs")
    lines = write_every_format(folder)
    return folder, lines


@pytest.mark.parametrize("name", ["a.jsonl", "b.json", "c.parquet", "saved", "saved_dict",
                                  "d.txt"])
def test_every_format_round_trips(name, inputs, tokenizer, tmp_path):
    folder, lines = inputs
    prefix = tmp_path / "out" / "data"
    summary = run("--input", folder / name, "--output_prefix", prefix, "--workers", 1)
    texts = {"d.txt": lines, "saved_dict": TEXTS[:2]}.get(name, TEXTS)
    want = expected_ids(tokenizer, texts)
    assert read_documents(str(prefix)) == want
    assert check_indexed(str(prefix))["documents"] == len(want)
    assert summary["documents"] == len(want) and summary["tokens"] == sum(map(len, want))
    assert summary["empty_skipped"] == len(texts) - len(want)
    assert sorted(os.listdir(prefix.parent)) == ["data.bin", "data.hash.json", "data.idx"]


def test_globs_folders_and_a_hf_tokenizer_folder(inputs, tokenizer, tmp_path):
    folder, lines = inputs
    tokenizer.save_pretrained(str(tmp_path / "tok"))
    prefix = str(tmp_path / "data.bin")  # a suffix on the prefix is dropped
    run("--input", folder / "*.json*", folder / "c.parquet", "--output_prefix", prefix,
        "--tokenizer", tmp_path / "tok", "--append_eod", "false", "--workers", 1)
    # The glob's matches are sorted: a.jsonl, b.json -> b.json first.
    assert read_documents(str(tmp_path / "data")) == expected_ids(tokenizer, TEXTS * 3, False)


def test_a_folder_holds_files_and_saved_datasets(inputs, tokenizer, tmp_path):
    import shutil

    folder, _ = inputs
    tree = tmp_path / "tree"
    shutil.copytree(folder / "saved", tree / "b_saved")
    shutil.copy(folder / "a.jsonl", tree / "a.jsonl")
    (tree / ".hidden").mkdir()
    (tree / ".hidden" / "x.json").write_text("not json")
    (tree / "notes.md").write_text("ignored")
    found = sources.expand_inputs([str(tree)])
    assert [(os.path.basename(s.path), s.kind) for s in found] == [("a.jsonl", "json"),
                                                                  ("b_saved", "saved")]
    run("--input", tree, "--output_prefix", tmp_path / "data", "--workers", 1)
    assert read_documents(str(tmp_path / "data")) == expected_ids(tokenizer, TEXTS * 2)


def test_any_worker_count_writes_the_same_bytes(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(encoding, "CHUNK_DOCUMENTS", 7)  # many chunks, in flight out of order
    docs = make_documents(300, seed=3, min_words=1, max_words=60) + [""] * 5
    for i, part in enumerate((docs[:170], docs[170:])):
        with open(tmp_path / f"part{i}.jsonl", "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps({"text": t}) + "\n" for t in part)
    found = sources.expand_inputs([str(tmp_path / "part*.jsonl")])
    outputs = []
    for workers in (1, 3):
        prefix = str(tmp_path / f"w{workers}")
        stats = encoding.encode_sources(found, "text", tokenizer, prefix, workers=workers)
        assert stats.documents == 300 and stats.empty == 5
        outputs.append([Path(prefix + s).read_bytes() for s in (".bin", ".idx")])
    assert outputs[0] == outputs[1]
    assert read_documents(str(tmp_path / "w3")) == expected_ids(tokenizer, docs)


def good_output(tokenizer, tmp_path):
    prefix = tmp_path / "out" / "data"
    (tmp_path / "good.jsonl").write_text('{"text": "the good data"}\n')
    run("--input", tmp_path / "good.jsonl", "--output_prefix", prefix, "--workers", 1)
    return prefix, {s: (prefix.parent / f"data{s}").read_bytes() for s in (".bin", ".idx")}


BAD_INPUTS = {
    "missing.jsonl": (None, r"missing\.jsonl: no such file"),
    "empty.jsonl": ("", r"empty\.jsonl: is empty"),
    "blank.txt": ("\n\n", r"blank\.txt: holds no text"),
    "header.csv": ("text,other\n", r"header\.csv: is empty \(no rows\)"),
    "other_column.jsonl": ('{"content": "x"}\n', r"other_column\.jsonl: no 'text' column "
                                                 r"\(it has 'content'\).*--text_key"),
    "list_column.jsonl": ('{"text": ["a"]}\n', r"list_column\.jsonl: column 'text' holds list"),
    "broken.jsonl": ('{"text": "a"}\n{"text": nope}\n', r"broken\.jsonl: cannot be read as json"),
    "notes.xml": ("<a/>", r"notes\.xml: unsupported file type '\.xml'"),
    "folder": (None, r"folder: the folder holds no"),
    "*.none": (None, r"\*\.none: no file matches"),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_names_the_file_and_keeps_the_old_output(name, tokenizer, tmp_path):
    prefix, before = good_output(tokenizer, tmp_path)
    content, message = BAD_INPUTS[name]
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    elif name == "folder":
        path.mkdir()
        (path / "readme.md").write_text("not data")
    with pytest.raises(ArgumentError, match=message):
        # After a good file: a bad one later in the list still stops the run before writing.
        run("--input", tmp_path / "good.jsonl", path, "--output_prefix", prefix, "--workers", 2)
    after = {s: (prefix.parent / f"data{s}").read_bytes() for s in (".bin", ".idx")}
    assert after == before
    assert sorted(os.listdir(prefix.parent)) == ["data.bin", "data.hash.json", "data.idx"]


def test_missing_column_in_a_saved_dataset_and_a_parquet_file(tokenizer, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    datasets.Dataset.from_dict({"body": ["x"]}).save_to_disk(str(tmp_path / "saved"))
    pq.write_table(pa.table({"body": ["x"]}), str(tmp_path / "p.parquet"))
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": ["x"]})}).save_to_disk(
        str(tmp_path / "no_train"))
    for name, message in (("saved", r"saved: no 'text' column \(it has 'body'\)"),
                          ("p.parquet", r"p\.parquet: no 'text' column"),
                          ("no_train", r"no_train: a saved DatasetDict without a 'train'")):
        with pytest.raises(ArgumentError, match=message):
            run("--input", tmp_path / name, "--output_prefix", tmp_path / "out", "--workers", 1)
    assert not list(tmp_path.glob("out*"))


def test_interrupted_run_keeps_the_old_output(tokenizer, tmp_path):
    prefix, before = good_output(tokenizer, tmp_path)
    (tmp_path / "big.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in make_documents(50, seed=1)))

    def interrupt(stats):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        encoding.encode_sources(sources.expand_inputs([str(tmp_path / "big.jsonl")]), "text",
                                tokenizer, str(prefix), workers=2, on_progress=interrupt)
    assert {s: (prefix.parent / f"data{s}").read_bytes() for s in (".bin", ".idx")} == before
    assert sorted(os.listdir(prefix.parent)) == ["data.bin", "data.hash.json", "data.idx"]


@pytest.mark.parametrize("plant", ["foreign_bin", "symlinked_idx", "hard_linked_bin"])
def test_output_prefix_never_replaces_files_it_did_not_write(plant, tokenizer, tmp_path):
    """Issue 35.2's rule for preprocess: PREFIX.bin/.idx may replace an earlier pair this
    command wrote (tested above), never another file or a file reached through a link."""
    (tmp_path / "good.jsonl").write_text(json.dumps({"text": "some words"}) + "\n")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    prefix = tmp_path / "out"
    if plant == "foreign_bin":
        victim = tmp_path / "out.bin"
        victim.write_text("a file preprocess did not write")
    elif plant == "symlinked_idx":
        os.symlink(tmp_path / "victim.txt", tmp_path / "out.idx")
    else:
        os.link(tmp_path / "victim.txt", tmp_path / "out.bin")
    before = victim.read_bytes()
    with pytest.raises(ArgumentError, match=r"--output_prefix: .*out\.(bin|idx)"):
        run("--input", tmp_path / "good.jsonl", "--output_prefix", prefix, "--workers", 1)
    assert victim.read_bytes() == before


def test_rerunning_over_its_own_output_replaces_it(tokenizer, tmp_path):
    prefix, before = good_output(tokenizer, tmp_path)
    run("--input", tmp_path / "good.jsonl", "--output_prefix", prefix, "--workers", 1)
    assert {s: (prefix.parent / f"data{s}").read_bytes() for s in (".bin", ".idx")} == before


@pytest.mark.parametrize("argv, message", [
    ([], "--input is required"),
    (["--input", "x.jsonl"], "--output_prefix is required"),
    (["--input", "x.jsonl", "--output_prefix", "o", "--workers", "0"], "--workers must be"),
    (["--input", "x.jsonl", "--output_prefix", "o", "--workers", "two"], "--workers takes an"),
])
def test_flag_errors(argv, message):
    with pytest.raises(ArgumentError, match=message):
        parse(argv)


def test_command_line_prints_progress_and_a_summary(inputs, tmp_path):
    folder, _ = inputs
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-m", "swift_mcore", "preprocess", "--input", str(folder / "a.jsonl"),
         "--output_prefix", str(tmp_path / "data"), "--workers", "2"],
        capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "docs/s" in proc.stderr and "tokens/s" in proc.stderr  # the tqdm bar
    out = proc.stdout
    assert f"wrote {tmp_path / 'data'}.bin" in out
    for word in ("documents  4 from 1 input(s)", "tokens", "documents/s", "tokens/s",
                 f"swift-mcore pt --data_path {tmp_path / 'data'}"):
        assert word in out, out
    bad = subprocess.run(
        [sys.executable, "-m", "swift_mcore", "preprocess", "--input", str(tmp_path / "no.jsonl"),
         "--output_prefix", str(tmp_path / "data2")],
        capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    assert bad.returncode == 2
    assert "swift-mcore preprocess: error: --input" in bad.stderr and "no.jsonl" in bad.stderr
    assert not (tmp_path / "data2.bin").exists()


def test_flag_table_in_docs_is_current():
    from swift_mcore.arguments.reference import flag_table

    table = "\n".join(flag_table(PreprocessArguments))
    assert table in (ROOT / "docs" / "data.md").read_text(), (
        "docs/data.md's preprocess flag table is stale: paste flag_table(PreprocessArguments)")


@pytest.mark.parametrize("layout", ["jsonl", "jsonl_with_blank_lines", "json_array"])
def test_a_bad_line_deep_in_a_large_file_is_named_by_its_line_in_the_file(
        layout, tokenizer, tmp_path, capsys):
    """pyarrow reads a large file in blocks (~320 KB, ~7800 of these lines) and counts rows
    from each block's start ("row 3172" here); the error names the file's own 1-based line
    instead (found by re-reading the file)."""
    from swift_mcore.cli import main

    bad_line = 11003  # in the second block; not one of the blank lines
    lines = []
    for number in range(1, 12001):
        if layout == "jsonl_with_blank_lines" and number % 7 == 0:
            lines.append("")
        elif number == bad_line:
            lines.append('{"text": nope}')
        else:
            lines.append(json.dumps({"text": f"document {number} of a large file"}))
    if layout == "json_array":  # one JSON document: "[", then one row per line
        lines = ["["] + [line + "," for line in lines[1:-1]] + [lines[-1], "]"]
    path = tmp_path / f"large.{'json' if layout == 'json_array' else 'jsonl'}"
    path.write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    assert main(["preprocess", "--input", str(path), "--output_prefix", str(tmp_path / "out"),
                 "--workers", "1", "--progress_bar", "false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"swift-mcore preprocess: error: --input "
                                               f"{path}: cannot be read as json data (line "
                                               f"{bad_line}: "), err
    assert not list(tmp_path.glob("out*"))
