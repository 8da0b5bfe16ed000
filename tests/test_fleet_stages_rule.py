"""The fleet's stage list is checked by the product's one stage-list rule (sidecar/config/rules.py)
for what needs no deploy: empty, not integers (a bool included), listed twice. The fleet refuses
with its own class (``stages_invalid``, 422) and the rule's words, before anything is sent."""

from __future__ import annotations

from typing import Any

import pytest

from sidecar.config.rules import check_stage_list
from sidecar.errors import FleetStagesInvalid, StageSelectionError
from sidecar.fleet import Fleet

NOWHERE = "sidecar=http://127.0.0.1:9"  # never contacted: the list is refused when the fleet is built


@pytest.mark.parametrize("stages", [[], [True], [0, False], ["0"], [1.0], [0, 2, 0], (2, 2)],
                         ids=["empty", "true", "false", "text", "float", "twice", "tuple-twice"])
def test_a_bad_stage_list_is_refused_in_the_shared_rules_words(stages: Any) -> None:
    with pytest.raises(StageSelectionError) as rule:
        check_stage_list(stages)
    with pytest.raises(FleetStagesInvalid) as fleet:
        Fleet([NOWHERE], stages=stages)
    err = fleet.value
    assert (err.code, err.http_status, err.key, err.details, err.message) == (
        "stages_invalid", 422, "stages", {"stages": list(stages)}, rule.value.message)


@pytest.mark.parametrize("stages", [[0], [2, 0], (0, 1)])
def test_a_good_stage_list_is_kept_as_given(stages: Any) -> None:
    assert Fleet([NOWHERE], stages=stages).stages == list(stages)
