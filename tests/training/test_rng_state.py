import random

import numpy as np
import torch

from megacoat.training.rng_state import get_rng_state, set_rng_state


def test_rng_states_round_trip():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    state = get_rng_state()
    first = (random.random(), np.random.rand(), torch.rand(3))
    set_rng_state(state)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert first[0] == again[0] and first[1] == again[1] and torch.equal(first[2], again[2])
