"""runtime/cpu/gloo_device.py: on CPU every process group, megatron's twenty included, shares
one gloo device, so one gloo_tcp_loop thread runs instead of one per group; collectives
over the shared device give what torch's own groups give."""

import json
import subprocess
import sys

import run_helpers as R

SCRIPT = r"""
import json, os, sys
import torch, torch.distributed as dist
from megatron.core import parallel_state
from swift_mcore.arguments import parse_args
from swift_mcore.run_config import resolve
from swift_mcore.runtime import distributed
from swift_mcore.runtime.cpu import gloo_device

def loops():
    return sum(open(f"/proc/self/task/{t}/comm").read().strip() == "gloo_tcp_loop"
               for t in os.listdir("/proc/self/task"))

if sys.argv[1] == "torch":  # torch's own class, for the comparison
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.TCPStore(
        "127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False))
    parallel_state.initialize_model_parallel(1, 1)
else:
    distributed.initialize(resolve(parse_args(["--num_layers", "2"])))
dp = parallel_state.get_data_parallel_group()
t = torch.arange(4.0)
dist.all_reduce(t, group=dp)
dist.all_reduce(t)
print(json.dumps({"groups": len(dist.distributed_c10d._world.pg_map), "loops": loops(),
                  "installed": gloo_device.installed(), "sum": t.tolist()}))
distributed.shutdown()
"""


def run(mode):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                          timeout=120, cwd=R.ROOT, env=R.child_env(PYTHONWARNINGS="ignore",
                                                                   CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_megatrons_groups_share_one_gloo_thread_on_cpu():
    ours, theirs = run("swift"), run("torch")
    assert ours["installed"] and not theirs["installed"]
    assert ours["groups"] == theirs["groups"] >= 10
    assert ours["loops"] == 1
    # Without the sharing each group starts a loop thread of its own; on a busy machine some
    # have not named themselves yet when counted, so only "more than ours" is certain.
    assert theirs["loops"] > ours["loops"]
    assert ours["sum"] == theirs["sum"] == [0.0, 1.0, 2.0, 3.0]
