"""Markdown report and PNG plots of an evaluation (:func:`drafttrain.eval.harness.evaluate`'s results dict)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from drafttrain.host import summary


def _spec_runs(results: dict) -> list[dict]:
    return [r for r in results["runs"] if r["method"] != "plain"]


def _plain(results: dict, bs: int) -> dict:
    return next(r for r in results["runs"] if r["method"] == "plain" and r["batch_size"] == bs)


def _methods(results: dict) -> list[str]:
    return list(dict.fromkeys(r["method"] for r in _spec_runs(results)))


def _modes(results: dict) -> list[str]:
    """The speculative runs' variants: engine modes for one method; "method/mode" labels for several."""
    return list(dict.fromkeys(_variant(results, r) for r in _spec_runs(results)))


def _variant(results: dict, r: dict) -> str:
    return r["mode"] if len(_methods(results)) == 1 else f"{r['method']}/{r['mode']}"


def _batch_sizes(results: dict) -> list[int]:
    return sorted({r["batch_size"] for r in results["runs"]})


def _get(results: dict, bs: int, variant: str) -> dict | None:
    return next((r for r in _spec_runs(results) if r["batch_size"] == bs and _variant(results, r) == variant), None)


def _methods_table(results: dict) -> list[str]:
    """One row per (batch, method, mode): the comparison of decoding methods."""
    ppl = any("perplexity" in r for r in results["runs"])
    head = "| batch | method | mode | lossless | τ | tok/s | speedup | mean tree nodes | equal to plain |"
    head += " perplexity |" if ppl else ""
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for bs in _batch_sizes(results):
        for r in [_plain(results, bs)] + [r for r in _spec_runs(results) if r["batch_size"] == bs]:
            eq = "-" if r["method"] == "plain" else (f"{r['equal_fraction']:.0%}" if "equal_fraction" in r else "n/a")
            name = r["method"] + (f" (n = {r['node_budget']})" if r.get("node_budget") is not None
                                  and not r["method"].endswith(f"_n{r['node_budget']}") else "")  # fmt: skip
            cells = [str(bs), name, r["mode"], "yes" if r.get("lossless", True) else "**no**", f"{r['tau']:.3f}",
                     f"{r['tokens_per_s']:.1f}", f"{r['speedup']:.2f}x", f"{r['mean_tree_nodes']:.1f}", eq]  # fmt: skip
            if ppl:
                cells.append(f"{r['perplexity']:.3f}" if "perplexity" in r else "-")
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _drafter_line(d: dict) -> str:
    if d.get("replay_accept_prob") is not None and d.get("name") is None:  # the replay method alone drafts
        return (f"none: replay proposer (a chain of the plain output's next tokens, each right with probability "
                f"{d['replay_accept_prob']}; drafting costs nothing, so this measures the verifier alone)")  # fmt: skip
    name = f"`{d['checkpoint']}`" if d["checkpoint"] else "untrained ParallelSpec drafter (real drafting costs; τ is meaningless)"
    if d.get("draft_depth") is None:  # reports written before the drafter's name and depth were recorded
        return f"{name} (K = {d['num_mask_tokens']})"
    return f"{name} ({d.get('name')}, draft depth {d['draft_depth']})"


