"""Through a real Jupyter kernel: training runs in the background, and "Interrupt kernel" pauses it."""

from __future__ import annotations

import subprocess
import sys
import time

import jupyter_client
import pytest

pytestmark = pytest.mark.slow


def run(kc, code: str, timeout: float = 120) -> str:  # type: ignore[no-untyped-def]
    out: list[str] = []

    def hook(msg):  # type: ignore[no-untyped-def]
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            out.append(f"ERROR {msg['content']['ename']}")

    kc.execute_interactive(code, timeout=timeout, output_hook=hook)
    return "".join(out)


def test_interrupt_pauses_training_instead_of_killing_it() -> None:
    km, kc = jupyter_client.manager.start_new_kernel(kernel_name="python3")
    try:
        assert "until stopped" in run(kc, "%load_ext vpipe_lab\n%vpipe start mlp --stages 2 --device cpu --run forever")
        # The kernel answers other cells while training runs.
        t0 = time.monotonic()
        assert run(kc, "print(1 + 1)").strip() == "2" and time.monotonic() - t0 < 5
        msg_id = kc.execute("session.wait(10**9)")
        time.sleep(3)
        km.interrupt_kernel()
        seen: list[str] = []
        while True:
            m = kc.get_iopub_msg(timeout=60)
            if m["parent_header"].get("msg_id") != msg_id:
                continue
            if m["msg_type"] == "stream":
                seen.append(m["content"]["text"])
            if m["msg_type"] == "error":
                seen.append(m["content"]["ename"])
            if m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
                break
        assert "KeyboardInterrupt" in seen and any("training paused" in s for s in seen)
        check = ("it = session.iteration; import time; time.sleep(1.5)\n"
                 "print(session.iteration == it, all(code is None for code in session.processes.exit_codes().values()))")
        assert run(kc, check).split() == ["True", "True"]  # paused, and every worker still alive
        assert "resumed" in run(kc, "%vpipe resume\nsession.wait(session.iteration + 2, timeout=60)")
        assert "no worker process is left" in run(kc, "%vpipe stop")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_training_a_bundled_example_never_imports_torch_into_the_kernel() -> None:
    """What tutorial 06 says: the kernel drives workers, it does not build models (it names them)."""
    code = ("import sys, vpipe_lab\n"
            "with vpipe_lab.launch('gpt-tiny', stages=2, microbatches=2, device='cpu') as s:\n"
            "    s.run(1)\n"
            "    s.wait(timeout=120)\n"
            "    print(s.metrics.iterations['loss'].notna().all(), 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split()[-2:] == ["True", "False"], out.stdout + out.stderr[-2000:]
