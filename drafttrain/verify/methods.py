"""The other decoding methods of our papers as engine proposers: SSSD, improved MCSD and MTAD.

Each class is a :class:`~drafttrain.verify.proposers.Proposer` with its own acceptance rule (the
optional ``accept`` hook of the protocol) and a ``lossless`` flag, so :class:`~drafttrain.verify.engine.SpecEngine`
runs it with the same batching, KV cache and statistics as the trained drafters, and the harness
(``python -m scripts.evaluate methods=[...]``) reports it in the same tables.

- :class:`SSSDProposer` (SSSD, Marzollo et al.; ../shared/papers/SSSD.txt §3.1, §4.2): training-free
  trees from the sequence's own input trie and the suffix-array datastore, fused by pseudo-probability
  (:class:`~drafttrain.verify.sssd.SSSDDrafter`, vectorised across the batch); membership acceptance
  (sample from the target, accept if among the children): **lossless**.
- :class:`MCSDProposer` (improved MCSD, Lu et al.; MCSD-improved.txt §3.1, §4.1): the ``(W_t, k_1..k_γ)``
  tree grown by a drafter (:func:`~drafttrain.verify.mcsd.grow_mcsd_tree`). W_t = 1: the verifier's bonus
  token is the root, drafts are verified by the engine's lossless multi-candidate rule (greedy tree
  walk / recursive rejection sampling): **lossless**. W_t > 1: the target's distribution after the last
  accepted token is kept instead of sampling one bonus token from it; the next tree starts from W_t
  tokens drawn from it (the "target model initialized" roots) and the root whose subtree is accepted
  furthest wins (:func:`~drafttrain.verify.mcsd.target_initialized_accept`): **lossy**. Such steps emit
  no bonus token (``Acceptance.bonus = None``): their "bonus" is the chosen root of the next tree.
  The first step of a sequence, and any step after one that accepted nothing, has no kept
  distribution and runs as W_t = 1.
- :class:`MTADProposer` (MTAD; MTAD.txt §3.2): beam drafting of K tokens with B beams by joint draft
  likelihood (:func:`~drafttrain.verify.mtad.beam_draft`), acceptance of the longest prefix with
  min(1, P_i / Q_i) >= τ (:func:`~drafttrain.verify.mtad.mtad_accept`): **lossy**.

MCSD and MTAD grow their trees with a drafter that gives next-token distributions per depth. Our
trained drafter is ParallelSpec's parallel one: one forward gives q_1..q_{K+1} for depths 1..K+1 after
the root, the same for every node at a depth (as Medusa heads), so "the drafter's distribution after
node x at depth d" is q_{d+1} whatever x is, and MTAD's joint draft likelihood is the product of the
per-depth marginals. That is what these classes do (they reuse :class:`ParallelSpecProposer`'s drafter
KV cache and batched forward). With an autoregressive drafter (EAGLE) the beams' joint likelihood is
the product of true conditionals: :class:`MTADEagleProposer` (same acceptance rule).

Shape letters: n tree nodes, v vocabulary, K mask tokens, W target roots, B beams.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from drafttrain.sampling import GREEDY, SamplingParams, process_logits
from drafttrain.verify.acceptance import Acceptance, accept
from drafttrain.verify.mcsd import (
    MCSDConfig,
    decision_features_topk,
    grow_mcsd_tree,
    sample_target_roots,
    target_initialized_accept,
)
from drafttrain.verify.mtad import beam_draft, mtad_accept
from drafttrain.verify.proposers import EagleProposer, ParallelSpecProposer
from drafttrain.verify.sssd import SSSDDrafter, membership_accept
from drafttrain.verify.tree import DraftTree


def _target_probs(target_logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """[n + 1, v] rows a rule samples from: the processed distribution, or the logits under greedy
    (argmax is all greedy needs and the rules take the argmax of whatever they get)."""
    return target_logits.float() if sampling.greedy else process_logits(target_logits, sampling)


# =================================================================================================
# SSSD
# =================================================================================================
class SSSDProposer:
    """SSSD drafting (input trie + datastore, SSSD §3.1) with the membership rule (§4.2), lossless.

    Args:
        drafter: an :class:`~drafttrain.verify.sssd.SSSDDrafter` (its datastore is memory-mapped).
        node_budget: candidate nodes per tree (root excluded); default the drafter config's
            ``node_budget``. The speculation-length planner (:func:`~drafttrain.verify.sssd.plan_speculation_length`)
            picks it per batch size.
    """

    name = "sssd"
    lossless = True

    def __init__(self, drafter: SSSDDrafter, node_budget: int | None = None):
        self.drafter = drafter
        self.node_budget = drafter.config.node_budget if node_budget is None else int(node_budget)
        self._states: dict[int, object] = {}

    def start(self, slot, prompt_ids, hidden, first_token) -> None:
        self._states[slot] = self.drafter.new_state(list(prompt_ids) + [int(first_token)])

    def draft(self, slots, sampling=GREEDY, generator=None) -> list[DraftTree]:
        trees = self.drafter.draft_batch([self._states[s] for s in slots], self.node_budget)
        return [DraftTree(t.tokens, t.parents) for t in trees]

    def commit(self, slot, tokens, hidden) -> None:
        self._states[slot].append(int(t) for t in tokens)

    def release(self, slot) -> None:
        self._states.pop(slot, None)

    def accept(self, slot, tree: DraftTree, target_logits, sampling=GREEDY, generator=None) -> Acceptance:
        """Membership rule: the target's token (argmax or a draw) at each node, kept while it is a child."""
        res = membership_accept(tree.tokens, tree.parents, _target_probs(target_logits, sampling), generator,
                                greedy=sampling.greedy)  # fmt: skip
        return Acceptance(res.accepted_nodes, res.tokens[-1])


