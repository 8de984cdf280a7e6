"""nbgrader's configuration for this course; run nbgrader from the repository root.

    nbgrader generate_assignment ex03_zero2_reduce_scatter_backward --force   # solutions/ -> exercises/
    nbgrader autograde ex03_zero2_reduce_scatter_backward                     # out/submitted/ -> out/autograded/
    nbgrader generate_feedback ex03_zero2_reduce_scatter_backward             # -> out/feedback/

The source notebooks (solutions and hidden tests) live in `solutions/<assignment>/`, the release
notebooks students get in `exercises/<assignment>/` (committed; tests/test_exercises_in_sync.py checks
they are what generate_assignment makes). Collected, autograded and feedback notebooks go under `out/`,
and the gradebook is `gradebook.db` beside this file: both are git-ignored, as they hold students' work.
"""

from pathlib import Path

from nbconvert.preprocessors import ClearMetadataPreprocessor
from nbgrader.preprocessors import (
    AssignLatePenalties,
    CheckCellMetadata,
    ClearOutput,
    DeduplicateIds,
    IgnorePattern,
    LimitOutput,
    OverwriteKernelspec,
    SaveAutoGrades,
)

c = get_config()  # noqa: F821 (nbgrader provides get_config when it loads this file)

c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "exercises"
c.CourseDirectory.submitted_directory = "out/submitted"
c.CourseDirectory.autograded_directory = "out/autograded"
c.CourseDirectory.feedback_directory = "out/feedback"
c.CourseDirectory.db_url = f"sqlite:///{Path(__file__).resolve().parent / 'gradebook.db'}"

# A test cell trains the tiny GPT on up to 7 virtual ranks: seconds, far above nbgrader's default 30 s
# on a loaded machine.
c.Execute.timeout = 300

# Autograde decides each test cell's outcome with the course's grader (student code in a child process,
# verdicts in nbgrader's own), instead of running the test cells in the kernel the student's code ran in:
# `TrustedGrade` takes the place of nbgrader's `Execute`; the rest of the pipeline is nbgrader's default.
# The course's preprocessors are named, not imported: nbgrader imports them when it converts, so the commands
# that do not grade (generate_assignment, generate_feedback) never import torch (2.7 s instead of 4.7 s here).
# A correct notebook is graded in seconds; a looping one costs at most these (not nbgrader's 300 s a cell): wall-clock
# seconds for the child, CPU seconds for one check.
c.TrustedGrade.time_limit_s = 120
c.TrustedGrade.check_time_limit_s = 30
c.Autograde.autograde_preprocessors = [
    "autograder.nbgrader_grading.TrustedGrade",
    IgnorePattern,
    ClearMetadataPreprocessor,
    LimitOutput,
    SaveAutoGrades,
    AssignLatePenalties,
    CheckCellMetadata,
]

# A test cell handed back exactly as released differs from its source only by the hidden tests that
# generate_assignment stripped; nbgrader warns about its checksum all the same (jupyter/nbgrader#1961).
c.Autograde.sanitize_preprocessors = [
    ClearOutput,
    DeduplicateIds,
    OverwriteKernelspec,
    "autograder.nbgrader_grading.OverwriteCellsKnowingHiddenTests",
    CheckCellMetadata,
]
