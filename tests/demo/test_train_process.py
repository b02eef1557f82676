"""Training in a child process gives the very weights in-process training gives."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from quantroute.demo import VOCAB, ModelConfig, TrainConfig
from quantroute.demo.train_process import train_in_child

torch = pytest.importorskip("torch")

CONFIG = ModelConfig(n_embd=32, n_layer=1, n_head=4, n_head_kv=2, n_ff=64)
TRAIN = TrainConfig(steps=3, batch_size=2, seq_len=16, warmup_steps=1, val_batches=1, seed=5)
STREAM = VOCAB.encode_array("def f(x):\n    return x + 1\n" * 100, add_eos=True)


def test_the_child_trains_the_same_bits_as_this_process(tmp_path: Path) -> None:
    from quantroute.demo.model import init_params, param_shapes, to_numpy, train

    params = init_params(CONFIG, TRAIN.seed)
    here = train(params, CONFIG, STREAM, TRAIN, progress=False)
    expected = to_numpy(params)

    weights, result = train_in_child(
        CONFIG, TRAIN, STREAM, bos_id=1, work_dir=tmp_path / "job", progress=False
    )
    assert list(weights) == list(param_shapes(CONFIG))
    for name, array in expected.items():
        assert weights[name].dtype == np.float32
        assert np.array_equal(weights[name], array), name
    assert (result.steps_run, result.train_loss, result.val_loss) == (
        here.steps_run,
        here.train_loss,
        here.val_loss,
    )
    assert result.tokens_seen == 3 * 2 * 16


def test_a_failure_in_the_child_is_raised(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="exit code 1"):
        train_in_child(CONFIG, TRAIN, STREAM[:10], bos_id=1, work_dir=tmp_path, progress=False)
