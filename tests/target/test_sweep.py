"""The sweep over every decoder-only text causal LM transformers exports (drafttrain.sweep).

Excluded, with the reason the sweep gives (:func:`drafttrain.sweep.excluded`): encoder-decoders' decoders
(``is_encoder_decoder``), BERT-style encoders given a causal head (their model type has a masked-LM head), multimodal
wrappers (``*ForConditionalGeneration``; their text models are swept by their own class) and the classes of
``EXCLUDED_BY_NAME`` (image / audio models, permutation LMs, assistant models that read a target's states).

The whole sweep (``-m sweep``, the slow tier the README's test command also runs): no class crashes; each is
trained and decoded greedy-equal, refused in one line, or cannot build from the tiny config with its reason; the
README's table is what this sweep gives. The default tier sweeps the classes people serve in 2026 and the ones a
new user met crashing (module names, our own kernel, per-layer configs).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from drafttrain import sweep

ROOT = Path(__file__).resolve().parents[2]

#: hybrid / MLA targets people serve in 2026, and the classes that crashed before the structure was read from the model
NAMED = {
    "Qwen3_5ForCausalLM": "trains", "Qwen3NextForCausalLM": "trains", "GraniteMoeHybridForCausalLM": "trains",
    "DeepseekV32ForCausalLM": "trains", "Lfm2ForCausalLM": "trains", "PhiForCausalLM": "trains",
    "GPTNeoXForCausalLM": "trains", "StableLmForCausalLM": "trains", "Gemma4ForCausalLM": "trains",
    "MambaForCausalLM": "refused", "MiniMaxForCausalLM": "refused", "BartForCausalLM": "excluded",
}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(tiny_target):
    return tiny_target.tokenizer


def _check(row: sweep.SweepRow) -> None:
    assert row.status != "crash", row.reason
    if row.status == "trains":
        assert row.greedy_equal == {k: True for k in sweep.SWEEP_DRAFTERS}, row
    elif row.status == "refused":
        assert row.reason.startswith(f"{row.name}: ") and "\n" not in row.reason, row.reason
        assert " failed " in row.reason or "fails" in row.reason or "does not" in row.reason or "no " in row.reason
    elif row.status in ("excluded", "cannot build"):
        assert row.reason


@pytest.mark.parametrize("name", list(NAMED))
def test_named_classes(tokenizer, name):
    """Qwen3.5, Qwen3-Next, Granite-4 hybrid and DeepSeek-V3.2 train both drafters and decode greedy-equal; LFM2, Phi,
    GPT-NeoX (module names), StableLM (a kernel crash) and Gemma-4 (per-layer head sizes) now train; Mamba (its own
    multi-token forward over a cache is inexact) and MiniMax (a cache class of its own) are refused in one line."""
    row = sweep.sweep_one(name, tokenizer)
    _check(row)
    assert row.status == NAMED[name], row


def test_exclusions_follow_their_rules():
    names = sweep.causal_lm_classes()
    assert len(names) > 150
    assert sweep.excluded("BartForCausalLM").startswith("encoder-decoder")
    assert sweep.excluded("RobertaForCausalLM").startswith("BERT-style")
    assert sweep.excluded("Gemma3ForConditionalGeneration").startswith("multimodal wrapper")
    assert sweep.excluded("Qwen3_5ForCausalLM") is None and sweep.excluded("LlamaForCausalLM") is None
    assert set(sweep.EXCLUDED_BY_NAME) <= set(names)


@pytest.mark.sweep
def test_every_causal_lm_class(tokenizer):
    """Every class: no crash; the README's table is this sweep's (for the transformers version families.json records)."""
    import transformers

    rows = [sweep.sweep_one(name, tokenizer) for name in sweep.causal_lm_classes()]
    crashes = [f"{r.name}: {r.reason}" for r in rows if r.status == "crash"]
    assert not crashes, "\n".join(crashes)
    for r in rows:
        _check(r)
    counts = sweep.summary(rows)
    assert counts["trains"] >= 90, counts
    recorded = json.loads((ROOT / "docs/benchmarks/families.json").read_text())
    if recorded["transformers"] != transformers.__version__:
        pytest.skip(f"families.json was swept with transformers {recorded['transformers']}, this is "
                    f"{transformers.__version__}: rerun python -m scripts.sweep_targets")  # fmt: skip
    from scripts.sweep_targets import readme_table

    table = readme_table([r.to_dict() for r in rows], transformers.__version__)
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"<!-- sweep table -->.*?<!-- /sweep table -->", readme, re.S).group(0) == table
