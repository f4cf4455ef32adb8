"""swift-mcore sft runs: exact token averaging across layouts, exact resume, epochs, custom loss."""

import importlib.util
import json
import random
import re
import subprocess
import sys

import pytest

from run_helpers import ROOT, TINY, child_env, free_port, losses, run_sft, train_records

WORDS = ("alpha beta gamma delta river stone cloud paper orange silver seven north winter "
         "garden quiet simple").split()


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    """40 conversations of very different lengths (1 to 3 turns), so micro-batches hold
    different numbers of answer tokens: a mean of per-batch means would not be the token
    mean."""
    rng = random.Random(3)
    path = tmp_path_factory.mktemp("sft") / "train.jsonl"

    def text(lo, hi):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    with open(path, "w") as fh:
        for _ in range(40):
            messages = []
            for _ in range(rng.randint(1, 3)):
                messages += [{"role": "user", "content": text(1, 6)},
                             {"role": "assistant", "content": text(1, 8)}]
            fh.write(json.dumps({"messages": messages}) + "\n")
    return path


DATA = ("--seq_length", "192", "--template", "plain")


def sft(out, data, *flags, **kwargs):
    return run_sft(out, "--dataset", data, *DATA, *flags, **kwargs)


def sft_one_rank(sft_here, out, data, *flags, **kwargs):
    """sft() on one rank in this process: for the runs whose process is not what a test
    checks (the resume test restarts real processes)."""
    return sft_here(out, "--dataset", data, *DATA, *flags, **kwargs)


def assert_close(a, b, tol=1e-5):
    assert sorted(a) == sorted(b)
    for it in a:
        assert abs(a[it] - b[it]) <= tol, (it, a[it], b[it])


def layout_flags(packing):
    return ["--train_iters", "3", "--no_save", "--packing", packing, "--global_batch_size",
            "8", "--log_sample_ids"]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, conversations, sft_here):
    """layouts(packing): a folder with the same 3 iterations (global batch 8) run on three
    layouts, mb4 (DP=1, 2 micro-batches of 4), mb1 (DP=1, 8 of 1) and dp2 (2 ranks, 2 of 2
    each); run once per --packing value and shared (--log_sample_ids changes no number)."""
    runs = {}

    def get(packing):
        if packing not in runs:
            base = tmp_path_factory.mktemp(f"layouts_packing_{packing}")
            common = layout_flags(packing)
            sft_one_rank(sft_here, base / "mb4", conversations, *common, "--micro_batch_size",
                         "4")
            sft_one_rank(sft_here, base / "mb1", conversations, *common, "--micro_batch_size",
                         "1")
            sft(base / "dp2", conversations, *common, "--micro_batch_size", "2", nproc=2)
            runs[packing] = base
        return runs[packing]

    return get


@pytest.mark.parametrize("packing", ["false", "true"])
def test_loss_is_the_token_mean_whatever_the_layout(layouts, packing):
    """DP=1 with 2 micro-batches, DP=1 with 8 and DP=2 give the same losses: the loss is
    summed over answer tokens and divided by the global batch's count, on every layout."""
    runs = layouts(packing)
    reference = losses(runs / "mb4")
    assert sorted(reference) == [1, 2, 3]
    assert_close(reference, losses(runs / "mb1"))
    assert_close(reference, losses(runs / "dp2"))
    # Real tokens (those behind tokens/s) are the same on every layout, though each layout
    # pads differently (1 row per micro-batch pads nothing).
    counts = [[r["tokens"] for r in train_records(runs / d)] for d in ("mb4", "mb1", "dp2")]
    assert counts[0] == counts[1] == counts[2] and all(n > 0 for n in counts[0])


def test_pipeline_parallel_packed_rows_match_one_stage(tmp_path, conversations, sft_here):
    """PP=2 pads to --seq_length and gives every stage the packed mask: from the same
    weights (a PP=1 checkpoint) it trains as PP=1 does."""
    common = ["--packing", "--micro_batch_size", "2", "--global_batch_size", "4"]
    sft_one_rank(sft_here, tmp_path / "base", conversations, *common, "--train_iters", "1")
    load = ["--load", tmp_path / "base" / "checkpoint", "--finetune", "--train_iters", "2",
            "--no_save"]
    sft_one_rank(sft_here, tmp_path / "pp1", conversations, *common, *load)
    sft(tmp_path / "pp2", conversations, *common, *load, "--pipeline_model_parallel_size",
        "2", nproc=2)
    assert_close(losses(tmp_path / "pp1"), losses(tmp_path / "pp2"))


