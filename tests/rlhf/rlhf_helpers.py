"""The rlhf tests' tiny data and flags."""

ROWS = [
    {"prompt": "def add(a, b):", "chosen": "\n    return a + b", "rejected": " pass"},
    {"prompt": "def sub(a, b):", "chosen": "\n    return a - b", "rejected": "\n    return b"},
    {"prompt": "x = ", "chosen": "1 + 2", "rejected": "add(1)"},
    {"prompt": "def f():", "chosen": " return 0", "rejected": "\n    return a + b + b"},
]


def run_flags(*extra):
    """A one-rank rlhf run on tiny_hf: everything that is not the model's shape."""
    return ["--seq_length", "64", "--micro_batch_size", "4", "--global_batch_size", "4",
            "--lr", "1e-3", "--min_lr", "1e-3", "--lr_decay_style", "constant",
            "--log_interval", "1", "--eval_steps", "0", "--progress_bar", "false",
            "--tensorboard", "false", "--plot", "false", "--num_workers", "0", *extra]

# KTO's unpaired rows (TRL's prompt/completion/label): three desirable, two undesirable
KTO_ROWS = [
    {"prompt": "def add(a, b):", "completion": "\n    return a + b", "label": True},
    {"prompt": "def sub(a, b):", "completion": "\n    return b", "label": False},
    {"prompt": "x = ", "completion": "1 + 2", "label": True},
    {"prompt": "def f():", "completion": "\n    return a + b + b", "label": False},
    {"prompt": "y = ", "completion": " 3", "label": True},
]
