"""`--plot FILE.png`: the Bayesian search trace and the chosen skip pattern per layer (matplotlib)."""

from __future__ import annotations

import numpy as np


def plot_search(path: str, trace, ir) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = np.array(trace.values)
    seeded = np.array(trace.seeded)
    trials = np.arange(len(values))
    fig, (ax_trace, ax_plan) = plt.subplots(2, 1, figsize=(9, 7), gridspec_kw={"height_ratios": [3, 2]})
    ax_trace.scatter(trials[~seeded], values[~seeded], s=12, color="tab:blue", label="search trials")
    ax_trace.scatter(trials[seeded], values[seeded], s=18, color="tab:orange", marker="s", label="cosine seeds")
    ax_trace.plot(trials, np.maximum.accumulate(values), color="black", lw=1.5, label="best so far")
    ax_trace.axhline(1.0, color="grey", ls=":", lw=1)
    ax_trace.set_xlabel("trial")
    ax_trace.set_ylabel("expected speedup (x)")
    ax_trace.set_title(f"Bayesian layer-skip search: {len(values)} trials in {trace.seconds:.0f} s")
    ax_trace.legend(loc="lower right")

    L = ir.config.num_layers
    rows, labels = [], []
    for name in ("layer-skip", "bayes"):
        plan = ir.plans.get(name)
        if plan is None:
            continue
        for kind, skipped in (("attn", plan.skip_attn), ("mlp", plan.skip_mlp)):
            rows.append([1 if i in skipped else 0 for i in range(L)])
            m = plan.measured
            labels.append(f"{name} {kind}")
        labels[-2] += f"  (pred {m.get('expected_speedup', 0):.2f}x, conf {(m.get('confirmed_speedup') or 0):.2f}x)"
    ax_plan.imshow(np.array(rows), cmap="Greys", vmin=0, vmax=1.4, aspect="auto")
    ax_plan.set_yticks(range(len(labels)), labels)
    ax_plan.set_xticks(range(L))
    ax_plan.set_xlabel("block (dark = sublayer skipped by the draft)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
