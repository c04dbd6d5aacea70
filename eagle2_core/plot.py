"""The figures of a comparison (`eagle2 compare --plot`), drawn with matplotlib when installed."""
from __future__ import annotations

from .stats import Comparison


def plot_comparison(comp: Comparison, path: str, name: str = "eagle2") -> None:
    """Acceptance-length histogram, per-prompt speedup and the calibration figure (EAGLE-2
    section 3: draft path confidence against the measured acceptance rate), to a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'eagle2[plot]'") from None
    run = comp.runs[name]
    hist = run.total.accepted_hist
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(16, 4))
    a1.bar([i + 1 for i in range(len(hist))], hist, color="tab:blue")
    a1.set_xlabel("tokens per verify step (accepted draft + 1)")
    a1.set_ylabel("verify steps")
    a1.set_title(f"{name}: acceptance length (tau {run.total.tau:.2f})")
    ratios = [s.tokens_per_s / b.tokens_per_s if b.tokens_per_s > 0 else 0.0
              for s, b in zip(run.summaries, comp.runs[comp.baseline].summaries)] if comp.baseline in comp.runs else []
    a2.bar(range(len(ratios)), ratios, color="tab:green")
    a2.axhline(1.0, color="grey", lw=1, ls="--")
    a2.set_xlabel("prompt")
    a2.set_ylabel(f"speedup over {comp.baseline}")
    sp = comp.speedup(name)
    a2.set_title(f"per-prompt speedup (total {sp:.2f}x)" if sp else "per-prompt speedup")
    calib = run.total.calibration_table
    a3.plot([0, 1], [0, 1], color="grey", lw=1, ls="--")
    if calib:
        a3.plot([b["confidence"] for b in calib], [b["accepted"] for b in calib], "o-", color="tab:orange")
    a3.set_xlim(0, 1)
    a3.set_ylim(0, 1)
    a3.set_xlabel("draft path confidence (bin mean)")
    a3.set_ylabel("accepted (fraction of nodes)")
    a3.set_title("calibration")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
