"""The README's table of config groups lists every option each group has in conf/ (and none it lacks), and the docs
name every algorithm and env: a preset added without its row is a feature users cannot find."""
import re
from pathlib import Path

from metric_docs import undocumented_metrics

REPO = Path(__file__).resolve().parents[1]


def _table() -> dict[str, set[str]]:
    rows = {}
    for line in (REPO / "README.md").read_text().splitlines():
        m = re.match(r"^\| `(\w+)` \| ((?:`[\w.-]+`(?:, )?)+) \|", line)
        if m and (REPO / "conf" / m.group(1)).is_dir():
            rows[m.group(1)] = set(re.findall(r"`([\w.-]+)`", m.group(2)))
    return rows


def test_readme_lists_every_option_of_every_group():
    rows = _table()
    assert {"env", "algo", "model", "experiment", "rollout", "trainer", "logger", "debug"} <= set(rows)
    for group, listed in rows.items():
        have = {p.stem for p in (REPO / "conf" / group).glob("*.yaml")}
        assert listed == have, f"README's `{group}` row: missing {sorted(have - listed)}, not in conf/ {sorted(listed - have)}"


def test_docs_name_every_algorithm_and_env():
    """docs/algorithms.md says how to run every `algo` preset and docs/envs/README.md lists every env."""
    algos = (REPO / "docs/algorithms.md").read_text()
    envs = (REPO / "docs/envs/README.md").read_text()
    missing = [p.stem for p in (REPO / "conf/algo").glob("*.yaml") if not re.search(rf"algo={p.stem}\b", algos)]
    missing += [p.stem for p in (REPO / "conf/env").glob("*.yaml") if f"`{p.stem}`" not in envs]
    assert not missing, f"not in docs/algorithms.md or docs/envs/README.md: {missing}"


def test_every_metric_read_by_a_test_has_its_family_documented():
    """conftest's ``read_metrics`` refuses a metrics.csv with a family docs/metrics.md lacks; the families the trainer
    logs outside training runs' CSVs (eval.py's summary, scheduled weights, the adaptive balance's scale) are
    documented too."""
    assert undocumented_metrics(["eval/success", "weight/echo", "forecast/scale", "rwml/reward", "epoch"]) == []
    assert undocumented_metrics(["rollout/success", "toy/metric"]) == ["toy/metric"]