# =================================================================================================
# improved MCSD
# =================================================================================================
class MCSDProposer(ParallelSpecProposer):
    """Improved MCSD trees ``(W_t, k_1..k_γ)`` grown by a parallel drafter (module docstring).

    Args:
        drafter: a ParallelSpec drafter (``propose`` / the batched interface of :class:`ParallelSpecProposer`).
        config: :class:`~drafttrain.verify.mcsd.MCSDConfig`; levels beyond the drafter's depths are
            dropped (W_t = 1: K + 1 levels at most; W_t > 1: K, the roots take depth 1).
        batched: one drafter forward for the whole batch (see :class:`ParallelSpecProposer`).
        decision_model: optional early-stop model (§3.3; :func:`drafttrain.decision.load_decision_model`)
            on :func:`level_features`: level l + 1 is grown only while the product of the predicted
            acceptance of levels 1..l + 1 is >= ``beta`` (0.4 in the paper). W_t = 1 trees only. The
            decision reads the drafter's distributions, never the drawn tokens, so W_t = 1 stays lossless.
        decision_topk: k of the features when logging without a model (a model brings its own).
        log_decisions: collect ``{"features", "label"}`` per level that was reached (its parent level
            accepted) in :attr:`decisions`: the decision model's training data (``+recipe=decision_model``).

    Attributes:
        lossless: ``config.is_lossless`` (W_t == 1).
    """

    def __init__(self, drafter, config: MCSDConfig, batched: bool = True, decision_model=None, beta: float = 0.4,
                 decision_topk: int = 8, log_decisions: bool = False):  # fmt: skip
        super().__init__(drafter, batched=batched)
        self.config = config
        self.decision_model = decision_model.eval() if decision_model is not None else None
        self.beta = float(beta)
        self.decision_topk = int(getattr(decision_model, "topk", decision_topk))
        self.decisions: list[dict] | None = [] if log_decisions else None  # (features, depth, label) per reached level
        self._level_feats: dict[int, torch.Tensor] = {}
        self.name = f"mcsd_w{config.num_target_roots}"
        self.lossless = config.is_lossless
        k1 = self.depth
        self._cfg1 = MCSDConfig(config.ks[:k1], 1)  # W_t = 1 shape (also the W_t > 1 mode's first step)
        self._cfg_w = MCSDConfig(config.ks[: max(k1 - 1, 1)], config.num_target_roots)
        self._next: dict[int, torch.Tensor] = {}  # slot -> target distribution after the next root [v]
        self._rooted: dict[int, bool] = {}  # slot -> this step's tree has W_t target roots

    def release(self, slot) -> None:
        super().release(slot)
        self._next.pop(slot, None)
        self._rooted.pop(slot, None)

    def draft(self, slots, sampling=GREEDY, generator=None) -> list[DraftTree]:
        logits = self._draft_logits_batched(slots) if self.batched else [self._draft_logits_one(s) for s in slots]
        trees = []
        for slot, lg in zip(slots, logits):  # [K + 1, v]: the drafter's distributions of depths 1..K + 1
            probs = torch.softmax(lg.float(), dim=-1) if sampling.greedy else process_logits(lg, sampling)
            nxt = self._next.pop(slot, None)
            w = self.config.num_target_roots
            # W_t distinct draws need W_t tokens of nonzero mass (top-p can leave fewer): else a W_t = 1 step
            rooted = nxt is not None and w > 1 and int((nxt > 0).sum()) >= w
            self._rooted[slot] = rooted
            if rooted:  # depth 1 = W_t target draws; level l (depth l + 1) grows from q_{l+1}
                roots = sample_target_roots(nxt, w, generator, greedy=sampling.greedy)
                cfg = self._cfg_w
            else:
                roots, cfg = None, self._cfg1
            depth_of: list[int] = []

            def step(tokens, parents, frontier, probs=probs, depth_of=depth_of):
                while len(depth_of) < tokens.numel():  # depths of the nodes added since the last call
                    p = int(parents[len(depth_of)])
                    depth_of.append(1 if p < 0 else depth_of[p] + 1)
                # children of a node at depth d are drawn from q_{d+1} (row d; the committed root is depth 0)
                return probs[[0 if f < 0 else depth_of[f] for f in frontier.tolist()]]

            stop = None
            if not rooted and (self.decision_model is not None or self.decisions is not None):
                feats = level_features(probs[: len(cfg.ks)], self.decision_topk)  # [levels, k + 2]
                self._level_feats[slot] = feats
                if self.decision_model is not None:
                    p_level = self.decision_model.accept_prob(feats)  # [levels]

                    def stop(level, _probs, p_level=p_level):  # grow level + 1 only if some path may reach it
                        return bool(torch.prod(p_level[: level + 1]) < self.beta)

            t = grow_mcsd_tree(step, cfg, roots, generator, greedy=sampling.greedy, replacement=False, stop=stop)
            if rooted:  # the roots come from the target, not a draft distribution: the rule needs none
                trees.append(DraftTree(t.tokens, t.parents))
            else:
                trees.append(DraftTree(t.tokens, t.parents, t.draft_probs, t.dist_index))
        return trees

    def accept(self, slot, tree: DraftTree, target_logits, sampling=GREEDY, generator=None) -> Acceptance:
        """W_t = 1 trees: the engine's lossless rule; W_t > 1 trees: the best target root (lossy).

        With W_t > 1 configured, a step that accepted something keeps the target's distribution after
        its last accepted node for the next tree's roots and emits no bonus token.
        """
        w = self.config.num_target_roots
        if self._rooted.get(slot):
            res = target_initialized_accept(tree.tokens, tree.parents, w, _target_probs(target_logits, sampling),
                                            generator, greedy=sampling.greedy)  # fmt: skip
            acc = Acceptance(res.accepted_nodes, None)
        else:
            acc = accept(tree, target_logits, sampling, generator, replacement=False)
            feats = self._level_feats.pop(slot, None)
            if self.decisions is not None and feats is not None:  # a level is a decision once its parent level was accepted
                levels = int(tree.depth().max()) if tree.n else 0
                for lv in range(1, min(levels, len(acc.path) + 1) + 1):
                    self.decisions.append({"features": feats[lv - 1].tolist(), "label": int(len(acc.path) >= lv)})
            if w == 1 or not acc.path:
                return acc
            acc = Acceptance(acc.path, None)
        row = target_logits[acc.path[-1] + 1].float()
        self._next[slot] = torch.softmax(row, -1) if sampling.greedy else process_logits(row, sampling)
        return acc


