"""`pdlab plan` keeps the whole ranking in DIR/plan.json (not only the winners that planned.yaml runs), so a
later compare of the validation run (DIR/run) can say what was ranked (tests/test_compare.py reads one)."""

import json

import yaml

from pdlab.commands.plan import main
from test_plan import RECIPE


def test_plan_json_holds_the_whole_ranking(tmp_path, capsys):
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(RECIPE))
    out = tmp_path / "plan"
    assert main(str(tmp_path / "r.yaml"), [], 2, "push", 0, str(out), True) == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads((out / "plan.json").read_text())
    assert saved == printed
    assert [r["candidate"] for r in saved["ranking"]] and len(saved["ranking"]) == 3  # every candidate of 2 devices
    assert saved["recipe"] == "small" and saved["devices"] == 2 and saved["validation"] == []
