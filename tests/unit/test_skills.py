"""Skills: validation by the specification's reference library (errors naming file and rule), progressive
disclosure (names and descriptions in the prompt block, bodies and references on request), and git
sources pinned to a commit (a later change in the repository does not change what a pinned source gives)."""

import pytest
from dulwich import porcelain

from sobrio.agents.skills import SkillError, load_skills, pin
from sobrio.cli import main


def write_skill(root, folder: str, front: str, body: str = "Do the thing step by step.", refs=None):
    path = root / folder
    path.mkdir(parents=True, exist_ok=True)
    (path / "SKILL.md").write_text(f"---\n{front}\n---\n{body}\n")
    for name, text in (refs or {}).items():
        (path / "references").mkdir(exist_ok=True)
        (path / "references" / name).write_text(text)
    return path


def good(root):
    write_skill(root, "unit-conversion", "name: unit-conversion\ndescription: Convert between metric and imperial "
                "units; use for any question with a unit.\nlicense: Apache-2.0\nmetadata:\n  version: '2'",
                "1 mile = 1.609 km. Show the factor, then the result.", {"table.md": "| mi | km |\n| 1 | 1.609 |"})
    write_skill(root, "arithmetic", "name: arithmetic\ndescription: Work out sums and products exactly.",
                "Compute digit by digit; never round.")


def test_a_folder_of_valid_skills_and_progressive_disclosure(tmp_path):
    good(tmp_path)
    skills = load_skills(str(tmp_path))
    assert sorted(s.name for s in skills) == ["arithmetic", "unit-conversion"]
    block = skills.prompt_block()
    assert "Convert between metric" in block and "unit-conversion" in block
    assert "1.609" not in block and "digit by digit" not in block  # bodies only on load_skill
    skill = skills["unit-conversion"]
    assert "1 mile = 1.609 km" in skill.body() and skill.references() == ["table.md"]
    assert "1.609" in skill.read_reference("table.md")
    with pytest.raises(SkillError, match="no reference"):
        skill.read_reference("../arithmetic/SKILL.md")
    assert load_skills(str(tmp_path / "arithmetic")).skills.keys() == {"arithmetic"}  # one skill's folder


@pytest.mark.parametrize("folder, front, rule", [
    ("Bad-Name", "name: Bad-Name\ndescription: x", "must be lowercase"),
    ("no-description", "name: no-description", "description"),
    ("other-folder", "name: not-the-folder\ndescription: x", "must match skill name"),
    ("long-description", "name: long-description\ndescription: " + "d" * 1025, "1024 character limit"),
    ("extra-field", "name: extra-field\ndescription: x\nversion: 3", "Unexpected fields"),
])
def test_invalid_skills_give_the_reference_librarys_errors_with_their_file(tmp_path, folder, front, rule):
    good(tmp_path)
    write_skill(tmp_path, folder, front)
    with pytest.raises(SkillError) as exc:
        load_skills(str(tmp_path))
    assert any(e.startswith(f"{folder}/SKILL.md: ") and rule in e for e in exc.value.errors), exc.value.errors


def commit_all(repo_path, message: str) -> str:
    porcelain.add(str(repo_path), paths=[str(p) for p in repo_path.rglob("*") if p.is_file() and ".git" not in p.parts])
    return porcelain.commit(str(repo_path), message=message.encode(), author=b"t <t@t>", committer=b"t <t@t>").decode()


def test_a_git_source_is_read_at_its_revision_and_pinning_freezes_it(tmp_path):
    repo = tmp_path / "skills-repo"
    porcelain.init(str(repo))
    good(repo / "team")
    first = commit_all(repo, "first")
    pinned = pin(f"{repo}@HEAD:team")
    assert pinned == f"{repo}@{first}:team"
    write_skill(repo / "team", "arithmetic", "name: arithmetic\ndescription: Work out sums and products exactly.",
                "Round to two decimals.")
    second = commit_all(repo, "second")
    assert "digit by digit" in load_skills(pinned)["arithmetic"].body()  # the pinned revision's text
    latest = load_skills(f"{repo}@HEAD:team")
    assert latest.revision == second and "two decimals" in latest["arithmetic"].body()
    assert load_skills(f"{repo}@{first[:10]}:team").revision == first  # an abbreviated id
    with pytest.raises(SkillError, match="no revision"):
        load_skills(f"{repo}@no-such-branch:team")
    with pytest.raises(SkillError, match="no path"):
        load_skills(f"{repo}@HEAD:elsewhere")


def test_the_cli_lists_validates_shows_and_pins(tmp_path, capsys):
    good(tmp_path / "ok")
    assert main(["skills", "validate", str(tmp_path / "ok")]) == 0
    assert main(["skills", "list", str(tmp_path / "ok")]) == 0
    assert "unit-conversion\tConvert" in capsys.readouterr().out
    assert main(["skills", "show", str(tmp_path / "ok"), "unit-conversion", "--reference", "table.md"]) == 0
    assert "1.609" in capsys.readouterr().out
    write_skill(tmp_path / "bad", "Upper", "name: Upper\ndescription: x")
    assert main(["skills", "validate", str(tmp_path / "bad")]) == 1
    assert "Upper/SKILL.md: Skill name 'Upper' must be lowercase" in capsys.readouterr().err
    assert main(["skills", "list", str(tmp_path / "nowhere")]) == 1  # a one-line error, no traceback