def level_features(level_probs: torch.Tensor, k: int) -> torch.Tensor:
    """Decision-model input of each drafted level (MCSD-improved §3.3 type 2, plus the depth).

    A parallel drafter's level l has one distribution q_l for all its nodes, so the early-stop
    decision is per level: ``[top-k probabilities of q_l, entropy of q_l (nats), l]``.

    Args:
        level_probs: float [L, v], q_1..q_L. k: top-k size.

    Returns:
        float [L, k + 2].
    """
    depth = torch.arange(1, level_probs.shape[0] + 1, dtype=torch.float32, device=level_probs.device)[:, None]
    return torch.cat([decision_features_topk(level_probs.float(), k), depth], dim=-1)


# =================================================================================================
# MTAD
# =================================================================================================
class MTADProposer(ParallelSpecProposer):
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
        if num_beams < 1:
            raise ValueError(f"num_beams must be >= 1, got {num_beams}")
        self.num_beams = int(num_beams)
        self.num_steps = self.depth if num_steps is None else min(int(num_steps), self.depth)
        if self.num_steps < 1:
            raise ValueError("num_steps must be >= 1")
        self.threshold = float(threshold)
        self._draft_lp: dict[int, torch.Tensor] = {}

    def release(self, slot) -> None:
        super().release(slot)
        self._draft_lp.pop(slot, None)

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

    def accept(self, slot, tree: DraftTree, target_logits, sampling=GREEDY, generator=None) -> Acceptance:
        """Longest prefix whose joint target/draft likelihood ratio passes τ, then one target token."""
        return _mtad_acceptance(tree, self._draft_lp.pop(slot), target_logits, self.threshold, sampling, generator)


