"""Bytes a live display sends the browser a second, with the dashboard's byte budget and without it, side by side.

    python benchmarks/display_bytes.py [--seconds 30] [--model gpt-tiny] [--stages 2 4]

Per stage count one session trains without end and two dashboards watch it at once: one with the default
``bytes_per_s`` and one whose budget never binds (1e12). Each counts the JSON bytes of what its frames changed
(``LiveView.sent_bytes``, what the update messages carry; plotly.js, sent once when a display opens, is not counted)
over ``--seconds``; no browser is needed for the count.
"""

from __future__ import annotations

import argparse
import time

import vpipe_lab
from vpipe_lab.jupyter.dashboard import MAX_BYTES_PER_S, Dashboard


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    args = ap.parse_args()
    print("| stages | budget | frames/s | kB per frame | kB/s |\n|---:|---|---:|---:|---:|")
    for stages in args.stages:
        with vpipe_lab.launch(args.model, stages=stages, microbatches=2 * stages, device="cpu", timeout=120) as s:
            s.run(None)
            s.wait(s.iteration + 5, timeout=120)
            boards = {"default (250 kB/s)": Dashboard(s), "none": Dashboard(s, bytes_per_s=1e12)}
            start = {name: (b.widget.sent_bytes, b.refreshes) for name, b in boards.items()}
            began = time.monotonic()
            time.sleep(args.seconds)
            elapsed = time.monotonic() - began
            for name, board in boards.items():
                sent, frames = board.widget.sent_bytes - start[name][0], board.refreshes - start[name][1]
                board.close()
                print(f"| {stages} | {name} | {frames / elapsed:.1f} | {sent / max(1, frames) / 1e3:.1f} | "
                      f"{sent / elapsed / 1e3:.1f} |", flush=True)
            s.pause()
    print(f"\nbudget: {MAX_BYTES_PER_S / 1e3:.0f} kB/s per display")


if __name__ == "__main__":
    main()
