"""Stop-signal handlers do not outlive a run: a Trainer gives the process its own back, and a
forked tokenizing pool ends its workers even under a handler inherited from the parent (the
pool's join hung forever after an in-process run had left the Trainer's handler installed)."""

import os
import signal
import subprocess
import sys
import textwrap


def test_a_trainer_gives_the_process_its_handlers_back():
    from swift_mcore.training.trainer import Trainer

    def own(signum, frame):
        pass

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, own)
    try:
        trainer = Trainer.__new__(Trainer)
        trainer._stop_signal, trainer._saved_handlers = None, None
        trainer.install_signal_handlers()
        assert signal.getsignal(signal.SIGTERM) is not own
        trainer.restore_signal_handlers()
        assert signal.getsignal(signal.SIGTERM) is own
        assert signal.getsignal(signal.SIGINT) is before[signal.SIGINT]
        trainer.restore_signal_handlers()  # twice: nothing left to give back
        assert signal.getsignal(signal.SIGTERM) is own
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def test_a_forked_pool_ends_under_an_inherited_stop_handler(tmp_path):
    """In a child process group (a hang there fails the test instead of hanging the suite):
    a Python SIGTERM handler like a Trainer's, then a pool interrupted with tasks in flight,
    as preprocess is by Ctrl-C; without the workers' default handler the pool's join waited
    forever."""
    code = textwrap.dedent("""
        import signal, time
        from swift_mcore.data.worker_pool import forked_pool, in_order

        signal.signal(signal.SIGTERM, lambda signum, frame: None)

        def init():
            pass

        def slow(x):
            time.sleep(0.05)
            return x

        try:
            with forked_pool(2, init, ()) as pool:
                for _ in in_order(pool, slow, [(i, i) for i in range(50)], 2):
                    raise KeyboardInterrupt
        except KeyboardInterrupt:
            print("ended")
    """)
    out = tmp_path / "out.txt"
    with open(out, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the parent and its stuck workers
            proc.wait()
    assert proc.returncode == 0 and out.read_text().strip() == "ended", out.read_text()[-2000:]
