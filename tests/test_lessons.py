"""The lessons run top to bottom without an error or a warning, and every notebook is committed stripped.

Each `lessons/*.ipynb` is executed with nbclient the way a student runs it in JupyterLab (`make lab`): a fresh
kernel, working directory `lessons/`, the repository importable. The kernel is started from the interpreter that
runs pytest, through a temporary kernelspec, so the test needs no user-installed kernel and never picks up
another environment's. Anything a cell writes to stderr fails the lesson, warnings included (the kernel shows
every warning once): graded notebooks lose points for stderr output, and lessons set the example.

Each lesson's run time is printed, recorded as the test property `run_seconds` (in `--junitxml` reports) and
kept in the pytest cache under `lessons/run_seconds` (`python -m pytest --cache-show 'lessons/*'`) unless the
cache plugin is disabled.
"""

from __future__ import annotations

import ast
import json
import os
import re
import sys
import time
from pathlib import Path

import nbformat
import pytest
from answer_text import answers_shown, notebook_text
from lesson_figures import unsourced

from zero_core.facts import Fact, facts

ROOT = Path(__file__).resolve().parent.parent
LESSONS_DIR = ROOT / "lessons"
LESSONS = sorted(LESSONS_DIR.glob("*.ipynb"))
NOTEBOOK_FOLDERS = ("lessons", "solutions", "exercises")
KERNEL_NAME = "python3"
CELL_TIMEOUT_S = 120
CACHE_KEY = "lessons/run_seconds"


def committed_notebooks() -> list[Path]:
    return sorted(
        path
        for folder in NOTEBOOK_FOLDERS
        for path in (ROOT / folder).rglob("*.ipynb")
        if ".ipynb_checkpoints" not in path.parts
    )


@pytest.fixture(scope="session")
def kernel_spec_manager(tmp_path_factory: pytest.TempPathFactory):
    """A kernelspec named python3 that starts `sys.executable -m ipykernel_launcher`, and nothing else."""
    from jupyter_client.kernelspec import KernelSpecManager

    kernels = tmp_path_factory.mktemp("jupyter") / "kernels"
    (kernels / KERNEL_NAME).mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python 3 ({sys.executable})",
        "language": "python",
    }
    (kernels / KERNEL_NAME / "kernel.json").write_text(json.dumps(spec))
    return KernelSpecManager(kernel_dirs=[str(kernels)], ensure_native_kernel=False)


LESSON_TEMPORARY_PREFIXES = ("zero_",)
"""What the lessons name their temporary folders (`tempfile.mkdtemp(prefix="zero_...")`): none may outlast its lesson,
or every run of a lesson leaves one more in a learner's temporary folder."""


