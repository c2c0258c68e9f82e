"""MTAD: multi-token assisted decoding — beam drafting with joint draft likelihoods, joint-likelihood
acceptance of the longest passing prefix (lossy), and output perplexity under the target.

Source: "Optimized Multi-Token Joint Decoding with Auxiliary Model for LLM Inference".

Drafting (§3.2): the auxiliary model's joint distribution q(x_{1:K} | context) approximates the
target's; "it is still infeasible to directly generate draft tokens from the joint distribution ... so
we propose to further approximate this process with beam sampling" (§2.1 Eq. 2: the B sequences of
length t are drawn from the B x v one-token extensions of the kept beams in proportion to their joint
likelihood). :func:`beam_draft` keeps B beams for K steps (sampled without replacement by Gumbel-top-B,
or deterministically the top B) and returns the most likely final beam with its per-token draft
log-probabilities.

Acceptance (§3.2 "Draft Tokens Verification"): with P_i = p(x_{1:i} | context) the target's joint
likelihood of the first i draft tokens and Q_i = q(x_{1:i} | context) the drafter's, "for each prefix
sub-sequence x_{1:i}, it passes verification if and only if min(1, P_i / Q_i) >= tau ... MTAD accepts
the longest prefix sub-sequence that passes verification", then one more token is sampled from the
target after it (step 3). Every prefix is checked on its own, so a longer prefix can pass after a
shorter one failed. Computed in log space: ``min(0, log P_i - log Q_i) >= log tau``.
**Lossy**: the output does not follow the target's distribution (``IS_LOSSLESS = False``); report its
perplexity (:func:`perplexity`, Eq. 1) next to its speed.

Boundary conventions (stated because the paper's threshold sweep, §5.2.2, needs both ends):
- tau = 0: every prefix passes (log 0 = -inf and -inf >= -inf), including prefixes the target gives
  probability 0: all K drafts are accepted.
- 0 < tau < 1: the comparison is ``>=`` as written in the paper, so min(1, P_i/Q_i) == tau passes.
- tau >= 1: no prefix passes, also when P_i >= Q_i; "when tau = 1, all the draft tokens are rejected,
  which makes MTAD equivalent to multinomial sampling" (§5.2.2).
- 0/0 (both likelihoods 0) counts as ratio 0; P > 0 with Q = 0 as ratio +inf (passes for tau < 1).

In the engine: :class:`MTADProposer` (a one-pass drafter's per-depth marginals as the joint q) and
:class:`MTADEagleProposer` (an autoregressive drafter's true conditionals); in the harness the
``mtad`` method (section ``mtad.*`` = :class:`MTADEvalConfig`) picks between them by the drafter's
own proposer.

Shape letters: b batch, B beams, K draft steps, v vocabulary, s sequence length.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from drafttrain.config import GE0, GE1
from drafttrain.sampling import GREEDY, SamplingParams, process_logits
from drafttrain.verify.acceptance import Acceptance
from drafttrain.verify.methods.registry import Method, MethodContext, Variant, register
from drafttrain.verify.proposers import EagleProposer, ParallelSpecProposer
from drafttrain.verify.tree import DraftTree

#: MTAD changes the output distribution (joint-likelihood acceptance is not rejection sampling).
IS_LOSSLESS = False

#: ``step(prefixes [B, t]) -> log_probs [B, v]``: the drafter's next-token log-probabilities after each
#: beam's t drafted tokens (the context before them is the callable's own state; t = 0 at the first step).
DrafterStep = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class MTADDraft:
    """The draft of one sequence: the most likely beam, as a chain in the verifier's tree contract.

    Attributes:
        tokens: int64 [K] draft tokens x_1..x_K.
        parents: int64 [K] chain (-1, 0, 1, ..., K-2).
        draft_log_probs: float32 [K], log q(x_i | context, x_{<i}); their cumsum is log Q_i.
        beams: int64 [B', K] all final beams (B' <= B), best first.
        beam_log_probs: float32 [B'] joint log q of each final beam.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    draft_log_probs: torch.Tensor
    beams: torch.Tensor
    beam_log_probs: torch.Tensor
    is_lossless: bool = IS_LOSSLESS

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def joint_log_q(self) -> torch.Tensor:
        """float32 [K]: log Q_i = sum_{j <= i} log q(x_j | ...)."""
        return torch.cumsum(self.draft_log_probs, 0)

    def contract(self) -> dict[str, torch.Tensor | None]:
        """Tree fields for the verifier (MTAD's rule needs ``draft_log_probs``, kept on this object)."""
        return {"tokens": self.tokens, "parents": self.parents, "draft_probs": None, "dist_index": None}


def beam_draft(
    step: DrafterStep,
    num_beams: int,
    num_steps: int,
    sample: bool = True,
    generator: torch.Generator | None = None,
) -> MTADDraft:
    """Beam drafting of K tokens with B beams (MTAD §3.2 with §2.1 Eq. 2 beam sampling).

    At each step every kept beam is extended by every token; candidate score = beam's joint log q +
    log q(token | beam). ``sample=True`` keeps B candidates drawn without replacement with probability
    proportional to exp(score) (Gumbel-top-B; Eq. 2), ``sample=False`` keeps the B highest (deterministic
    beam search). Candidates with score -inf are never kept. The draft is the final beam with the
    highest joint likelihood.

    Args:
        step: see :data:`DrafterStep`; must return finite or -inf log-probs of shape [B_t, v].
        num_beams: B >= 1; num_steps: K >= 1.
        sample, generator: as above.

    Returns:
        :class:`MTADDraft`.

    Raises:
        ValueError: B or K < 1, a step returns the wrong number of rows, or every candidate is -inf.
    """
    if num_beams < 1 or num_steps < 1:
        raise ValueError(f"num_beams and num_steps must be >= 1, got {num_beams}, {num_steps}")
    beams = torch.zeros(1, 0, dtype=torch.long)  # [B_t, t]
    scores = torch.zeros(1)  # [B_t] joint log q
    token_lp = torch.zeros(1, 0)  # [B_t, t] per-token log q
    for _ in range(num_steps):
        logq = step(beams).float()  # [B_t, v]
        if logq.ndim != 2 or logq.shape[0] != beams.shape[0]:
            raise ValueError(f"step returned {tuple(logq.shape)} for {beams.shape[0]} beams")
        v = logq.shape[1]
        cand = (scores[:, None] + logq).reshape(-1)  # [B_t * v]
        finite = torch.isfinite(cand)
        k = min(num_beams, int(finite.sum()))
        if k == 0:
            raise ValueError("every candidate extension has probability 0")
        key = cand
        if sample:
            u = torch.rand(cand.shape, generator=generator).clamp_(1e-20, 1.0)
            key = cand - torch.log(-torch.log(u))  # Gumbel-top-k = sampling without replacement
        key = torch.where(finite, key, torch.full_like(key, -math.inf))
        chosen = torch.topk(key, k).indices  # [k]
        src, tok = chosen // v, chosen % v
        beams = torch.cat([beams[src], tok[:, None]], dim=1)
        token_lp = torch.cat([token_lp[src], logq[src, tok][:, None]], dim=1)
        scores = cand[chosen]
    order = torch.argsort(scores, descending=True, stable=True)
    beams, scores, token_lp = beams[order], scores[order], token_lp[order]
    k_steps = beams.shape[1]
    return MTADDraft(
        tokens=beams[0].clone(),
        parents=torch.arange(-1, k_steps - 1, dtype=torch.long),
        draft_log_probs=token_lp[0].clone(),
        beams=beams,
        beam_log_probs=scores,
    )


def passing_prefixes(target_log_probs: torch.Tensor, draft_log_probs: torch.Tensor, tau: float) -> torch.Tensor:
    """Which prefixes x_{1:i} pass MTAD's test ``min(1, P_i / Q_i) >= tau`` (see module docstring).

    Args:
        target_log_probs: float [..., K], log p(x_i | context, x_{<i}) of the draft tokens.
        draft_log_probs: float [..., K], log q(x_i | context, x_{<i}).
        tau: threshold >= 0.

    Returns:
        bool [..., K]; entry i - 1 says whether the prefix of length i passes.

    Raises:
        ValueError: tau < 0 or NaN, or shapes differ.
    """
    if not tau >= 0:
        raise ValueError(f"tau must be >= 0, got {tau}")
    if target_log_probs.shape != draft_log_probs.shape:
        raise ValueError(f"shapes differ: {tuple(target_log_probs.shape)} vs {tuple(draft_log_probs.shape)}")
    if tau >= 1:
        return torch.zeros(target_log_probs.shape, dtype=torch.bool)
    log_p = torch.cumsum(target_log_probs.double(), -1)  # log P_i
    log_q = torch.cumsum(draft_log_probs.double(), -1)  # log Q_i
    diff = log_p - log_q
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, -math.inf), diff)  # 0/0 -> ratio 0
    log_ratio = torch.clamp(diff, max=0.0)  # log min(1, P/Q)
    return log_ratio >= (math.log(tau) if tau > 0 else -math.inf)


