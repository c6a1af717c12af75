"""Bad data named as bad data: a batch's keys, dtypes and dimensions against the first batch's."""

from __future__ import annotations

import torch

from vpipe_lab.runtime.model.data_checks import layout, mismatch

IDS = torch.zeros(8, 16, dtype=torch.long)


def test_the_layout_names_each_leaf_by_its_path() -> None:
    got = layout({"input_ids": IDS, "use_cache": False, "mask": None}, (IDS, IDS))
    assert got == {"inputs['input_ids']": ("int64", (8, 16)), "inputs['use_cache']": ("bool", None),
                   "targets[0]": ("int64", (8, 16)), "targets[1]": ("int64", (8, 16))}
    assert layout(IDS, None) == {"inputs": ("int64", (8, 16))}
    assert layout(IDS, IDS, with_targets=False) == {"inputs": ("int64", (8, 16))}


def test_other_sizes_of_the_same_layout_are_not_bad_data() -> None:
    first = layout({"input_ids": IDS}, IDS)
    assert mismatch(first, layout({"input_ids": IDS[:3, :5]}, IDS[:3, :5])) is None


def test_a_dtype_a_key_or_a_dimension_that_changed_is_named_with_what_came_and_what_was_expected() -> None:
    first = layout({"input_ids": IDS}, IDS)
    assert mismatch(first, layout({"input_ids": IDS.float()}, IDS)) == (
        "inputs['input_ids'] is float32 of shape [8, 16], where the first batch's was int64 of shape [8, 16] (the "
        "model was captured for it): convert it in the data (e.g. .to(torch.int64))")
    assert mismatch(first, layout({"input_ids": IDS}, IDS.float())).startswith(  # type: ignore[union-attr]
        "targets is float32 of shape [8, 16], where the first batch's was int64 of shape [8, 16]: convert")
    missing = mismatch(first, layout({"ids": IDS}, None))
    assert missing is not None and missing.startswith(
        "this batch has no inputs['input_ids'], targets and an unexpected inputs['ids']; the first batch (which the "
        "model was captured from) had inputs['input_ids'], targets")
    flat = mismatch(first, layout({"input_ids": IDS[0]}, IDS))
    assert flat is not None and flat.startswith(
        "inputs['input_ids'] has 1 dimensions [16], where the first batch's had 2 [8, 16]")
    assert mismatch(layout({"x": IDS, "flag": True}), layout({"x": IDS, "flag": IDS})) == (
        "inputs['flag'] is int64 of shape [8, 16], where the first batch's was a bool")


def test_an_evaluation_batch_is_checked_by_its_inputs_alone() -> None:
    first = layout({"input_ids": IDS}, IDS)
    assert mismatch(first, layout({"input_ids": IDS}, with_targets=False), inputs_only=True) is None
    assert mismatch(first, layout({"input_ids": IDS.float()}, with_targets=False), inputs_only=True) is not None
