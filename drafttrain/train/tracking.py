"""W&B objects beyond scalars: the speculative-evaluation table and the accepted-length histogram.

Scalars go through ``accelerator.log`` in the loop (names as in docs/design.md, "Definitions": ``train/loss``,
``train/acc_k``, ``train/cond_acc_k``, ``train/tau_sim``, ``eval/tau``, ``eval/speedup``, ...). After
every speculative evaluation the loop also logs, at the same step:

- ``eval/table``: one row per prompt set evaluated: step, prompt set, τ, speedup, greedy equality,
  speculative and plain tokens/s;
- ``eval/accept_hist_table``: rows (prompt set, accepted drafts a, tokens per forward a + 1,
  verification steps with that count);
- ``eval/accept_hist_plot``: a bar chart of that histogram (``wandb.plot.bar``).

Only rank 0 has a W&B run (accelerate's tracker); call these on the main process only.
"""

from __future__ import annotations

from typing import Any

from drafttrain.eval.plots import accept_hist_items  # the one reader of accept histograms (eval)

SUMMARY_COLUMNS = ["step", "prompt_set", "tau", "speedup", "greedy_equal", "spec_tokens_per_s", "plain_tokens_per_s"]
HIST_COLUMNS = ["prompt_set", "accepted_drafts", "tokens_per_forward", "steps"]



def eval_table_rows(result: dict[str, Any], step: int) -> tuple[list[list], list[list]]:
    """(summary rows, histogram rows) of one speculative evaluation (a dict with ``eval/*`` keys)."""
    prompt_set = str(result.get("eval/prompts", "eval"))
    summary = [[step, prompt_set, result.get("eval/tau"), result.get("eval/speedup"), result.get("eval/greedy_equal"),
                result.get("eval/spec_tokens_per_s"), result.get("eval/plain_tokens_per_s")]]
    hist = [[prompt_set, a, a + 1, n] for a, n in accept_hist_items(result.get("eval/accept_hist"))]
    return summary, hist


def log_eval_table(accelerator, result: dict[str, Any], step: int) -> None:
    """Log :func:`eval_table_rows` of ``result`` as W&B Tables and a bar chart at ``step`` (rank 0)."""
    import wandb

    run = accelerator.get_tracker("wandb", unwrap=True)
    summary, hist = eval_table_rows(result, step)
    hist_table = wandb.Table(columns=HIST_COLUMNS, data=hist)
    run.log(
        {
            "eval/table": wandb.Table(columns=SUMMARY_COLUMNS, data=summary),
            "eval/accept_hist_table": hist_table,
            "eval/accept_hist_plot": wandb.plot.bar(
                hist_table, "accepted_drafts", "steps", title=f"accepted drafts per verification step ({summary[0][1]})"
            ),
        },
        step=step,
    )
