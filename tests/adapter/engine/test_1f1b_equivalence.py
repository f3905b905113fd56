"""The declared 1f1b is DeepSpeed's TrainSchedule, instruction for instruction."""

import pytest
from deepspeed.runtime.pipe.schedule import TrainSchedule

from hippie_ds.adapter.stage.instructions import build


def _as_data(steps):
    return [[(type(cmd), dict(cmd.kwargs)) for cmd in step] for step in steps]


@pytest.mark.parametrize("stages", range(1, 9))
def test_1f1b_is_deepspeed_train_schedule(stages):
    for micro_batches in range(1, 33):
        for stage_id in range(stages):
            ours = build("1f1b", micro_batches=micro_batches, stages=stages, stage_id=stage_id)
            ref = TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
            assert ours.num_pipe_buffers() == ref.num_pipe_buffers(), (stages, micro_batches, stage_id)
            assert _as_data(ours.steps()) == _as_data(ref.steps()), (stages, micro_batches, stage_id)
