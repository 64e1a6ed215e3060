"""The README's table of config groups lists every option each group has in conf/ (and none it lacks): a preset
added without a README row is a feature users cannot find."""
import re
from pathlib import Path

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
