"""The child process of :func:`quantroute.demo.train_process.train_in_child`.

``python -m quantroute.demo.train_worker JOB_DIR`` trains the model the job
folder describes and writes its weights and result there. Nothing imports this
module; the package does not, so running it with ``-m`` imports it only once.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from quantroute.demo.model import ModelConfig, TrainConfig
from quantroute.demo.train_process import JOB, RESULT, STREAM, WEIGHTS


def main(work_dir: Path) -> None:
    """Train the job in ``work_dir``; write ``weights.npz`` and ``result.json`` beside it."""
    job = json.loads((work_dir / JOB).read_text())
    logging.basicConfig(level=job["log_level"], format="%(asctime)s %(message)s", datefmt="%X")
    from quantroute.demo import model as llama  # torch loads here, under the wait policy

    model = ModelConfig(**job["model"])
    train = TrainConfig(**job["train"])
    stream = np.load(work_dir / STREAM)
    params = llama.init_params(model, train.seed)
    result = llama.train(
        params, model, stream, train, progress=job["progress"], bos_id=job["bos_id"]
    )
    arrays: dict[str, Any] = dict(llama.to_numpy(params))  # (savez's allow_pickle confuses mypy)
    np.savez(work_dir / WEIGHTS, **arrays)
    (work_dir / RESULT).write_text(json.dumps(asdict(result)))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
