"""Stage domain_tau: each evaluated draft of the run gets its per-domain tau (with interval) in its specdraft.json."""
from __future__ import annotations

import json

import pytest

from train.stages import STAGES, domain_tau_stage


def test_domain_tau_writes_each_run_drafts_tau_into_its_specdraft(tmp_path):
    (tmp_path / "drafts" / "distilled").mkdir(parents=True)
    (tmp_path / "drafts" / "distilled" / "specdraft.json").write_text(json.dumps({"kind": "distilled"}))
    doc = {"num_draft_tokens": 4, "drafts": {
        "distilled": {"medical": {"mean_accepted_length": 2.5, "mean_accepted_length_ci": [2.2, 2.8],
                                  "num_draft_tokens": 4, "num_prompts": 8},
                      "code": {"mean_accepted_length": 1.5, "mean_accepted_length_ci": None, "num_prompts": 8}},
        "outside": {"medical": {"mean_accepted_length": 9.0}}}}  # not under drafts/: left alone
    with pytest.raises(ValueError, match="put eval before domain_tau"):
        domain_tau_stage(None, None, tmp_path)
    (tmp_path / "metrics.json").write_text(json.dumps(doc))
    out = STAGES["domain_tau"].run(None, None, tmp_path, None)
    assert out == {"domain_mean_accepted_length": {"distilled": {"medical": 2.5, "code": 1.5}}}
    meta = json.loads((tmp_path / "drafts" / "distilled" / "specdraft.json").read_text())
    assert meta["kind"] == "distilled"
    assert meta["domain_mean_accepted_length"]["medical"] == {"mean_accepted_length": 2.5,
                                                              "mean_accepted_length_ci": [2.2, 2.8],
                                                              "num_draft_tokens": 4, "num_prompts": 8}
    assert meta["domain_mean_accepted_length"]["code"]["num_draft_tokens"] == 4  # the evaluation's primary gamma
