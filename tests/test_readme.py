"""The README stays a short front door whose paths work, and every link in it and in docs/ resolves.

The README is read as a user reads it: under 180 lines, its table of contents pointing at its own headings,
each relative link (README.md and docs/*.md) at a file that exists and, with a `#anchor`, at a heading of
that file. Each role's path is checked against the code: the set-up and instructor commands are `make`
targets, the learner's `python -m autograder check` parses as that command on a notebook that exists, and
the planner's `python -m zero_core` commands run (formulas only, milliseconds) and print what the README
quotes. The learner's and instructor's blocks also run as written, slowly, in test_readme_instructor.py.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from readme_text import section, shell_commands

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_LINES = 180

FENCED = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6}) +(.+?) *$", re.MULTILINE)


def prose(text: str) -> str:
    """The text outside fenced code blocks, inline code replaced by a placeholder (links keep their text)."""
    return INLINE_CODE.sub("code", FENCED.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(title) for _, title in HEADING.findall(FENCED.sub("", path.read_text()))}


def links(path: Path) -> list[str]:
    return LINK.findall(prose(path.read_text()))


def make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), re.MULTILINE))


def test_the_readme_is_short() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) < MAX_LINES, f"README.md has {len(lines)} lines: move the detail to docs/"


def test_the_table_of_contents_lists_every_section_and_points_at_headings() -> None:
    contents = section("## Contents")
    targets = re.findall(r"\]\(#([^)]+)\)", contents)
    assert targets, "the Contents section links to no heading"
    own = anchors(README)
    assert [t for t in targets if t not in own] == []
    sections = [slug(title) for level, title in HEADING.findall(FENCED.sub("", README.read_text())) if level == "##"]
    assert [s for s in sections if s != "contents" and s not in targets] == [], "a section missing from Contents"


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_at_a_file_and_heading_that_exist(path: Path) -> None:
    broken = []
    for target in links(path):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no such heading")
    assert broken == [], f"{path.relative_to(ROOT)}: {broken}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_each_doc_says_what_it_covers_links_back_and_is_linked_from_the_readme(path: Path) -> None:
    lines = path.read_text().splitlines()
    assert lines[0].startswith("# "), "a doc starts with its title"
    opening = " ".join(lines[1:5])
    assert "](../README.md)" in opening, "its opening lines say what it covers and link back to the README"
    assert f"docs/{path.name}" in links(README), f"the README links to docs/{path.name}"


def test_the_set_up_and_instructor_commands_are_make_targets() -> None:
    targets = make_targets()
    setup = shell_commands("## Set up")
    assert setup == ["make demo", "make test"]
    commands = setup + shell_commands("### Instructors")
    for command in commands:
        assert re.fullmatch(r"make [\w-]+", command) and command.split()[1] in targets, command
    assert "PIP_OPTIONS ?=" in (ROOT / "Makefile").read_text()  # the CPU-build command's variable


def test_the_learner_path_is_the_lab_then_the_autograder_check_on_a_real_notebook() -> None:
    from autograder.cli import BELOW_FULL_MARKS, CANNOT_GRADE, FULL_MARKS, build_parser, main

    text = " ".join(section("### Self-study").split())
    assert "`make lab` first copies `lessons/` and `exercises/` into `work/`" in text and "lab" in make_targets()
    assert "its terminals (File › New › Terminal) run the course's Python" in text  # tests/test_browser.py: PATH
    (check,) = shell_commands("### Self-study")
    python, *argv = shlex.split(check)
    assert python == "python" and argv[:3] == ["-m", "autograder", "check"]
    args = build_parser().parse_args(argv[2:])
    assert re.fullmatch(r"work/exercises/(ex\d\d_\w+)/\1\.ipynb", args.notebook), "the learner's copy (make lab)"
    assert args.command == "check" and (ROOT / args.notebook.removeprefix("work/")).is_file()
    said = f"exits with {FULL_MARKS} for full marks, {BELOW_FULL_MARKS} when points are lost, {CANNOT_GRADE} when"
    assert said in text
    assert main(["check", "exercises/no_such_notebook.ipynb"]) == CANNOT_GRADE  # cheap: nothing is graded


def test_the_planner_commands_run_and_print_what_the_readme_says(tmp_path: Path, capsys) -> None:
    from zero_core.cli import main

    answers = []
    for number, command in enumerate(shell_commands("### Planning a run")):
        python, flag, module, *argv = shlex.split(command)
        assert (python, flag, module) == ("python", "-m", "zero_core"), command
        json_path = tmp_path / f"{number}.json"
        assert main([*argv, "--json", str(json_path)]) == 0, command
        answers.append((argv[0], capsys.readouterr().out, json.loads(json_path.read_text())))
    assert [kind for kind, _, _ in answers] == ["table", "plan", "plan"]
    text = " ".join(section("### Planning a run").split())

    _, table_out, _ = answers[0]
    for figure in re.search(r"model states per GPU \(([^)]*) GB here", text).group(1).replace(" and", ",").split(", "):
        assert f"{figure} GB" in table_out, figure
    _, _, plan = answers[1]
    smallest = {s["stage"]: s["smallest_n_gpus"] for s in plan["stages"]}
    quoted = dict(re.findall(r"ZeRO-(\d) from (\d+)", text))
    assert {int(stage): int(n) for stage, n in quoted.items()} == {k: v for k, v in smallest.items() if v}
    assert smallest[0] is None and "ZeRO-0 never" in text
    _, _, ranked = answers[2]
    assert ranked["ranked"], "plan with --nodes and --machine ranks the configurations"


REPO_FOLDERS = ("zero_core", "lessons", "exercises", "solutions", "autograder", "tests", "benchmarks", "docs", ".ci")


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_lesson_and_exercise_named_in_code_exists(path: Path) -> None:
    """`zero_core/memory.py`, `lessons/00_virtual_cluster.ipynb`, a lesson `09_time_and_overlap` or an
    exercise `ex05_memory_planning`, named in inline code, is in the repository: renames show up here."""
    missing = []
    for token in set(re.findall(r"`([^`\s]+)`", path.read_text())):
        copy = token.removeprefix("work/")  # a learner's copy (make lab) of a tracked lesson or exercise
        if re.fullmatch(r"[\w.-]+(/[\w.-]+)*/?", copy) and copy.split("/")[0] in REPO_FOLDERS:
            found = (ROOT / copy).exists()
        elif re.fullmatch(r"\d\d_[a-z0-9_]+", token):
            found = (ROOT / "lessons" / f"{token}.ipynb").exists()
        elif re.fullmatch(r"ex\d\d_[a-z0-9_]+", token):
            found = (ROOT / "exercises" / token).is_dir()
        else:
            continue
        if not found:
            missing.append(token)
    assert sorted(missing) == [], f"{path.relative_to(ROOT)} names what the repository does not have"


def test_the_lesson_and_exercise_tables_list_every_one() -> None:
    course = (ROOT / "docs" / "course.md").read_text()
    listed = re.findall(r"^\| `(\w+)` \|", course, re.MULTILINE)
    lessons = sorted(p.stem for p in (ROOT / "lessons").glob("*.ipynb"))
    exercises = sorted(p.name for p in (ROOT / "exercises").glob("ex*") if p.is_dir())
    assert [name for name in listed if not name.startswith("ex")] == lessons, "docs/course.md's lesson table"
    assert [name for name in listed if name.startswith("ex")] == exercises, "docs/course.md's exercise table"
