"""eos_token_id: None takes the target's generation config; ids in any integer form; text, floats and negative ids
are refused with a message naming the fix."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from decode.common import default_eos, normalize_eos
from tinymodels import tiny_llama


@pytest.mark.parametrize("value,ids", [(None, []), (2, [2]), ([2, 3], [2, 3]), ((4,), [4]), (torch.tensor([5, 6]), [5, 6]),
                                       (np.int64(7), [7]), ([np.int32(1)], [1]), ([], [])])
def test_integer_ids_in_any_form(value, ids):
    assert normalize_eos(value) == ids


@pytest.mark.parametrize("value,match", [("61", "not text"), ("<|im_end|>", "convert_tokens_to_ids"),
                                         (1.5, "None, an int"), (torch.tensor([61.7]), "integer token ids"),
                                         (-1, "non-negative"), ([2, -3], "non-negative"), (True, "None, an int")])
def test_odd_values_are_refused(value, match):
    with pytest.raises(ValueError, match=match):
        normalize_eos(value)


def test_the_default_is_the_generation_config_then_the_config():
    m = tiny_llama(eos_token_id=5)
    m.generation_config.eos_token_id = [7, 8]
    assert default_eos(m) == [7, 8]
    m.generation_config.eos_token_id = None
    assert default_eos(m) == 5
