"""The course's autograder: checks that catch wrong ZeRO implementations, for nbgrader, pytest and a CLI.

One module per exercise (`ex01` ... `ex10`) lists its checks (`CHECKS`) and exposes them as functions a
notebook's test cell calls (`grader.check_training(ReduceScatterLinear, world_sizes=[2, 4])`). Each
check observes the student's code and judges what it saw (`checks`): observing plugs the student's piece
into the reference training loop (`harness`) and returns the run as data (`records`); judging compares
it with a reference run (`verdicts`): losses, gradients and fp32 master weights within the rounding the
single-device oracle measures (bit-identical where the formulation is the reference's), memory from the
audit of every storage and the kernel's count of the process (`kernel_memory`), collectives from the
ledger, and refuses the reference implementation itself
(`integrity`, and before anything runs the rules for graded cells, `policy`). `submission` loads a
notebook's solution cells; `sandbox` observes in a child process (inside the operating system's walls,
`walls` and `seccomp`, its collectives carried by `witness`) and judges in its parent; `nbgrader_grading`
gives nbgrader the same verdicts; `cli` is `python -m autograder check NOTEBOOK`, `python -m autograder
grade DIR` and `python -m autograder student-release` (`student_release`, with `recorded` references).

Importing this package is cheap; the exercise modules import torch.
"""