def test_resume_is_bit_exact(tmp_path, conversations):
    flags = ["--train_iters", "6", "--packing", "--num_workers", "1", "--log_sample_ids",
             "--micro_batch_size", "2", "--global_batch_size", "4", "--hidden_dropout", "0.1"]
    # the straight run saves at iteration 3; a new process resumes from there
    sft(tmp_path / "whole", conversations, *flags, "--save_steps", "3",
        env={"MASTER_PORT": str(free_port())})
    split = tmp_path / "split"
    proc = sft(split, conversations, *flags, "--resume",
               tmp_path / "whole" / "checkpoint" / "iter_0000003")
    assert "starting at iteration 3" in proc.stdout
    whole = losses(tmp_path / "whole")
    assert sorted(whole) == [1, 2, 3, 4, 5, 6]
    assert losses(split) == {it: whole[it] for it in (4, 5, 6)}  # bit-equal, dropout included

    def ids(out):
        return [json.loads(line) for line in (out / "sample_ids.jsonl").read_text().splitlines()]

    assert ids(split) == ids(tmp_path / "whole")[3:]


def test_num_train_epochs_sets_the_length(tmp_path, conversations, sft_here):
    proc = sft_one_rank(sft_here, tmp_path / "unpacked", conversations, "--num_train_epochs",
                        "1.5", "--no_save", "--global_batch_size", "8")
    assert "40 of 40 conversations kept" in proc.stdout
    assert max(losses(tmp_path / "unpacked")) == 8  # ceil(1.5 * 40 / 8)
    proc = sft_one_rank(sft_here, tmp_path / "packed", conversations, "--num_train_epochs",
                        "2", "--packing", "--no_save", "--global_batch_size", "4")
    rows = int(re.search(r"packed into (\d+) rows", proc.stdout).group(1))
    assert rows < 40
    assert max(losses(tmp_path / "packed")) == -(-2 * rows // 4)


def test_custom_trainer_overrides_the_loss(tmp_path, conversations, layouts, sft_here):
    # The plain loss is the layouts' unpacked mb4 run: these are its flags.
    plain = losses(layouts("false") / "mb4")
    flags = [*layout_flags("false"), "--micro_batch_size", "4"]
    # The example's command line, as a user runs it, with the plain loss (--smoothing 0).
    # The same flags as sft() above: TINY, this data, plain template.
    out = tmp_path / "s0"
    cmd = [sys.executable, "examples/custom_trainer.py", "sft", "--smoothing", "0", *TINY,
           "--dataset", str(conversations), *DATA, *flags, "--output_dir", str(out)]
    # child_env: without the MASTER_PORT this module's gloo group holds
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT,
                          env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "custom trainer finished at iteration 3" in proc.stdout
    assert_close(losses(out), plain)
    # Its trainer class with label smoothing, in this process: another loss.
    spec = importlib.util.spec_from_file_location("custom_trainer",
                                                  ROOT / "examples" / "custom_trainer.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    class Smoothed(example.LabelSmoothingTrainer):
        smoothing = 0.5

    sft_one_rank(sft_here, tmp_path / "s1", conversations, *flags, trainer=Smoothed)
    smoothed = losses(tmp_path / "s1")
    assert all(abs(smoothed[i] - plain[i]) > 1e-4 for i in (1, 2, 3)), (smoothed, plain)


def test_end_to_end_example_reproduces_the_answers(tmp_path):
    proc = subprocess.run(["bash", "examples/sft/run.sh", str(tmp_path / "example")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=child_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "24/24 answers reproduced" in proc.stdout
    hf = next((tmp_path / "example" / "run" / "checkpoint").glob("iter_*-hf"))
    assert (hf / "config.json").is_file() and (hf / "tokenizer.json").is_file()
    # The exported tokenizer carries the training template as its chat template.
    from swift_mcore.data.templates import Template
    from swift_mcore.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(hf))
    conversation = [{"role": "user", "content": "Which planet does Ada live on?"},
                    {"role": "assistant", "content": "Jupiter"}]
    exported = Template("auto", tokenizer)
    assert exported.name == "tokenizer"
    for got, want in zip(exported.encode(conversation),
                         Template("plain", tokenizer).encode(conversation)):
        assert got.tolist() == want.tolist()


def test_tokens_count_real_tokens_not_padding(layouts, conversations):
    """metrics.jsonl's tokens (and so tokens/s) are the conversations' own positions: the
    padding of each micro-batch is left out (the unpacked layouts' run of 2 micro-batches of
    4 per iteration)."""
    from swift_mcore.arguments import SftArguments
    from swift_mcore.data import default_tokenizer
    from swift_mcore.data.sampler import GlobalOrder
    from swift_mcore.data.sft_datasets import build_sft_datasets
    from swift_mcore.run_config import resolve

    run = layouts("false") / "mb4"
    args = SftArguments.from_flags(dataset=[str(conversations)], seq_length=192,
                                   template="plain")
    args = resolve(args, world_size=1)
    train, _, _ = build_sft_datasets(args, default_tokenizer(), log=lambda line: None)
    order = GlobalOrder(len(train), args.training.seed)
    logged = [json.loads(line) for line in
              (run / "sample_ids.jsonl").read_text().splitlines()]
    assert len(logged) == len(train_records(run)) == 3
    for record, metrics in zip(logged, train_records(run)):
        real = sum(len(train[order[p]]["tokens"]) for p in record["sample_ids"])
        assert metrics["tokens"] == real  # less than the padded batch: lengths differ
        assert real < 8 * max(len(train[order[p]]["tokens"]) for p in record["sample_ids"])
