"""ParallelSpec in the EAGLE integration (ParallelSpec paper section 4.3, Eq. 4).

"Integrating ParallelSpec into EAGLE ... only requires minor modifications to turn the auto-regression
head into a parallel head": the EAGLE drafter (items fc([e(x_{i+1}); f_i]) -> one decoder layer ->
predicted feature f^ -> frozen LM head) gets K learned [MASK] inputs and is trained with the group-wise
layout (:mod:`drafttrain.layout`), and "the training loss of EAGLE-Parallel is the sum of EAGLE losses
(Eq. 4) over the tokens within the same group":

    L = sum_{k=0..K} [ w_reg * SmoothL1(f_{a+k+1}, f^_{a,k}) + w_cls * CE(LM head(f^_{a,k}), x_{a+k+2}) ],

each position's terms averaged over its slots (weights all 1 by default: ``loss_decay`` = 1.0).
Group position k of anchor a (the item for k = 0, mask slot k otherwise) regresses the target's
feature f_{a+k+1}, whose LM head gives the slot's label. Inputs carry EAGLE's U(-a, a) feature noise.

The network and inference are ParallelSpec's (:class:`~drafttrain.drafters.parallelspec.ParallelSpecDrafter`:
one forward pass over the items + K masks drafts K + 1 tokens); only the objective and the input noise
differ. Shape letters: b batch, s layout slots, m slots, d hidden, N draft vocab.
"""

from __future__ import annotations

from drafttrain import layout as L
from drafttrain.drafters.parallelspec import ParallelSpecDrafter
from drafttrain.losses import eagle_group_loss


class ParallelSpecEagleDrafter(ParallelSpecDrafter):
    """ParallelSpec drafter trained with the sum of EAGLE losses over each parallel group.

    Config keys: those of :class:`ParallelSpecDrafter` (``loss_decay`` weights the K + 1 positions;
    default 1.0 = the paper's plain sum) plus EAGLE's ``reg_weight`` (1.0), ``cls_weight`` (0.1) and
    ``feature_noise`` (0.1).

    Inference: :meth:`propose` / :meth:`forward_inputs` as for ParallelSpec; :meth:`forward_inputs` also
    returns the predicted features.
    """

    name = "parallelspec_eagle"
    objective_refusal = ("ParallelSpec's EAGLE integration (Eq. 4) regresses target features and has no group "
                         "objective path yet; the main job's parallelspec recipe and dflash train on-policy")
    objectives = frozenset()  # not the parent's: its own loss (Eq. 4)
    defaults = {
        **ParallelSpecDrafter.defaults,
        "loss_decay": 1.0,
        "reg_weight": 1.0,
        "cls_weight": 0.1,
        "feature_noise": 0.1,
    }

    def group_loss(self, hidden, lay: L.BatchLayout, feats, valid, sel, draft_labels):
        """Sum over the K + 1 group positions of EAGLE's loss. Returns (loss, logits of ``sel`` slots, sums)."""
        fhat = self.predict_features(hidden[valid])  # [m, d] every labelled slot regresses its feature
        target = self.slot_target_features(lay, feats, valid).to(fhat.dtype)  # [m, d] f_{a+k+1}
        in_vocab = sel[valid]  # [m] the labelled slots whose label the draft vocabulary holds
        logits = self.vocab_logits(fhat[in_vocab])  # [m', N]
        kd = float(self.config["kd_weight"])
        loss, sums = eagle_group_loss(
            fhat, target, lay.slot_kind[valid], logits, draft_labels[sel], lay.slot_kind[sel], self.weights,
            float(self.config["reg_weight"]), float(self.config["cls_weight"]),
            self.target_logits(target[in_vocab]) if kd > 0 else None, kd,
        )  # fmt: skip
        return loss, logits, sums
