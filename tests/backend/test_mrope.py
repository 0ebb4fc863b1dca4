"""M-RoPE positions without a model: an image's tokens take (t, h, w) positions from its grid, text after it
counts on from the largest plus one (the sequence's delta), and a step's positions stay 1-D unless a chunk
covers image tokens."""
from __future__ import annotations

from pathlib import Path

from backend.mrope import StepPositions, mrope_positions
from tests.frontend.test_qwen_vl_placeholders import qwen_vision


def test_mrope_positions(tmp_path: Path) -> None:
    vision = qwen_vision(tmp_path)
    # 2 text tokens, an image of 2×3 merged tokens (grid 4×6 patches), 2 text tokens
    rope = mrope_positions(10, [(2, 6)], [(1, 4, 6)], vision)
    assert rope.prompt.tolist() == [[0, 1, 2, 2, 2, 2, 2, 2, 5, 6],
                                    [0, 1, 2, 2, 2, 3, 3, 3, 5, 6],
                                    [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]]
    assert rope.delta == 7 - 10
    assert rope.flat(0, 2) == [0, 1] and rope.flat(8, 2) == [5, 6] and rope.flat(10, 1) == [7]
    assert rope.flat(1, 3) is None                                      # touches the image
    step = StepPositions()
    step.add(rope, 12, 1)   # a decode: index + delta
    step.add(None, 4, 1)    # a text-only sequence beside it
    assert step.flat == [9, 4] and step.mrope("cpu") is None  # type: ignore[arg-type]
    step.add(rope, 0, 4)    # a prefill chunk over the image's first tokens: 3-D for the whole step
    mrope = step.mrope("cpu")  # type: ignore[arg-type]
    assert mrope is not None and mrope[:, :2].tolist() == [[9, 4]] * 3 and mrope[:, 2:].tolist() == rope.prompt[:, :4].tolist()
