"""Estimate per mesh vs measured (issue 45): for each mesh, one short Trainer.fit of the demo GPT
(tests/distributed/test_mesh_estimate.py's module: vocabulary-parallel loss over the tensor group,
Ulysses over the sequence group, fp32) on real processes; per rank the parameter bytes it holds
(``strategy.memory_report()``) and the bytes its first forward saves for backward
(``SavedActivations``), beside ``zerotrain-estimate``'s figures (``strategies/memory/mesh.py``).
Prints a Markdown table (rank 0's figures; the test checks every rank).

    python3 bench/mesh_estimate.py            # 1, 2 and 4 processes, one after another
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "distributed"))

from harness import run_ranks  # noqa: E402
from test_mesh_estimate import _expected  # noqa: E402

#: (processes, strategy, data, tensor, sequence)
MESHES = [(1, "single", 1, 1, 1), (2, "ddp", 1, 2, 1), (2, "ddp", 1, 1, 2), (4, "zero1", 2, 2, 1),
          (4, "zero2", 2, 2, 1), (4, "zero3", 2, 2, 1), (4, "zero3", 2, 1, 2)]


def main() -> None:
    print("| processes | strategy | mesh d x s x t | params/rank measured | estimate | activations/rank measured "
          "| estimate |")
    print("|---|---|---|---|---|---|---|")
    for n, strategy, data, tensor, sequence in MESHES:
        with tempfile.TemporaryDirectory() as tmp:
            r = run_ranks("test_mesh_estimate:_fit", n, tmp, timeout=280, strategy=strategy, devices=n,
                          tensor=tensor, sequence=sequence)[0]
        params, act = _expected(data, tensor, sequence, "ddp" if strategy == "single" else strategy)
        print(f"| {n} | {strategy} | {data} x {sequence} x {tensor} | {r['params']:,} B | {params:,} B "
              f"| {r['saved']:,} B | {act:,} B |", flush=True)


if __name__ == "__main__":
    main()
