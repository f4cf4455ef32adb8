"""A multi-turn Qwen3-style sft run (reasoning dropped from the history: one sample per
turn) trains through the Python API and its loss falls; then the same script starts
`swift-mcore export` with a plain subprocess, which must not inherit the finished Trainer's
launch variables (RANK, WORLD_SIZE, MASTER_PORT)."""

import json
import os
import subprocess
import sys

from chat_templates import qwen3
from run_helpers import ROOT

SCRIPT = """
import json, os, subprocess, sys

from swift_mcore import SftArguments, Trainer

if __name__ == "__main__":  # dist_checkpointing's writers import the script again
    out, tokenizer, data = sys.argv[1:4]
    args = SftArguments.from_flags(
        tokenizer=tokenizer, dataset=[data], template="tokenizer", output_dir=out,
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        seq_length=160, micro_batch_size=4, global_batch_size=8, train_iters=24, lr=3e-3,
        min_lr=3e-3, lr_decay_style="constant", log_interval=1, eval_steps=0, save_steps=24,
        progress_bar=False, tensorboard=False, plot=False, num_workers=0)
    Trainer(args).train()
    leaked = sorted(k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                "MASTER_PORT") if k in os.environ)
    export = subprocess.run([sys.executable, "-m", "swift_mcore", "export", "--model",
                             os.path.join(out, "checkpoint"), "--to_hf", "--output_dir",
                             os.path.join(out, "hf")], capture_output=True, text=True)
    print(json.dumps({"leaked": leaked, "export_rc": export.returncode,
                      "export_err": export.stderr[-2000:]}))
"""

WORDS = "red green blue seven nine river stone north quiet simple".split()


def write_rows(path, count=16):
    """Two user turns each; every answer has reasoning, which Qwen3 drops from the history."""
    rows = []
    for k in range(count):
        a, b = WORDS[k % 10], WORDS[(3 * k + 1) % 10]
        rows.append({"messages": [
            {"role": "user", "content": f"Say {a}."},
            {"role": "assistant", "content": f"{a} {a}.", "reasoning_content": f"repeat {a}"},
            {"role": "user", "content": f"Now {b}."},
            {"role": "assistant", "content": f"{b} {b} {b}.",
             "reasoning_content": f"thrice {b}"}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_qwen3_multi_turn_trains_then_a_plain_subprocess_exports(tmp_path):
    tokenizer = tmp_path / "qwen3-tokenizer"
    qwen3().save_pretrained(str(tokenizer))
    data = write_rows(tmp_path / "chat.jsonl")
    script = tmp_path / "train_then_export.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "NPROC_PER_NODE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(script), str(out), str(tokenizer), str(data)],
                          capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # 16 conversations, each split in two samples (its second turn after the re-rendered
    # history): 32 samples
    assert "32 of 32 samples kept from 16 conversations (16 split" in proc.stdout + proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["leaked"] == [] and report["export_rc"] == 0, report
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["split"] == "train"]
    assert len(losses) == 24
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.5 * first, losses
    exported = json.loads((out / "hf" / "tokenizer_config.json").read_text())
    template = exported.get("chat_template") or (out / "hf" / "chat_template.jinja").read_text()
    assert "last_query_index" in template  # the Qwen3 template travels with the model
