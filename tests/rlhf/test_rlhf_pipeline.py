"""Every rlhf task under pipeline parallelism (PP=2): KTO (its reference and KL rows passed
between the stages beside the policy's), the reward model (its score head on the last
stage), ORPO, SimPO and DPO with --precompute_ref_log_probs give the one-rank losses and
metrics, as DPO and KTO do under the interleaved schedule; a PP=2 reward model saved midway
resumes bit-exactly and exports a folder AutoModelForSequenceClassification loads."""

import json
import subprocess
import sys

import pytest

import hf_helpers as H
from in_process import train_in_process
from rlhf_helpers import run_flags
from run_helpers import ROOT, child_env


def curve(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r for r in rows if r.get("split") == "train"}


def task_metrics(rlhf_type):
    from swift_mcore.training import kto_loss, reference_free_loss, reward_loss
    from swift_mcore.training.dpo_loss import METRICS

    return {"kto": kto_loss.METRICS, "rm": (*reward_loss.METRICS, *reward_loss.EXTREMES),
            "orpo": reference_free_loss.ORPO_METRICS,
            "simpo": reference_free_loss.SIMPO_METRICS, "dpo": METRICS}[rlhf_type]


def two_ranks(out, *flags, timeout=300):
    env = child_env(NPROC_PER_NODE="2", MASTER_PORT=str(H.free_port()))
    proc = subprocess.run([sys.executable, "-m", "swift_mcore", "rlhf", *map(str, flags),
                           "--pipeline_model_parallel_size", "2", "--output_dir", str(out)],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


TASKS = {
    "kto": ["--rlhf_type", "kto", "--micro_batch_size", "2", "--global_batch_size", "4"],
    # no KL term: the stages pass the policy's and the reference's rows only
    "kto_apo_zero_unpaired": ["--rlhf_type", "kto", "--loss_type", "apo_zero_unpaired",
                              "--micro_batch_size", "1", "--global_batch_size", "2"],
    "rm": ["--rlhf_type", "rm", "--micro_batch_size", "1", "--global_batch_size", "2"],
    "orpo": ["--rlhf_type", "orpo", "--micro_batch_size", "1", "--global_batch_size", "2"],
    "simpo": ["--rlhf_type", "simpo", "--cpo_alpha", "0.5", "--micro_batch_size", "1",
              "--global_batch_size", "2"],
    # three pairs a micro-batch: the pass before training ends on a partial micro-batch
    "dpo_precompute": ["--precompute_ref_log_probs", "--micro_batch_size", "3",
                       "--global_batch_size", "3"],
}


@pytest.mark.benchmark
@pytest.mark.parametrize("task", sorted(TASKS))
def test_pipeline_parallel_gives_the_one_rank_losses(task, tiny_hf, kto_file, tmp_path,
                                                     gloo_group):
    from swift_mcore.arguments import RlhfArguments, parse_args
    from swift_mcore.cli import trainer_class
    from swift_mcore.run_config import resolve

    folder, data = tiny_hf
    flags = ["--model", folder, "--dataset", kto_file if task.startswith("kto") else data,
             "--train_iters", "3", "--no_save", *run_flags(*TASKS[task])]
    if task == "dpo_precompute":
        flags += ["--rpo_alpha", "0.5"]
    config = resolve(parse_args([*map(str, flags), "--output_dir", str(tmp_path / "one")],
                                prog="swift-mcore rlhf", cls=RlhfArguments), world_size=1)
    train_in_process(tmp_path / "one", *flags, command="rlhf", base=[],
                     trainer=trainer_class(config))
    two_ranks(tmp_path / "pp2", *flags)
    one, pp2 = curve(tmp_path / "one"), curve(tmp_path / "pp2")
    assert sorted(one) == sorted(pp2) == [1, 2, 3]
    names = ("loss", *task_metrics(config.rlhf.rlhf_type))
    for it in one:
        # kto logs a class's metrics only for a batch that has rows of it (as TRL)
        assert [n for n in names if n in pp2[it]] == [n for n in names if n in one[it]], it
        for name in (n for n in names if n in one[it]):
            # within 1e-5, or 1e-6 of the value for summed log-probabilities (float32
            # holds ~40 to ~4e-6)
            assert pp2[it][name] == pytest.approx(one[it][name], abs=1e-5, rel=1e-6), \
                (it, name)
        # a norm over every gradient: float32 sums in another order (rows padded to
        # --seq_length under stages) differ in the sixth digit
        assert pp2[it]["grad_norm"] == pytest.approx(one[it]["grad_norm"], rel=1e-5), it
    assert one[1]["loss"] != one[3]["loss"]  # it trained
    if task == "dpo_precompute":
        assert (tmp_path / "pp2" / "ref_logps.safetensors").is_file()


@pytest.fixture(scope="module")
def deep_hf(tmp_path_factory):
    """A 4-layer tiny Llama: two stages of two virtual stages of one layer each."""
    folder = tmp_path_factory.mktemp("deep") / "hf"
    H.make_model(str(folder), "llama", initializer_range=0.02, num_hidden_layers=4)
    return folder


INTERLEAVED = {
    "dpo": ["--rpo_alpha", "0.5", "--micro_batch_size", "1", "--global_batch_size", "2"],
    "kto": ["--rlhf_type", "kto", "--micro_batch_size", "2", "--global_batch_size", "4"],
    # four pairs, three a micro-batch: the pass before training fills two micro-batches
    "dpo_precompute": ["--precompute_ref_log_probs", "--micro_batch_size", "3",
                       "--global_batch_size", "6"],
}
# LoRA: adapters in every chunk, the reference the chunks with their adapters off (the
# adapters start at zero: a larger step moves them)
LORA = ["--tuner_type", "lora", "--lora_dropout", "0", "--lr", "1e-2", "--min_lr", "1e-2"]
INTERLEAVED.update(dpo_lora=[*INTERLEAVED["dpo"], *LORA], kto_lora=[*INTERLEAVED["kto"], *LORA])


@pytest.mark.benchmark
@pytest.mark.parametrize("task", sorted(INTERLEAVED))
def test_the_interleaved_schedule_gives_the_one_rank_losses(task, deep_hf, tiny_hf, kto_file,
                                                            tmp_path, gloo_group):
    from swift_mcore.arguments import RlhfArguments, parse_args
    from swift_mcore.cli import trainer_class
    from swift_mcore.run_config import resolve

    data = kto_file if task.startswith("kto") else tiny_hf[1]
    flags = ["--model", deep_hf, "--dataset", data, "--train_iters", "3", "--no_save",
             *run_flags(*INTERLEAVED[task])]
    config = resolve(parse_args([*map(str, flags), "--output_dir", str(tmp_path / "one")],
                                prog="swift-mcore rlhf", cls=RlhfArguments), world_size=1)
    train_in_process(tmp_path / "one", *flags, command="rlhf", base=[],
                     trainer=trainer_class(config))
    two_ranks(tmp_path / "vp2", *flags, "--num_virtual_stages_per_pipeline_rank", "2")
    one, vp2 = curve(tmp_path / "one"), curve(tmp_path / "vp2")
    assert sorted(one) == sorted(vp2) == [1, 2, 3]
    for it in one:
        for name in ("loss", *task_metrics(config.rlhf.rlhf_type)):
            assert vp2[it][name] == pytest.approx(one[it][name], abs=1e-5, rel=1e-6), \
                (it, name)
        assert vp2[it]["grad_norm"] == pytest.approx(one[it]["grad_norm"], rel=1e-5), it
    assert one[1]["loss"] != one[3]["loss"]  # it trained


def hf_scores(folder, sequences):
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(folder))
    with torch.no_grad():
        return torch.cat([model(input_ids=torch.tensor([s])).logits[:, 0]
                          for s in sequences])


