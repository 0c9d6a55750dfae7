"""Loss and throughput curves of a run, from its metrics.jsonl, to PNG.

python -m dalle_pytorch.eval.plot runs/dalle            # writes runs/dalle/curves.png
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

from ..config import flag


def read_metrics(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path} does not exist: pass a run directory written by train_vae.py or train_dalle.py"
        )
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        raise ValueError(f"{path} has no rows yet: wait for the first --log_every steps")
    return rows


def plot(run_dir: str, out: str | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    steps = [r["step"] for r in rows]
    losses = [k for k in rows[-1] if k.endswith("loss") or k in ("recon", "kl")]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for k in losses:
        ax1.plot(steps, [r.get(k) for r in rows], label=k)
    ax1.set_xlabel("step")
    ax1.set_yscale("log")
    ax1.set_title("losses")
    ax1.legend()
    ax2.plot(steps, [r.get("images_per_s") for r in rows])
    ax2.set_xlabel("step")
    ax2.set_title("images / s")
    fig.suptitle(os.path.basename(os.path.abspath(run_dir)))
    fig.tight_layout()
    out = out or os.path.join(run_dir, "curves.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


@dataclass
class PlotConfig:
    run_dir: str = flag("", "a run directory (holds metrics.jsonl)", positional=True)
    out: str = flag("", "PNG path (empty: RUN_DIR/curves.png)")


def main(argv=None):
    from ..config import FileParser, add_flags, take
    from ..errors import user_errors

    p = FileParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, PlotConfig, "plot")
    args = take(p.parse_args(argv), PlotConfig)
    if not args.run_dir:
        p.error("give a run directory (it holds metrics.jsonl)")
    with user_errors(False):
        print(plot(args.run_dir, args.out or None))


if __name__ == "__main__":
    main()
