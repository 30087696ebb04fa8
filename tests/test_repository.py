"""The README's promises about the repository hold: CI runs its test command verbatim."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(.+?)\n```", readme)
    assert len(commands) >= 2, "the quick start has two commands"
    test_command = commands[1]
    assert "pytest" in test_command
    assert test_command in (ROOT / ".ci" / "run").read_text().splitlines()