def mtad_accept_length(target_log_probs: torch.Tensor, draft_log_probs: torch.Tensor, tau: float) -> torch.Tensor:
    """Number of draft tokens MTAD accepts: the longest passing prefix, each prefix checked independently.

    Args: as :func:`passing_prefixes`.

    Returns:
        int64 [...] in [0, K] (0 when no prefix passes).
    """
    passing = passing_prefixes(target_log_probs, draft_log_probs, tau)  # [..., K]
    k = passing.shape[-1]
    lengths = torch.arange(1, k + 1).expand_as(passing)
    return torch.where(passing, lengths, torch.zeros_like(lengths)).amax(-1) if k else torch.zeros(passing.shape[:-1], dtype=torch.long)


def gather_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] per position: logits float [..., s, v], tokens int64 [..., s] -> float [..., s]."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def mtad_accept(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_log_probs: torch.Tensor,
    tau: float,
    generator: torch.Generator | None = None,
    greedy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One MTAD verification step for a batch: accept the longest passing prefix, then one target token.

    Args:
        target_logits: float [b, K + 1, v]; row i = target logits after the context and x_{1:i}
            (row 0 after the committed root). Warping (temperature/top-k/top-p) is the caller's.
        draft_tokens: int64 [b, K]; draft_log_probs: float [b, K] (log q per token).
        tau: threshold (module docstring for tau = 0 and tau >= 1).
        generator, greedy: the bonus token is sampled from row ``accepted`` (or its argmax).

    Returns:
        ``(accepted [b] int64, bonus [b] int64)``: commit ``draft_tokens[i, :accepted[i]]`` then ``bonus[i]``.
    """
    if target_logits.ndim != 3 or target_logits.shape[1] != draft_tokens.shape[1] + 1:
        raise ValueError(f"target_logits must be [b, K + 1, v], got {tuple(target_logits.shape)} for K = {draft_tokens.shape[1]}")
    target_lp = gather_log_probs(target_logits[:, :-1], draft_tokens)  # [b, K]
    accepted = mtad_accept_length(target_lp, draft_log_probs, tau)  # [b]
    rows = target_logits[torch.arange(target_logits.shape[0]), accepted].float()  # [b, v]
    if greedy:
        bonus = rows.argmax(-1)
    else:
        bonus = torch.multinomial(torch.softmax(rows, -1), 1, generator=generator).squeeze(-1)
    return accepted, bonus


# ---------------------------------------------------------------------------------------------
# output quality
# ---------------------------------------------------------------------------------------------
def perplexity(log_probs: torch.Tensor | Sequence[torch.Tensor]) -> float:
    """Perplexity exp(-mean log p) of MTAD Eq. 1, token-weighted over one or several sequences.

    Args:
        log_probs: float [s] (or a list of them): log p(x_i | x_{<i}) of each output token under the target.

    Raises:
        ValueError: no tokens.
    """
    parts = [log_probs] if isinstance(log_probs, torch.Tensor) else list(log_probs)
    flat = torch.cat([p.reshape(-1).double() for p in parts]) if parts else torch.zeros(0)
    if flat.numel() == 0:
        raise ValueError("perplexity of zero tokens")
    return float(torch.exp(-flat.mean()))


@torch.no_grad()
def output_log_probs(target, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> torch.Tensor:
    """Log-probabilities of an output under the target, teacher-forced in one forward pass.

    Args:
        target: :class:`drafttrain.target.Target` (or anything with ``forward(input_ids [1, s]) -> .logits``).
        prompt_ids: the prompt (>= 1 token); output_ids: the generated tokens (>= 1).

    Returns:
        float32 [len(output_ids)]: log p(y_j | prompt, y_{<j}).
    """
    if len(prompt_ids) < 1 or len(output_ids) < 1:
        raise ValueError("need at least one prompt token and one output token")
    ids = torch.tensor([list(prompt_ids) + list(output_ids)], dtype=torch.long)
    logits = target.forward(ids).logits[0]  # [s, v]
    n_prompt = len(prompt_ids)
    return gather_log_probs(logits[n_prompt - 1 : -1], ids[0, n_prompt:])


def output_perplexity(target, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> float:
    """Token-weighted perplexity of several outputs under the target (the harness's quality metric)."""
    return perplexity([output_log_probs(target, p, o) for p, o in zip(prompts, outputs) if len(o)])


# ---------------------------------------------------------------------------------------------
# the engine proposers
# ---------------------------------------------------------------------------------------------
class _MTADRule:
    """What both MTAD proposers share: B beams, K draft tokens, threshold τ, each slot's draft log-probs
    kept from ``draft`` to ``accept``, and the joint-likelihood acceptance (lossy)."""

    def _setup_mtad(self, num_beams: int, num_steps: int, threshold: float) -> None:
        if num_beams < 1:
            raise ValueError(f"num_beams must be >= 1, got {num_beams}")
        if num_steps < 1:
            raise ValueError("num_steps must be >= 1")
        self.num_beams, self.num_steps, self.threshold = int(num_beams), int(num_steps), float(threshold)
        self._draft_lp: dict[int, torch.Tensor] = {}

    def release(self, slot) -> None:
        super().release(slot)
        self._draft_lp.pop(slot, None)

    def accept(self, slot, tree: DraftTree, target_logits, sampling=GREEDY, generator=None) -> Acceptance:
        """Longest prefix whose joint target/draft likelihood ratio passes τ, then one target token."""
        return _mtad_acceptance(tree, self._draft_lp.pop(slot), target_logits, self.threshold, sampling, generator)


class MTADProposer(_MTADRule, ParallelSpecProposer):
    """MTAD: B-beam drafting of K tokens by joint draft likelihood, joint-likelihood acceptance (lossy).

    Args:
        drafter: a ParallelSpec drafter; its K + 1 per-depth distributions are the auxiliary model
            (joint q = product of the marginals, module docstring).
        num_beams: B; num_steps: K' <= K + 1 draft tokens (default K + 1).
        threshold: τ of ``min(1, P_i / Q_i) >= τ`` (MTAD §3.2; §5.2.2 finds it insensitive in a middle range).
        batched: see :class:`ParallelSpecProposer`.

    Under greedy decoding the beams are the deterministic top B and the bonus token is the target's
    argmax; under sampling beams are drawn (Gumbel-top-B, Eq. 2) from the processed distributions.
    """

    name = "mtad"
    lossless = False

    def __init__(self, drafter, num_beams: int = 4, num_steps: int | None = None, threshold: float = 0.1,
                 batched: bool = True):  # fmt: skip
        super().__init__(drafter, batched=batched)
        self._setup_mtad(num_beams, self.depth if num_steps is None else min(int(num_steps), self.depth), threshold)

    def draft(self, slots, sampling=GREEDY, generator=None) -> list[DraftTree]:
        logits = self._draft_logits_batched(slots) if self.batched else [self._draft_logits_one(s) for s in slots]
        trees = []
        for slot, lg in zip(slots, logits):
            if sampling.greedy:
                logq = torch.log_softmax(lg.float(), dim=-1)  # [K + 1, v]
            else:
                logq = torch.log(process_logits(lg, sampling))  # -inf outside top-p

            def step(beams, logq=logq):  # independent per-depth marginals: q(x_t | beam) = q_t(x_t)
                return logq[beams.shape[1]].expand(beams.shape[0], -1)

            d = beam_draft(step, self.num_beams, self.num_steps, sample=not sampling.greedy, generator=generator)
            self._draft_lp[slot] = d.draft_log_probs
            trees.append(DraftTree(d.tokens, d.parents))
        return trees


def _mtad_acceptance(tree: DraftTree, draft_lp: torch.Tensor, target_logits, threshold: float,
                     sampling: SamplingParams, generator) -> Acceptance:  # fmt: skip
    lg = target_logits.float() if sampling.greedy else torch.log(process_logits(target_logits, sampling))
    accepted, bonus = mtad_accept(lg[None], tree.tokens[None].to(lg.device), draft_lp[None].to(lg.device), threshold,
                                  generator, greedy=sampling.greedy)  # fmt: skip
    m = int(accepted[0])
    assert m <= tree.n
    return Acceptance(list(range(m)), int(bonus[0]))


class MTADEagleProposer(_MTADRule, EagleProposer):
    """MTAD with an autoregressive drafter (EAGLE): beams scored by the drafter's true joint likelihood.

    MTAD §3.2 assumes an auxiliary model with a joint distribution q(x_{1:K} | context) = prod_t
    q(x_t | context, x_{<t}); an EAGLE drafter is one (each step conditions on the beam's own tokens
    and predicted features), unlike the per-depth marginals of a parallel drafter (:class:`MTADProposer`).
    Each beam step is one drafter forward over the new beam prefixes with tree attention (each prefix's
    item sees the committed items and its own earlier items, at position = root position + length),
    as :class:`~drafttrain.verify.proposers.EagleProposer` expands a tree; the speculative items are
    cropped afterwards; sequences are drafted one after another (each with its own ``DynamicCache``).
    Acceptance as :class:`MTADProposer`: **lossy**.

    Args:
        drafter: an EAGLE drafter.
        num_beams: B; num_steps: K draft tokens (default the drafter's ``draft_depth``).
        threshold: τ of ``min(1, P_i / Q_i) >= τ``.
    """

    name = "mtad"
    lossless = False

    def __init__(self, drafter, num_beams: int = 4, num_steps: int | None = None, threshold: float = 0.1):
        super().__init__(drafter, batched=False)  # beams are drafted one sequence at a time
        self._setup_mtad(num_beams, int(drafter.draft_depth) if num_steps is None else int(num_steps), threshold)

    def draft(self, slots, sampling=GREEDY, generator=None) -> list[DraftTree]:
        trees = []
        for slot in slots:
            d = self._beam_one(slot, sampling, generator)
            self._draft_lp[slot] = d.draft_log_probs
            trees.append(DraftTree(d.tokens, d.parents))
        return trees

    @torch.no_grad()
    def _beam_one(self, slot: int, sampling: SamplingParams, generator):
        st = self._state[slot]
        cache = st["cache"]
        root_lg, root_f, committed = self._append_items(st)

        def logq(lg: torch.Tensor) -> torch.Tensor:  # [..., N] draft-vocab logits -> [..., v] log q
            return torch.log(self._probs(lg, sampling)) if not sampling.greedy else torch.log_softmax(
                self.drafter.full_vocab_logits(lg).float(), -1)

        # beam prefix -> (drafter-cache index of the item ending it, its predicted feature, log q of the next token)
        known: dict[tuple[int, ...], tuple[int, torch.Tensor, torch.Tensor]] = {(): (committed - 1, root_f, logq(root_lg))}
        spec = 0

        def step(beams: torch.Tensor) -> torch.Tensor:
            nonlocal spec
            t = beams.shape[1]
            prefixes = [tuple(b) for b in beams.tolist()]
            new = [p for p in dict.fromkeys(prefixes) if p not in known]
            if new:  # one drafter forward over the new prefixes' last tokens, tree attention over their own items
                feats = torch.stack([known[p[:-1]][1] for p in new])
                ancestors = [[known[p[:l]][0] for l in range(1, t)] for p in new]
                lg, fo = self._forward_level(cache, committed, spec, [p[-1] for p in new], feats, ancestors, t)
                rows = logq(lg)
                for j, p in enumerate(new):
                    known[p] = (committed + spec + j, fo[j], rows[j])
                spec += len(new)
            return torch.stack([known[p][2] for p in prefixes])

        try:
            return beam_draft(step, self.num_beams, self.num_steps, sample=not sampling.greedy, generator=generator)
        finally:
            if spec:
                cache.crop(-spec)


# ---------------------------------------------------------------------------------------------
# the method in the harness: config section, registry entry
# ---------------------------------------------------------------------------------------------
@dataclass
class MTADEvalConfig:
    """``mtad.*`` of ``conf/evaluate.yaml`` (MTAD §3.2): B beams, K' draft tokens (null = the drafter's
    K + 1, or its draft depth), acceptance threshold τ."""

    num_beams: int = 4
    num_steps: int | None = None
    threshold: float = 0.1

    numeric_ranges = dict(num_beams=GE1, num_steps=GE1, threshold=GE0)


def _check(c) -> list[str]:
    m = c.mtad
    if m.num_beams < 1 or (m.num_steps is not None and m.num_steps < 1) or not m.threshold >= 0:
        return ["mtad needs num_beams >= 1, num_steps >= 1 (or null) and threshold >= 0"]
    return []


def _build(ctx: MethodContext) -> list[Variant]:
    m, drafter = ctx.config.mtad, ctx.drafter
    # an autoregressive drafter (its declaration, drafters/base.py DrafterSpec) scores beams by its true joint
    # likelihood; a parallel drafter by the product of its per-depth marginals
    cls = MTADEagleProposer if drafter.spec.drafting == "autoregressive" else MTADProposer
    return [Variant("mtad", lambda bs, refs: cls(drafter, m.num_beams, m.num_steps, m.threshold))]


MTAD = register(Method("mtad", _build, needs_drafter=True, lossless=IS_LOSSLESS, config=MTADEvalConfig, check=_check,
                       summary="MTAD: beam drafting, joint-likelihood acceptance (lossy; perplexity reported)"))  # fmt: skip