@pytest.mark.slow
def test_a_pipeline_reward_model_resumes_bit_exactly_and_exports(tiny_hf, tmp_path,
                                                                  gloo_group):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from swift_mcore.loaded_model import load_model
    from swift_mcore.models.value_head import score_sequences

    folder, data = tiny_hf
    flags = ["--rlhf_type", "rm", "--model", folder, "--dataset", data,
             "--train_iters", "4", *run_flags(*TASKS["rm"])]
    # the straight run saves at iteration 2; new processes resume from there
    two_ranks(tmp_path / "whole", *flags, "--save_steps", "2")
    split = tmp_path / "split"
    proc = two_ranks(split, *flags, "--resume",
                     tmp_path / "whole" / "checkpoint" / "iter_0000002")
    assert "starting at iteration 2" in proc.stdout
    whole = curve(tmp_path / "whole")
    assert sorted(whole) == [1, 2, 3, 4] and sorted(curve(split)) == [3, 4]
    for it, row in curve(split).items():
        for name in ("loss", "grad_norm", *task_metrics("rm")):
            assert row[name] == whole[it][name], (it, name)  # bit for bit
    assert whole[4]["rewards/margins"] > whole[1]["rewards/margins"]

    out = tmp_path / "hf"
    H.convert(split, out, "to_hf")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    _, info = AutoModelForSequenceClassification.from_pretrained(
        str(out), output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    sequences = [tokenizer(text=t + tokenizer.eos_token)["input_ids"]
                 for t in ("def add(a, b):\n    return a + b", "x = 1 + 2", "return")]
    theirs = hf_scores(out, sequences)
    loaded = load_model(str(split), log=lambda line: None)
    ours = score_sequences(loaded.model, sequences, tokenizer.eos_token_id)[:, 0]
    assert theirs.std() > 1e-4
    assert (ours - theirs).abs().max().item() <= 1e-5


class Indexed:
    """Five pairs whose collated micro-batch is their indices, chosen then rejected."""

    def __len__(self):
        return 5

    def __getitem__(self, index):
        return index

    def collate(self, items):
        import torch

        return torch.tensor(items + [-1 - i for i in items], dtype=torch.float)


@pytest.mark.parametrize("groups, count", [(1, 3), (2, 4)])
def test_the_reference_pass_through_stages_fills_micro_batches_and_drops_the_fill(groups,
                                                                                 count):
    import torch

    from swift_mcore.training.ref_log_probs import compute_in_stages

    seen = []

    def last_stage(batches, n):
        seen.extend(batches)
        assert n == len(seen) == count  # full micro-batches, in groups of the stages
        return seen

    table = compute_in_stages(Indexed(), 2, last_stage, groups)
    # the last real micro-batch [4, 0] is filled up with pair 0; the group's fill is dropped
    assert seen[2].tolist() == [4, 0, -5, -1]
    assert table.tolist() == [[i, -1 - i] for i in range(5)]
    other = compute_in_stages(Indexed(), 2, lambda batches, n: [], groups)
    assert torch.equal(other, torch.zeros(5, 2))  # another stage: zeros, summed away
