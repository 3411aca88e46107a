"""The online degeneration detector on synthetic incoherent, looping and normal generations."""

from __future__ import annotations

import math
import random

import pytest
import torch

from dynts.rescue import DegenerationDetector, gzip_ratio
from dynts.rescue.sampling import entropy

NORMAL = (
    "Let the two numbers be x and y. We are told that their sum is 24, so x + y = 24, and that their "
    "difference is 6, so x - y = 6. Adding the two equations eliminates y and gives 2x = 30, hence x = 15. "
    "Substituting back into the first equation, 15 + y = 24, so y = 9. To double-check, the difference "
    "15 - 9 is indeed 6 and the sum 15 + 9 is 24, which matches both conditions of the problem. Next we "
    "need the product of the numbers, because the question asks for the area of a rectangle whose sides "
    "are these two numbers. The area is 15 times 9; computing 15 * 9 = 135 square units. Finally, note "
    "that the perimeter would be 2(15 + 9) = 48, which is not asked for but confirms that the side "
    "lengths are positive and consistent. We should also consider whether the problem intends integer "
    "solutions only; since both values are integers, no further case analysis is required here. "
    "Therefore the area of the rectangle is 135, and the final answer is \\boxed{135}."
)
LOOP = "So the answer is 12. Wait, let me check that again. " * 40
VOCAB = 151_936  # Qwen2.5 vocabulary


def prefixes(text: str, n: int) -> list[str]:
    """Text so far after each of ``n`` evenly spread tokens."""
    return [text[: math.ceil(len(text) * (i + 1) / n)] for i in range(n)]


def test_gzip_ratio_direction():
    assert gzip_ratio(LOOP[:800]) < 0.18 < gzip_ratio(NORMAL[:800])
    assert gzip_ratio("") == 1.0


def test_incoherent_text_fires_on_entropy_at_the_guard():
    rng = random.Random(0)
    noise = "".join(rng.choice("!@#$%^&*()[]{}<>?/\\|~`ÿ∑∂ßжфш中文字") for _ in range(300))
    high = entropy(torch.zeros(40, VOCAB)).tolist()  # near-uniform: ln(V) = 11.9 nats
    assert high[0] == pytest.approx(math.log(VOCAB), rel=1e-4)
    assert DegenerationDetector().first_firing(high, prefixes(noise, 40)) == (24, "entropy")  # guard 24


def test_looping_text_fires_on_compression_once_the_window_fills():
    n = 400
    low = [0.3] * n  # loops are confident
    hit = DegenerationDetector().first_firing(low, prefixes(LOOP, n))
    assert hit is not None and hit[1] == "compression"
    position, _ = hit
    assert len(prefixes(LOOP, n)[position - 1]) >= 800 > len(prefixes(LOOP, n)[position - 2])


def test_normal_text_never_fires():
    n = 250
    rng = random.Random(1)
    ents = [rng.uniform(0.2, 3.5) for _ in range(n)]  # coherent decoding: a few nats at most
    assert len(NORMAL) >= 800
    assert DegenerationDetector().first_firing(ents, prefixes(NORMAL, n)) is None


def test_moving_average_not_single_spikes():
    spikes = [1.0] * 30
    spikes[25] = 50.0  # one spike: mean of 12 = (11 + 50) / 12 = 5.1 < 7
    assert DegenerationDetector(compress_threshold=None).first_firing(spikes, [""] * 30) is None
    run = [1.0] * 20 + [9.0] * 12  # mean of the last 12 at position 29: (3 + 81) / 12 = 7.0; at 30: 7.67
    assert DegenerationDetector(compress_threshold=None).first_firing(run, [""] * 32) == (30, "entropy")


def test_thresholds_are_configurable_and_can_be_disabled():
    high = entropy(torch.zeros(40, VOCAB)).tolist()
    assert DegenerationDetector(entropy_threshold=None).first_firing(high, [""] * 40) is None
    assert DegenerationDetector(entropy_threshold=12.0).first_firing(high, [""] * 40) is None
    assert DegenerationDetector(guard=5, entropy_window=5).first_firing(high, [""] * 40) == (5, "entropy")
    loop = prefixes(LOOP, 400)
    assert DegenerationDetector(compress_threshold=None).first_firing([0.3] * 400, loop) is None
    short = DegenerationDetector(compress_window=400, compress_threshold=0.25).first_firing([0.3] * 400, loop)
    assert short is not None and 400 <= len(loop[short[0] - 1]) < 800
    # include_context: committed text counts towards the window, so a short candidate can fire
    screen = DegenerationDetector(include_context=True).screen(context=LOOP)
    assert screen.update(0.3, "So the answer is 12.") == "compression"
    assert DegenerationDetector().screen(context=LOOP).update(0.3, "So the answer is 12.") is None


@pytest.mark.parametrize(
    "bad",
    [dict(entropy_threshold=-1.0), dict(entropy_window=0), dict(guard=-1), dict(compress_threshold=1.5),
     dict(compress_window=4)],
)
def test_bad_settings(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        DegenerationDetector(**bad)