def _mtad_acceptance(tree: DraftTree, draft_lp: torch.Tensor, target_logits, threshold: float,
                     sampling: SamplingParams, generator) -> Acceptance:  # fmt: skip
    lg = target_logits.float() if sampling.greedy else torch.log(process_logits(target_logits, sampling))
    accepted, bonus = mtad_accept(lg[None], tree.tokens[None].to(lg.device), draft_lp[None].to(lg.device), threshold,
                                  generator, greedy=sampling.greedy)  # fmt: skip
    m = int(accepted[0])
    assert m <= tree.n
    return Acceptance(list(range(m)), int(bonus[0]))


class MTADEagleProposer(EagleProposer):
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
        if num_beams < 1:
            raise ValueError(f"num_beams must be >= 1, got {num_beams}")
        self.num_beams = int(num_beams)
        self.num_steps = int(drafter.draft_depth) if num_steps is None else int(num_steps)
        if self.num_steps < 1:
            raise ValueError("num_steps must be >= 1")
        self.threshold = float(threshold)
        self._draft_lp: dict[int, torch.Tensor] = {}

    def release(self, slot) -> None:
        super().release(slot)
        self._draft_lp.pop(slot, None)

    def draft(self, slots, sampling=GREEDY, generator=None) -> list[DraftTree]:
        trees = []
        for slot in slots:
            d = self._beam_one(slot, sampling, generator)
            self._draft_lp[slot] = d.draft_log_probs
            trees.append(DraftTree(d.tokens, d.parents))
        return trees

    def accept(self, slot, tree: DraftTree, target_logits, sampling=GREEDY, generator=None) -> Acceptance:
        return _mtad_acceptance(tree, self._draft_lp.pop(slot), target_logits, self.threshold, sampling, generator)

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


__all__ = ["SSSDProposer", "MCSDProposer", "MTADProposer", "MTADEagleProposer"]
