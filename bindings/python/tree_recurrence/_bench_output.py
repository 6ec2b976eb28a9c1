"""What ``python -m tree_recurrence bench`` shows: the table it prints and bench.png (speed-up of the
tree row over chains against the token ratio, with the ideal line speed-up = token ratio).

matplotlib draws the PNG and is optional by choice: the numbers (the table and bench.json) are the
result, the PNG a view of them, so a missing matplotlib costs the PNG only, said in one line before
the run starts; the ``bench`` extra (``pip install "tree-recurrence[bench]"``) brings it.
"""

from __future__ import annotations

from pathlib import Path


def plot_unavailable() -> str | None:
    """Why bench.png cannot be drawn here (matplotlib does not import), with how to get it; None when it can."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
    except ImportError as error:
        return f"matplotlib does not import: {error}; pip install matplotlib, or \"tree-recurrence[bench]\", to get the plot"
    return None


def print_table(report: dict) -> None:
    print(f"\n{report['device']}, {report['dtype']}, attention {report['attention']}, shape {report['shape']}")
    for name, info in report["models"].items():
        kernels = "; ".join(f"{fam}: " + ", ".join(f"{seam} {'/'.join(s)}" for seam, s in seams.items())
                            for fam, seams in info["kernels"].items()) or "none recorded"
        print(f"  {name} ({info['model_type']}, {info['parameters'] / 1e6:.0f}M params, support {info['support']}): {kernels}")
    header = f"{'model':<12}{'prompt':>7}{'ckpt':>5}{'ratio':>7}{'tree ms':>10}{'chains ms':>11}{'flat ms':>10}" \
             f"{'tree tok/s':>12}{'speed-up':>10}{'tree/flat':>10}{'tree GB':>9}{'chains GB':>10}"
    print(header)
    for r in report["results"]:
        def ms(mode):
            return f"{r[mode]['ms']:.1f}" if "ms" in r[mode] else "error"

        def gb(mode):
            v = r[mode].get("peak_memory_gb")
            return "-" if v is None else f"{v:.1f}"

        tps = r["tree"].get("tokens_per_s")
        speedup = f"{r['speedup_vs_chains']:.2f}x" if r["speedup_vs_chains"] else "-"
        over_flat = f"{r['tree_over_flat']:.2f}" if r["tree_over_flat"] else "-"
        tokens = f"{tps:,.0f}" if tps else "-"
        print(f"{r['model']:<12}{r['prompt']:>7}{'on' if r['checkpointing'] else 'off':>5}{r['token_ratio']:>7.2f}"
              f"{ms('tree'):>10}{ms('chains'):>11}{ms('flat'):>10}{tokens:>12}{speedup:>10}{over_flat:>10}"
              f"{gb('tree'):>9}{gb('chains'):>10}")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    ratios = [r["token_ratio"] for r in report["results"]]
    top = max(ratios + [1.0]) * 1.05
    ax.plot([1, top], [1, top], color="gray", linestyle=":", label="ideal: speed-up = token ratio")
    for i, name in enumerate(report["models"]):
        for ckpt in (False, True):
            pts = sorted((r["token_ratio"], r["speedup_vs_chains"]) for r in report["results"]
                         if r["model"] == name and r["checkpointing"] == ckpt and r["speedup_vs_chains"])
            if pts:
                ax.plot(*zip(*pts), marker="o", color=f"C{i}", linestyle="--" if ckpt else "-",
                        label=f"{name}{' (checkpointing)' if ckpt else ''}")
    ax.set_xlabel("token ratio (sample tokens / unique tokens)")
    ax.set_ylabel("speed-up of the tree row over chains (fwd+bwd)")
    shape = report["shape"]
    ax.set_title(f"{report['device']}, {report['dtype']}: {shape['groups']} prompts x {shape['rollouts']} "
                 f"completions of {shape['completion']}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
