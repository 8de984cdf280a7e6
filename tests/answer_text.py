"""The exercises' answers as text, to keep them out of the lessons (the reference is for `solutions/` and
after the deadline).

An answer is the code an exercise asks for: the solution regions of `solutions/` and the reference
objects that hold the same code (ex02's collectives in `Zero1`, ex03's `ReduceScatterLinear` and the shard's
reduce-scatter, ex04's `GatherLinear`/`GatherEmbedding` and the shard's gather). A text shows an answer when
two consecutive significant lines of it (whitespace folded; comments, decorators, docstrings, signatures
and short lines such as `return None` left out) follow each other in the text too.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import textwrap
from functools import cache
from pathlib import Path

from zero_core.answers import ex03, ex04, ex06, ex07, ex08, ex09, ex10
from zero_core.stages import sharding, zero1

ROOT = Path(__file__).resolve().parents[1]
MIN_CHARS = 12
SKIPPED_STARTS = ("#", '"""', "'''", "@", "def ", "class ")
"""Comments, docstrings, decorators and signatures: what any code of the same shape shares."""
REFERENCE_ANSWERS = {
    "ex02's collectives (Zero1.sync_gradients)": zero1.Zero1.sync_gradients,
    "ex02's collectives (Zero1.publish_parameters)": zero1.Zero1.publish_parameters,
    "ex03's ReduceScatterLinear": ex03,
    "ex03's reduce-scatter (LayerShard.reduce_scatter_gradients)": sharding.LayerShard.reduce_scatter_gradients,
    "ex03's reduce-scatter (InFlightReduceScatter)": sharding.InFlightReduceScatter,
    "ex04's GatherLinear and GatherEmbedding": ex04,
    "ex04's gather (LayerShard.gather_parameters)": sharding.LayerShard.gather_parameters,
    "ex04's release (LayerShard.release_parameters)": sharding.LayerShard.release_parameters,
    "ex06's GradientBuckets": ex06,
    "ex07's Prefetcher": ex07,
    "ex08's accumulate_gradient and clip_global_norm": ex08,
    "ex09's hierarchical_all_gather": ex09,
    "ex10's save_shards, consolidate and load_into": ex10,
}


def significant_lines(text: str) -> list[str]:
    lines = []
    for line in text.splitlines():
        folded = " ".join(line.split())
        if len(folded) < MIN_CHARS or folded.startswith(SKIPPED_STARTS) or folded.endswith('"""'):
            continue
        lines.append(folded)
    return lines


def without_docstrings(source: str) -> str:
    """`source` with its docstrings blanked out: words about the code are not the code."""
    source = textwrap.dedent(source)
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                for index in range(body[0].lineno - 1, body[0].end_lineno or body[0].lineno):
                    lines[index] = ""
    return "\n".join(lines)


@cache
def answer_pairs() -> dict[tuple[str, str], str]:
    """{(line, next line): the answer they belong to} for every exercise's answer."""
    answers = {
        name: significant_lines(without_docstrings(inspect.getsource(obj))) for name, obj in REFERENCE_ANSWERS.items()
    }
    for notebook in sorted((ROOT / "solutions").rglob("*.ipynb")):
        for cell in json.loads(notebook.read_text())["cells"]:
            source = "".join(cell["source"])
            for block in re.findall(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", source, flags=re.S):
                answers.setdefault(f"{notebook.stem}'s solution", []).extend(significant_lines(block))
    pairs: dict[tuple[str, str], str] = {}
    for name, lines in answers.items():
        for pair in zip(lines, lines[1:], strict=False):
            pairs.setdefault(pair, name)
    return pairs


def answers_shown(text: str) -> list[str]:
    """The answers `text` shows, each with the first two lines that give it away."""
    lines = significant_lines(text)
    found: dict[str, str] = {}
    for pair in zip(lines, lines[1:], strict=False):
        if pair in answer_pairs():
            found.setdefault(answer_pairs()[pair], " / ".join(pair))
    return [f"{name}: {where}" for name, where in found.items()]


def notebook_text(notebook: dict) -> str:
    """A notebook's code and everything its cells printed or returned as text."""
    parts = []
    for cell in notebook["cells"]:
        if cell["cell_type"] != "code":
            continue
        parts.append("".join(cell["source"]))
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                parts.append("".join(output["text"]))
            elif "data" in output and "text/plain" in output["data"]:
                parts.append("".join(output["data"]["text/plain"]))
    return "\n".join(parts)
