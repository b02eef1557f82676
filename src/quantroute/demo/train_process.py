"""Training in a child process whose OpenMP threads sleep, rather than spin, while they wait.

torch's CPU kernels run on GNU OpenMP, whose idle threads spin for a while
before they sleep. On a machine whose cores other processes also use, two
spinning threads fight those processes for the cores they are waiting on: a
training step of the BPE demo model measured 1.1 s on 2 idle cores and 3 to
12 s on 2 busy ones, against a steady 2.1 s with ``OMP_WAIT_POLICY=PASSIVE``
(and 1.2 s idle). The policy is read once, when the OpenMP runtime loads, so
it must be in the environment of a process that has not imported torch yet:
this child. It changes how threads wait, not how work is split, so the
trained weights are the same bits as in-process training with the same
thread count.

The parent writes the job (configs as JSON, the token stream as ``.npy``) to
a folder; the child (``python -m quantroute.demo.train_worker``) trains and
writes ``weights.npz`` and ``result.json`` there.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import numpy.typing as npt

from quantroute.demo.model import ModelConfig, TrainConfig, TrainResult, param_shapes

logger = logging.getLogger(__name__)

JOB, STREAM, WEIGHTS, RESULT = "job.json", "stream.npy", "weights.npz", "result.json"
"""The files of a job folder: what the parent writes, then what the child writes."""


def train_in_child(
    model: ModelConfig,
    train: TrainConfig,
    stream: npt.NDArray[np.int32],
    *,
    bos_id: int,
    work_dir: Path,
    progress: bool = True,
) -> tuple[dict[str, npt.NDArray[np.float32]], TrainResult]:
    """:func:`quantroute.demo.model.train` from seeded initial weights, in a child process.

    Returns the float32 weights (GGUF names, in :func:`param_shapes` order) and
    the training result. The child's progress bar and log lines go to this
    process's stderr. Raises ``RuntimeError`` when the child fails.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    job = {
        "model": dataclasses.asdict(model),
        "train": dataclasses.asdict(train),
        "bos_id": bos_id,
        "progress": progress,
        "log_level": logging.getLogger("quantroute.demo").getEffectiveLevel(),
    }
    (work_dir / JOB).write_text(json.dumps(job))
    np.save(work_dir / STREAM, stream)
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    argv = [sys.executable, "-m", "quantroute.demo.train_worker", str(work_dir)]
    done = subprocess.run(argv, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"training failed in its process (exit code {done.returncode})")
    result = TrainResult(**json.loads((work_dir / RESULT).read_text()))
    with np.load(work_dir / WEIGHTS) as archive:
        weights = {name: archive[name] for name in param_shapes(model)}
    return weights, result
