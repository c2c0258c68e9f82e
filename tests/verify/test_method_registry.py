"""A decoding method added from outside the library: registered in this file only, run by the harness.

This is the extension contract (docs/design.md, "Adding a decoding method"): a method =
its proposer + its config section (a dataclass) + a registry entry. The toy here is prompt lookup
decoding (draft the tokens that followed the last earlier occurrence of the context's final n-gram),
training-free and lossless under the engine's greedy rule. Nothing under ``drafttrain/`` names it: if
the harness or config validation still dispatched on method names, this test would fail.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from helpers import compose_dict

from drafttrain.config import ConfigError
from drafttrain.validation import validate_eval
from drafttrain.verify.methods import METHODS, Method, MethodContext, Variant, register
from drafttrain.verify.tree import DraftTree


@dataclass
class PromptLookupConfig:
    """``prompt_lookup.*``: match the last ``ngram`` tokens, draft up to ``depth`` tokens."""

    ngram: int = 2
    depth: int = 4


class PromptLookupProposer:
    """Chain drafts copied from the sequence's own context (prompt + output so far)."""

    name = "prompt_lookup"

    def __init__(self, ngram: int, depth: int, lossless: bool = True):
        self.ngram, self.depth, self.lossless = ngram, depth, lossless
        self.context: dict[int, list[int]] = {}

    def start(self, slot, prompt_ids, hidden, first_token) -> None:
        self.context[slot] = [*map(int, prompt_ids), int(first_token)]

    def _lookup(self, ctx: list[int]) -> list[int]:
        key = ctx[-self.ngram :]
        for i in range(len(ctx) - self.ngram - 1, -1, -1):  # the latest earlier occurrence first
            if ctx[i : i + self.ngram] == key:
                return ctx[i + self.ngram : i + self.ngram + self.depth]
        return []

    def draft(self, slots, sampling=None, generator=None) -> list[DraftTree]:
        return [DraftTree.chain(d) if (d := self._lookup(self.context[s])) else DraftTree.empty() for s in slots]

    def commit(self, slot, tokens, hidden) -> None:
        self.context[slot] += [int(t) for t in tokens]

    def release(self, slot) -> None:
        self.context.pop(slot, None)


def _check(c) -> list[str]:
    p = c.prompt_lookup
    return [] if p.ngram >= 1 and p.depth >= 1 else ["prompt_lookup.ngram and prompt_lookup.depth must be >= 1"]


def _build(ctx: MethodContext) -> list[Variant]:
    p = ctx.config.prompt_lookup
    return [
        Variant("prompt_lookup", lambda bs, refs: PromptLookupProposer(p.ngram, p.depth)),
        # the same drafts from a proposer that calls itself lossy: the harness must believe the proposer
        Variant("prompt_lookup_flagged", lambda bs, refs: PromptLookupProposer(p.ngram, p.depth, lossless=False)),
    ]


@pytest.fixture
def prompt_lookup():
    method = register(Method("prompt_lookup", _build, needs_drafter=False, lossless=True, config=PromptLookupConfig,
                             check=_check, summary="toy: prompt lookup decoding"))  # fmt: skip
    yield method
    METHODS.pop("prompt_lookup")


def _cfg(tmp_path, *extra: str, section: dict | None = None) -> dict:
    cfg = compose_dict("evaluate", [
        "target=tiny", "methods=[prompt_lookup]", "num_prompts=3", "max_new_tokens=12", "batch_sizes=[1,2]",
        "modes=[unpadded]", f"output_dir={tmp_path / 'eval'}", "progress=false", "plots=false", "warmup=false", *extra,
    ])  # fmt: skip
    cfg["prompt_lookup"] = section if section is not None else {"ngram": 1, "depth": 3}
    return cfg


def test_toy_method_config_section_is_validated(prompt_lookup, tmp_path):
    c = validate_eval(_cfg(tmp_path))
    assert c.prompt_lookup == PromptLookupConfig(ngram=1, depth=3) and c.checkpoint is None  # needs no drafter
    with pytest.raises(ConfigError, match="prompt_lookup.ngrm"):
        validate_eval(_cfg(tmp_path, section={"ngrm": 1}))
    with pytest.raises(ConfigError, match="prompt_lookup.ngram and prompt_lookup.depth"):
        validate_eval(_cfg(tmp_path, section={"depth": 0}))


def test_unregistered_method_is_rejected(tmp_path):
    cfg = _cfg(tmp_path)
    cfg.pop("prompt_lookup")
    with pytest.raises(ConfigError, match="methods must be distinct names from"):
        validate_eval(cfg)


def test_toy_method_runs_through_the_harness(prompt_lookup, tmp_path):
    """Its runs appear per batch size with the proposer's lossless flag, greedy-equal outputs and a τ
    above 1 (the tiny target repeats itself, so its own context predicts it); the lossy-flagged twin is
    listed as lossy and brings perplexities, read off the proposer, not the name."""
    from drafttrain.eval.harness import evaluate

    torch.set_num_threads(1)
    res = evaluate(_cfg(tmp_path))
    spec = [r for r in res["runs"] if r["method"] != "plain"]
    assert [(r["method"], r["batch_size"]) for r in spec] == [
        ("prompt_lookup", 1), ("prompt_lookup_flagged", 1), ("prompt_lookup", 2), ("prompt_lookup_flagged", 2)]
    assert res["lossy_methods"] == ["prompt_lookup_flagged"] and res["greedy_equal"] is True
    for r in spec:
        assert r["lossless"] == (r["method"] == "prompt_lookup")
        assert r["greedy_equal"] and r["mismatches"] == []  # drafts are verified by the engine's greedy rule
        assert r["tau"] > 1.0 and r["mean_tree_nodes"] > 0
        assert r["perplexity"] > 1.0  # a lossy run makes every run report it
    assert res["drafter"]["methods"] == ["prompt_lookup"] and res["drafter"]["name"] is None
    assert "| 2 | prompt_lookup_flagged | unpadded | **no** |" in (tmp_path / "eval" / "report.md").read_text()