def kernel_environment() -> dict[str, str]:
    """The test's environment, with the repository importable and every warning shown once."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "default", "JUPYTER_PLATFORM_DIRS": "1"}


def stderr_outputs(nb: nbformat.NotebookNode) -> list[str]:
    """Every stderr stream (warnings land there) and error output, as 'cell N: text'."""
    found = []
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            if output.output_type == "stream" and output.name == "stderr":
                found.append(f"cell {index} wrote to stderr:\n{output.text}")
            elif output.output_type == "error":
                found.append(f"cell {index} raised {output.ename}: {output.evalue}")
    return found


@pytest.mark.slow
@pytest.mark.parametrize("path", LESSONS, ids=[p.stem for p in LESSONS])
def test_lesson_runs_top_to_bottom_without_errors_or_stderr(
    path: Path, kernel_spec_manager, record_property, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    kernel = KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=kernel_spec_manager)
    client = NotebookClient(nb, km=kernel, timeout=CELL_TIMEOUT_S, resources={"metadata": {"path": str(LESSONS_DIR)}})
    started = time.perf_counter()
    try:
        client.execute(env={**kernel_environment(), "TMPDIR": str(tmp_path)})
    finally:  # nbclient leaves a kernel it was handed running: ten lessons would keep ten kernels (~5 GB) alive
        if kernel.has_kernel:
            kernel.shutdown_kernel(now=True)
    seconds = time.perf_counter() - started

    record_property("run_seconds", round(seconds, 1))
    cache = getattr(request.config, "cache", None)
    if cache is not None:
        cache.set(CACHE_KEY, {**cache.get(CACHE_KEY, {}), path.stem: round(seconds, 1)})
    print(f"{path.name}: {seconds:.1f} s")
    problems = stderr_outputs(nb)
    assert not problems, f"{path.name} must run warning-free:\n" + "\n".join(problems)
    left = sorted(entry.name for entry in tmp_path.iterdir() if entry.name.startswith(LESSON_TEMPORARY_PREFIXES))
    assert not left, f"{path.name} left its temporary folders behind (remove what a lesson writes): {left}"
    shown = answers_shown(notebook_text(nb))
    assert not shown, f"{path.name} shows an exercise's answer (show behaviour, not the code):\n" + "\n".join(shown)
    figures = unsourced(nb.cells, lesson_facts(path))
    assert not figures, (
        f"{path.name} writes figures with no source: compute them in the lesson, or add them to "
        "zero_core/data/facts.toml with their source and read them with fact(name):\n" + "\n".join(figures)
    )


def lesson_facts(path: Path) -> list[Fact]:
    """The facts the facts file says this lesson uses."""
    return [f for f in facts().values() if any(place.startswith(f"lessons/{path.name}") for place in f.used_in)]


def test_the_figure_check_fails_a_figure_from_nowhere_and_passes_one_with_a_source() -> None:
    """A figure typed into prose or code with no source fails; printed, or a fact's, it passes; a fact's
    figure written differently fails; an unverified fact shown without saying so fails."""
    from zero_core.facts import fact

    def cell(kind: str, text: str, printed: str = "") -> dict:
        outputs = [{"output_type": "stream", "name": "stdout", "text": printed}] if printed else []
        return {"cell_type": kind, "source": text, "outputs": outputs}

    nvlink = fact("nvlink4_unidirectional_spec")
    assert unsourced([cell("markdown", "NVLink 3 carries 600 GB/s.")], [])
    assert not unsourced([cell("markdown", "about 600 GB/s"), cell("code", "print(x)", "600.2 GB/s")], [])
    assert unsourced([cell("code", "memory = 80 * GB", "80 GB")], [])
    assert unsourced([cell("code", 'link = parse_bandwidth("50GB/s")')], [])
    ring = fact("h200_all_reduce_busbw_16GiB_ring")
    assert not unsourced([cell("markdown", "B = 450 GB/s, 82% of it")], [nvlink, ring])
    assert unsourced([cell("markdown", "B = 460 GB/s")], [nvlink])
    assert not unsourced([cell("markdown", "14-23% low"), cell("code", "", "-14.2% and -22.8%")], [])
    assert unsourced([cell("markdown", "14-23% low"), cell("code", "", "-22.8%")], [])
    paper = Fact("paper_tflops", 38, "TFLOP/s", {"url": "u", "section": "§10"}, (), unverified="not opened here")
    assert unsourced([cell("markdown", "38 TFLOP/s per GPU")], [paper])
    assert not unsourced([cell("markdown", "38 TFLOP/s per GPU (unverified here)")], [paper])


def test_the_answer_check_sees_a_printed_reference_function_and_a_solution_cell() -> None:
    """The check above can fail: a lesson that prints GatherLinear's source, or pastes ex02's solution."""
    import inspect

    from zero_core.answers.ex04 import GatherLinear

    printed = {"cells": [{"cell_type": "code", "source": "print(inspect.getsource(GatherLinear))",
                          "outputs": [{"output_type": "stream", "text": inspect.getsource(GatherLinear)}]}]}
    found = [s.split(":")[0] for s in answers_shown(notebook_text(printed))]
    assert "ex04's GatherLinear and GatherEmbedding" in found
    ex02 = ROOT / "solutions" / "ex02_zero1_sharded_adam" / "ex02_zero1_sharded_adam.ipynb"
    solution = json.loads(ex02.read_text())
    body = next("".join(c["source"]) for c in solution["cells"] if "### BEGIN SOLUTION" in "".join(c["source"]))
    assert answers_shown(body.replace("### BEGIN SOLUTION", "").replace("### END SOLUTION", ""))
    assert answers_shown("print(inspect.getsource(GatherEmbedding))") == []


def test_there_are_lessons_numbered_from_00_without_gaps() -> None:
    assert LESSONS, "no notebooks in lessons/"
    names = [p.name for p in LESSONS]
    for name in names:
        assert re.fullmatch(r"\d\d_[a-z0-9_]+\.ipynb", name), f"{name}: name lessons NN_topic.ipynb"
    assert [int(name[:2]) for name in names] == list(range(len(names))), f"lesson numbers have gaps: {names}"


@pytest.mark.parametrize("path", LESSONS, ids=[p.stem for p in LESSONS])
def test_lesson_has_goals_inline_plots_folded_answers_and_a_summary(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    assert nb.metadata.get("kernelspec", {}).get("name") == KERNEL_NAME, f"{path.name}: kernel must be {KERNEL_NAME}"
    markdown = "\n".join(cell.source for cell in nb.cells if cell.cell_type == "markdown")
    code = [cell.source for cell in nb.cells if cell.cell_type == "code"]
    assert nb.cells[0].cell_type == "markdown" and "Learning goals" in nb.cells[0].source, (
        f"{path.name}: the first cell states the learning goals"
    )
    assert code and code[0].startswith("%matplotlib inline"), f"{path.name}: the first code cell sets inline plots"
    assert "## Check your understanding" in markdown, f"{path.name}: needs a 'Check your understanding' section"
    assert "<details><summary>Answer</summary>" in markdown, f"{path.name}: answers are folded in <details>"
    assert "## Summary" in markdown, f"{path.name}: needs a summary"


@pytest.mark.parametrize("path", LESSONS, ids=[p.stem for p in LESSONS])
def test_lesson_asks_for_a_prediction_that_the_next_cell_measures(path: Path) -> None:
    """A '**Predict before you run.**' question, the code cell that measures it, then its answer in a fold."""
    cells = nbformat.read(path, as_version=4).cells
    blocks = [
        index
        for index, cell in enumerate(cells[:-2])
        if cell.cell_type == "markdown" and "**Predict before you run.**" in cell.source
        and cells[index + 1].cell_type == "code"
        and cells[index + 2].cell_type == "markdown" and "<details><summary>Answer</summary>" in cells[index + 2].source
    ]
    assert blocks, (
        f"{path.name}: ask one question as '**Predict before you run.**', then the code cell that measures it, "
        "then a markdown cell with its answer in <details><summary>Answer</summary>"
    )


@pytest.mark.parametrize("path", LESSONS, ids=[p.stem for p in LESSONS])
def test_every_question_has_its_own_answer_fold(path: Path) -> None:
    cells = nbformat.read(path, as_version=4).cells
    markdown = "\n".join(cell.source for cell in cells if cell.cell_type == "markdown")
    section = markdown.split("## Check your understanding", 1)[1].split("## Summary", 1)[0]
    questions = re.split(r"^\*\*\d+\.\*\*", section, flags=re.M)[1:]
    assert questions, f"{path.name}: number the questions **1.**, **2.**, ..."
    for number, question in enumerate(questions, 1):
        folds = question.count("<details><summary>Answer</summary>")
        assert folds == 1, f"{path.name}: question {number} has {folds} answer folds; give each question its own"


@pytest.mark.parametrize("path", committed_notebooks(), ids=[str(p.relative_to(ROOT)) for p in committed_notebooks()])
def test_notebook_is_committed_with_outputs_stripped(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    dirty = [
        index
        for index, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and (cell.get("outputs") or cell.get("execution_count") is not None)
    ]
    assert not dirty, (
        f"{path.relative_to(ROOT)}: cells {dirty} have outputs or execution counts; "
        "clear them before committing (JupyterLab: Edit > Clear Outputs of All Cells, then save)"
    )


def test_lesson_5s_calculator_starts_on_the_values_of_the_table_above_it() -> None:
    """Its widgets' first values are the static answer's arguments exactly, one widget per argument (a log slider
    would snap 7.5B to 7.94B, and the first answer would contradict the one printed above it)."""
    cells = json.loads((LESSONS_DIR / "05_at_scale.ipynb").read_text())["cells"]
    calls = [
        node
        for cell in cells
        if cell["cell_type"] == "code"
        for node in ast.walk(ast.parse("".join(cell["source"]).replace("%matplotlib inline", "")))
        if isinstance(node, ast.Call)
    ]
    calculator = next(c for c in calls if getattr(c.func, "attr", "") == "interact")
    function = calculator.args[0].id
    static = next(c for c in calls if getattr(c.func, "id", "") == function)
    sliders = {k.arg: k.value for k in calculator.keywords}
    assert sorted(sliders) == sorted(k.arg for k in static.keywords), f"{function}: one widget per argument"
    for argument in static.keywords:
        slider = sliders[argument.arg]
        exact = ("SelectionSlider", "FloatSlider", "Dropdown")
        assert slider.func.attr in exact, f"{argument.arg}: {slider.func.attr} snaps"
        start = next(k.value for k in slider.keywords if k.arg == "value")
        assert ast.literal_eval(start) == ast.literal_eval(argument.value), argument.arg
