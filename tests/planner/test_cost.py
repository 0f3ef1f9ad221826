"""tp's communication in the step-time model: sequence parallel's reduce-scatter plus all-gather
move an all-reduce's bytes in twice the messages (each with the fixed per-message cost)."""

from __future__ import annotations

import pytest

from meshrun.planner.cost import Efficiency, tensor_parallel_s
from meshrun.planner.stage_profile import StageProfile

STAGE = StageProfile(0, 0, 0, 0, 0.0, 0.0, 0, blocks=3, recomputed_blocks=1, hidden_bytes=8 << 20)


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_moves_the_same_bytes_in_twice_the_messages(tp: int) -> None:
    def seconds(p2p_s: float, sp: bool) -> float:
        return tensor_parallel_s([STAGE], tp, gbs=100.0, eff=Efficiency(p2p_s=p2p_s), sequence_parallel=sp)

    messages = 4 * 3 + 2 * 1
    bytes_s = messages * 2 * (tp - 1) / tp * (8 << 20) / 100e9  # ring all-reduces of the hidden state
    assert seconds(0.0, False) == pytest.approx(bytes_s) and seconds(0.0, True) == pytest.approx(bytes_s)
    assert seconds(1e-3, True) - seconds(1e-3, False) == pytest.approx(messages * 1e-3)
    assert tensor_parallel_s([STAGE], 1, gbs=100.0, eff=Efficiency(), sequence_parallel=True) == 0.0
