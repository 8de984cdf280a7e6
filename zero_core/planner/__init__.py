"""The capacity planner and time model: what ZeRO needs, and how long a step takes, on machines never run here.

The simulator measures a few million parameters on threads; the planner answers for billions on real
clusters, in closed form. `time_model` predicts a step's time on a named machine (compute and collectives
on overlapping streams), `configuration_time` does so for the configurations beyond the paper, and
`deepspeed_estimators` is DeepSpeed's own memory arithmetic to set beside the paper's; `models` holds
the shapes of models people train (`--model`), which the step time reads. The `table` and
`plan` commands and the lessons on scale read them.

The planner reads formulas (`zero_core.formulas`, `zero_core.configurations`, the ring model of
`zero_core.ring`) and machine facts (`zero_core.facts`, which reads `zero_core/data/facts.toml`), and never
the simulator: it imports nothing that runs a rank, a collective or a stage, so it loads without torch and
answers the same whatever the simulator does (`tests/test_planner_apart.py` keeps it so). Its modules are
imported by name (`from zero_core.planner import time_model`): this file imports none of them.
"""
