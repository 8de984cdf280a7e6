"""The reference answers of the exercises that plug a piece into a stage: one module per exercise.

`ex03.py` (ZeRO-2's `ReduceScatterLinear`), `ex04.py` (ZeRO-3's `GatherLinear`, `GatherEmbedding`),
`ex06.py` (`GradientBuckets`), `ex07.py` (`Prefetcher`), `ex08.py` (`accumulate_gradient`,
`clip_global_norm`) and `ex09.py` (`hierarchical_all_gather`). Nothing in the library imports them: a
stage names the piece it runs through `zero_core.registry`, which imports it only when the stage runs it.
`ex10.py` (`save_shards`, `consolidate`, `load_into`) is no piece of a step: checkpoints are written and read
between steps, so no stage names it, and the lessons and tests call it directly.
So the grading sandbox leaves this folder's answers out (`autograder.walls`, each exercise's
`ANSWER_MODULES`; an earlier exercise's answer stays where a later one builds on it, as ex06 builds on
ex03's), and the grader trains the stage with the student's piece in their place.

ex01, ex02 and ex05 ask for library code, which stays where the library needs it: ex01's ring all-reduce
and its byte count (what `zero_core.dist` and `zero_core.formulas` do), ex02's ZeRO-1 step (the stage
itself, `zero_core.stages.zero1`), ex05's memory formulas (`zero_core.formulas`). Their grading keeps the
reference from the student all the same: the rules for graded cells, the judge, and the sandbox, which
leaves the modules of `autograder.integrity.REFERENCE_CODE` out.
"""