def markdown(results: dict[str, Any], plots: list[str] | None = None) -> str:
    """The report as markdown: setup, throughput/speedup by batch size and mode, acceptance, padding."""
    cfg = results["command_config"]
    modes, sizes = _modes(results), _batch_sizes(results)
    lines = [
        f"# Verifier evaluation: {results['prompts']['set']} ({results['prompts']['num']} prompts)",
        "",
        f"- target: `{cfg['target']['name']}`; drafter: " + _drafter_line(results["drafter"]),
        f"- decoding: {'greedy' if results['greedy'] else 'temperature %s, top-p %s' % (cfg['temperature'], cfg['top_p']) + (', top-k %s' % cfg['top_k'] if cfg.get('top_k') else '')}, "
        f"max_new_tokens {cfg['max_new_tokens']}, mean prompt {results['prompts']['mean_prompt_tokens']:.0f} tokens; "
        f"tree: widths {cfg['tree']['widths']}, budget {cfg['tree']['budget']}, choices {cfg['tree']['choices'] if not isinstance(cfg['tree']['choices'], list) else 'custom'}",
        f"- machine: {results['machine']['device']}, "
        + (summary(results["host"]) if results.get("host") else f"host not recorded, {results['machine']['torch_threads']} "
           f"torch threads, torch {results['machine']['torch']}")  # results.json written before drafttrain.host.describe
        + f"; git {results['git_sha'] or '?'}; total {results['total_seconds']:.0f} s",
        f"- plain baseline: engine mode `{cfg['plain_mode']}`; speculative modes: {', '.join(f'`{m}`' for m in modes)}",
    ]
    if results["greedy"]:
        lines.append(f"- **greedy_equal** (every lossless speculative output == plain output, token for token): "
                     f"**{results['greedy_equal']}**")  # fmt: skip
    if results.get("lossy_methods"):
        lines.append(f"- lossy methods (output distribution != the target's; perplexity under the target reported): "
                     f"{', '.join(results['lossy_methods'])}")  # fmt: skip
    if len(_methods(results)) > 1:
        lines += ["", "## Methods by batch size", ""] + _methods_table(results)
    if results.get("sssd_planner"):
        lines += ["", "## SSSD speculation-length planner (SSSD §3.2)", "",
                  "Tree size n maximising b·τ(n) / t(b, n + 1): forward times t measured at the start of this run, "
                  "τ(n) from the grid search's simulated acceptance.", "",
                  "| batch | chosen n | expected speedup | forward ms by speculation length s = n + 1 |", "|---|---|---|---|"]  # fmt: skip
        for b, p in results["sssd_planner"].items():
            fw = ", ".join(f"{s}: {1000 * t:.0f}" for s, t in p["forward_seconds"].items())
            lines.append(f"| {b} | {p['best_size']} | {p['expected_speedup']:.2f}x | {fw} |")
    lines += ["", "## Throughput and speedup by batch size", ""]
    head = "| batch | plain tok/s | " + " | ".join(f"{m} tok/s | {m} speedup" for m in modes) + " | τ | padded: padding ratio |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for bs in sizes:
        p = _plain(results, bs)
        cells = [str(bs), f"{p['tokens_per_s']:.1f}"]
        for m in modes:
            r = _get(results, bs, m)
            cells += [f"{r['tokens_per_s']:.1f}", f"{r['speedup']:.2f}x"] if r else ["-", "-"]
        any_r = next((_get(results, bs, m) for m in modes if _get(results, bs, m)), None)
        padded = _get(results, bs, "padded")
        cells += [f"{any_r['tau']:.3f}" if any_r else "-", f"{padded['padding_ratio']:.3f}" if padded else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Acceptance", ""]
    lines += ["| batch | mode | τ | mean tree nodes | accepted drafts histogram | per-depth acceptance | greedy equal |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in _spec_runs(results):
        hist = ", ".join(f"{k}: {v}" for k, v in r["accept_hist"].items())
        depth = ", ".join(f"{k}: {v:.2f}" for k, v in r["depth_acceptance"].items())
        eq = r.get("greedy_equal", "n/a")
        lines.append(f"| {r['batch_size']} | {_variant(results, r)} | {r['tau']:.3f} | {r['mean_tree_nodes']:.1f} | {hist} | {depth} | {eq} |")
    lines += ["", "## Padding (EMS-SD): padded / real slots of the decoding steps", ""]
    lines += ["Input / KV padding ratio: padded input slots / real inputs and skipped cache slots / committed "
              "tokens (EMS-SD Table 1 counts); attention-window padding: padded slots the verification attention "
              "reads / committed slots it reads.", ""]  # fmt: skip
    lines += ["| batch | mode | input padding | KV padding | padding ratio | attention-window padding | tok/s | draft s | verify-forward s |",
              "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in _spec_runs(results):
        lines.append(f"| {r['batch_size']} | {_variant(results, r)} | {r['input_padding_ratio']:.3f} | {r['kv_padding_ratio']:.3f} | "
                     f"{r['padding_ratio']:.3f} | {r.get('window_padding_ratio', 0.0):.3f} | {r['tokens_per_s']:.1f} | "
                     f"{r['draft_seconds']:.1f} | {r['verify_forward_seconds']:.1f} |")  # fmt: skip
    mism = [r for r in _spec_runs(results) if r.get("mismatches") and r.get("lossless", True)]
    if mism:
        lines += ["", "## Mismatches (speculative != plain greedy)", "",
                  "First differing position and the target's top-2 logit gap there (a gap near 1e-5 is a near-tie "
                  "that float reassociation between batch shapes can flip; a large gap is a bug).", ""]  # fmt: skip
        for r in mism:
            diag = r.get("mismatch_diagnosis", {})
            lines.append(f"- batch {r['batch_size']}, {_variant(results, r)}{'' if r.get('lossless', True) else ' (lossy)'}: " + ", ".join(
                f"prompt {pid} (position {d['position']}, gap {d['top2_gap']:.2e})" if (d := diag.get(pid)) else f"prompt {pid}"
                for pid in r["mismatches"]))  # fmt: skip
    if plots:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], out_dir: Path) -> list[str]:
    """Write the PNG plots; returns their paths relative to ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots_dir = out_dir / "plots"
    plots_dir.mkdir(parents=True, exist_ok=True)
    modes, sizes = _modes(results), _batch_sizes(results)
    written = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(plots_dir / name, dpi=110)
        plt.close(fig)
        written.append(f"plots/{name}")

    # tokens/s and speedup by batch size
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.plot(sizes, [_plain(results, b)["tokens_per_s"] for b in sizes], "o-", label="plain")
    for m in modes:
        xs = [b for b in sizes if _get(results, b, m)]
        a1.plot(xs, [_get(results, b, m)["tokens_per_s"] for b in xs], "o-", label=f"speculative ({m})")
        a2.plot(xs, [_get(results, b, m)["speedup"] for b in xs], "o-", label=m)
    a2.axhline(1.0, color="grey", lw=0.8, ls="--")
    a1.set(xlabel="batch size", ylabel="generated tokens / s", title="throughput", xscale="log", xticks=sizes)
    a2.set(xlabel="batch size", ylabel="speedup over plain", title="speedup", xscale="log", xticks=sizes)
    for a in (a1, a2):
        a.set_xticklabels([str(b) for b in sizes])
        a.legend()
    save(fig, "throughput_speedup.png")

    # tau by batch size
    fig, ax = plt.subplots(figsize=(5, 4))
    for m in modes:
        xs = [b for b in sizes if _get(results, b, m)]
        ax.plot(xs, [_get(results, b, m)["tau"] for b in xs], "o-", label=m)
    ax.set(xlabel="batch size", ylabel="τ (tokens per verification)", title="acceptance length τ", xscale="log")
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.legend()
    save(fig, "tau.png")

    # accepted-length histogram and per-depth acceptance (all speculative runs of the first mode pooled)
    first = [r for r in _spec_runs(results) if r["mode"] == modes[0]] if modes else []
    hist: dict[int, int] = {}
    att: dict[int, list[float]] = {}
    for r in first:
        for k, v in r["accept_hist"].items():
            hist[int(k)] = hist.get(int(k), 0) + v
        for k, v in r["depth_acceptance"].items():
            att.setdefault(int(k), []).append(v)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    if hist:
        total = sum(hist.values())
        ks = sorted(hist)
        a1.bar(ks, [hist[k] / total for k in ks])
        a1.set_xticks(ks)
    a1.set(xlabel="accepted drafts per step", ylabel="fraction of steps", title="accepted-length histogram")
    if att:
        ds = sorted(att)
        a2.bar(ds, [sum(att[d]) / len(att[d]) for d in ds])
        a2.set_xticks(ds)
    a2.set(xlabel="tree depth", ylabel="P(accept | parent accepted)", title="per-depth acceptance", ylim=(0, 1))
    save(fig, "acceptance.png")

    # padded vs unpadded
    if "padded" in modes:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        for m in modes:
            xs = [b for b in sizes if _get(results, b, m)]
            a1.plot(xs, [_get(results, b, m)["padding_ratio"] for b in xs], "o-", label=m)
        a1.set(xlabel="batch size", ylabel="padded / real slots", title="padding ratio", xscale="log")
        a1.set_xticks(sizes, [str(b) for b in sizes])
        a1.legend()
        for m in modes:
            if m == "padded":
                continue
            xs = [b for b in sizes if _get(results, b, m) and _get(results, b, "padded")]
            a2.plot(xs, [_get(results, b, m)["tokens_per_s"] / _get(results, b, "padded")["tokens_per_s"] for b in xs],
                    "o-", label=f"{m} / padded")  # fmt: skip
        a2.axhline(1.0, color="grey", lw=0.8, ls="--")
        a2.set(xlabel="batch size", ylabel="tokens/s ratio", title="unpadded vs padded", xscale="log")
        a2.set_xticks(sizes, [str(b) for b in sizes])
        a2.legend()
        save(fig, "padded_vs_unpadded.png")
    return written


def write_report(results: dict[str, Any], out_dir: Path, plots: bool = True) -> Path:
    """Write ``report.md`` (and ``plots/*.png`` unless ``plots`` is False) to ``out_dir``; returns the report path."""
    out_dir = Path(out_dir)
    paths = plot(results, out_dir) if plots else []
    path = out_dir / "report.md"
    path.write_text(markdown(results, paths))
    return path
