"""The course's autograder: checks that catch wrong ZeRO implementations, for nbgrader, pytest and a CLI.

One module per exercise (`ex01` ... `ex05`) lists its checks (`CHECKS`) and exposes them as functions a
notebook's test cell calls (`grader.check_training(ReduceScatterLinear, world_sizes=[2, 4])`). The
checks plug the student's piece into the reference training loop (`harness`), compare it with the
reference run (`verdicts`): losses and fp32 master weights bit for bit, memory from the trackers,
collectives from the ledger, and refuse the reference implementation itself (`integrity`).
`submission` loads a notebook's solution cells, `sandbox` grades a notebook in a child process with
limits, and `cli` is `python -m autograder check NOTEBOOK` and `python -m autograder grade DIR`.

Importing this package is cheap; the exercise modules import torch.
"""
