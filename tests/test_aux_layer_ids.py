"""EAGLE-3's low / middle / high layer ids: defaults valid for every depth, one rule shared by training's
config check and the engine exports, and an export refusal that suggests ids that pass (never the ids it
refuses)."""

from __future__ import annotations

import pytest
import torch

from drafttrain.cliconfig import ConfigError
from drafttrain.drafters.eagle3 import (
    aux_layer_ids_problem,
    default_aux_layer_ids,
    feature_layer_ids,
    resolve_aux_layer_ids,
    suggested_aux_layer_ids,
)
from helpers import compose_dict, need_input


@pytest.mark.parametrize("depth", range(3, 41))
def test_default_ids_pass_the_export_rule_at_every_depth(depth):
    ids = default_aux_layer_ids(depth)
    assert len(ids) == 3 and 0 <= ids[0] < ids[1] < ids[2] <= depth - 1
    assert aux_layer_ids_problem(ids, depth) is None
    assert resolve_aux_layer_ids(None, depth) == ids == resolve_aux_layer_ids(list(ids), depth)
    assert len(feature_layer_ids(None, depth)) == 4  # low, mid, high, final: all distinct
    if depth >= 7:  # where vLLM's own default is distinct, it is kept
        assert ids == (2, depth // 2, depth - 3)


def test_small_depths_spread_low_middle_high():
    assert [default_aux_layer_ids(n) for n in (3, 4, 5, 6)] == [(0, 1, 2), (1, 2, 3), (2, 3, 4), (2, 3, 4)]
    assert default_aux_layer_ids(2) == (1, 1, 0)  # no three distinct ids exist: clamped, trains, not exportable
    assert "no 3 distinct layer ids" in aux_layer_ids_problem((1, 1, 0), 2)


@pytest.mark.parametrize("ids", [[2, 3, 3], [3, 2, 4], [2, 3, 6], [-1, 2, 3], [1, 2]])
def test_explicit_ids_breaking_the_rule_are_refused_with_valid_ids_suggested(ids):
    with pytest.raises(ValueError, match=r"strictly increasing.*drafter\.aux_layer_ids=\[2,3,4\]"):
        resolve_aux_layer_ids(ids, 6)
    assert aux_layer_ids_problem(ids, 6) is not None
    assert aux_layer_ids_problem([2, 3, 4], 6) is None


def test_validation_refuses_colliding_ids_before_any_model_loads():
    """target=tiny with 6 layers: [2, 3, 3] fails at config validation (same rule as the export), the
    defaults validate."""
    from drafttrain.validation import validate

    base = ["+recipe=eagle3", "target=tiny", "target.num_hidden_layers=6"]
    with pytest.raises(ConfigError, match=r"aux_layer_ids must be 3 strictly increasing.*\[2,3,4\]"):
        validate(compose_dict("train", [*base, "drafter.aux_layer_ids=[2,3,3]"]))
    assert validate(compose_dict("train", base)).drafter.aux_layer_ids is None


def test_export_message_suggests_ids_the_export_accepts(tmp_path):
    """A 6-layer target (the default vLLM formula collides there): the default drafter exports; forcing the
    old colliding ids is refused and the suggested ids are the default, which the same rule accepts."""
    from drafttrain.config import TargetConfig
    from drafttrain.drafters import build_drafter
    from drafttrain.export import export_drafter
    from drafttrain.export.common import ExportError
    from drafttrain.target import load_target

    target = need_input(lambda: load_target(TargetConfig(random_init=True, num_hidden_layers=6)))
    torch.manual_seed(0)
    drafter = build_drafter("eagle3", {"draft_depth": 2}, target).eval()
    assert drafter.aux_layer_ids == (2, 3, 4)
    export_drafter(drafter, "speculators", tmp_path / "ok", target_config=target.config)
    drafter.aux_layer_ids = (2, 3, 3)
    with pytest.raises(ExportError, match=r"\[2, 3, 3\].*drafter\.aux_layer_ids=\[2,3,4\]") as err:
        export_drafter(drafter, "speculators", tmp_path / "bad", target_config=target.config)
    assert "aux_layer_ids=[2,3,3]" not in str(err.value)
    assert suggested_aux_layer_ids(6).startswith("drafter.aux_layer_ids=[2,3,4]")
