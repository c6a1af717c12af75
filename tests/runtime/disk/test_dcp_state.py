"""A stage's state in DCP's keys, against torch's own flattening: a plain optimizer flattened here is what torch's
``get_optimizer_state_dict(flatten_optimizer_state_dict=True)`` gives, and loads back; a flattened key finds its
parameter even when names share a prefix."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from vpipe_lab.runtime.disk import dcp_state


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    for _ in range(2):
        model(torch.ones(5, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_flattening_is_torchs() -> None:
    model, opt = trained()
    ours = dcp_state.flatten_optimizer(dict(model.named_parameters()), opt)
    theirs = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(ours[key], value), key
        else:
            assert ours[key] == value, key


def test_flattened_state_loads_into_a_fresh_optimizer() -> None:
    model, opt = trained()
    flat = dcp_state.flatten_optimizer(dict(model.named_parameters()), opt)
    fresh = torch.optim.AdamW(model.parameters(), lr=0.5)
    dcp_state.load_optimizer(dict(model.named_parameters()), fresh, flat, torch.device("cpu"))
    assert fresh.param_groups[0]["lr"] == 0.01 and fresh.param_groups[0]["betas"] == (0.8, 0.9)
    for p in model.parameters():
        for k, v in opt.state[p].items():
            assert torch.equal(fresh.state[p][k], v)


def test_a_key_finds_the_longest_parameter_name() -> None:
    params = {"h.1.w", "h.1.w.extra", "h.10.w"}
    states, options = dcp_state.split_optimizer({"state.h.1.w.extra.exp_avg": 1, "state.h.1.w.exp_avg": 2,
                                                 "param_groups.h.10.w.lr": 0.1, "state.other.exp_avg": 3}, params)
    assert states == {"h.1.w.extra": {"exp_avg": 1}, "h.1.w": {"exp_avg": 2}} and options == {"h.10.w": {"lr": 0.1}}
    assert dcp_state.model_keys("w", {"w": ["a.w", "b.w"]}, set()) == ["a.w", "b.w"]
    assert dcp_state.model_keys("inv_freq", {}, {"inv_freq"}) == []


class _Payload:
    """What a crafted ``.metadata`` holds: unpickling it would run a command (it writes a file)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        import os

        return (os.system, (f"touch {self.marker}",))


def test_dcp_metadata_is_read_without_running_code(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import pickle

    import pytest
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Linear(3, 2)
    dcp.save({"w": model.state_dict(), "extra": {"step": 3, "name": "x"}}, checkpoint_id=str(tmp_path / "real"))
    metadata = dcp_state.SafeReader(str(tmp_path / "real")).read_metadata()  # torch's own metadata reads
    assert "w.weight" in metadata.state_dict_metadata
    loaded = {"w": torch.nn.Linear(3, 2).state_dict()}
    dcp.load(loaded, storage_reader=dcp_state.SafeReader(str(tmp_path / "real")),
             planner=dcp_state.SafeLoadPlanner(), no_dist=True)
    assert torch.equal(loaded["w"]["weight"], model.weight.detach())
    crafted = tmp_path / "crafted"
    crafted.mkdir()
    marker = tmp_path / "ran"
    (crafted / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(ValueError, match=r"names posix\.system.*never holds.*could run code"):
        dcp_state.SafeReader(str(crafted)).read_metadata()
    assert not marker.exists()
    (crafted / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(ValueError, match=r"holds a dict, not torch\.distributed\.checkpoint metadata"):
        dcp_state.SafeReader(str(crafted)).read_metadata()


def test_a_metadata_that_names_a_file_outside_its_checkpoint_is_refused_before_a_tensor_is_read(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """docs/security.md: DCP joins the names in ``.metadata`` to the folder unchecked; the lab reads only plain names
    of its own folder that the manifest checksums."""
    import dataclasses
    import pickle

    import pytest
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.nn.Linear(3, 2).state_dict()}, checkpoint_id=str(tmp_path / "real"))
    reader = dcp_state.SafeReader(str(tmp_path / "real"), listed={"__0_0.distcp", ".metadata"})
    assert "w.weight" in reader.read_metadata().state_dict_metadata
    with pytest.raises(ValueError, match=r"'__0_0\.distcp', which the checkpoint's manifest does not list"):
        dcp_state.SafeReader(str(tmp_path / "real"), listed={".metadata"}).read_metadata()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "__0_0.distcp").write_bytes((tmp_path / "real" / "__0_0.distcp").read_bytes())
    pristine = dcp_state.SafeReader(str(tmp_path / "real")).read_metadata()
    for name in (str(outside / "__0_0.distcp"), "../outside/__0_0.distcp"):
        metadata = dataclasses.replace(pristine)
        metadata.storage_data = {k: dataclasses.replace(v, relative_path=name) for k, v in pristine.storage_data.items()}
        (tmp_path / "real" / ".metadata").write_bytes(pickle.dumps(metadata))
        for listed in (None, {"__0_0.distcp", ".metadata", name}):
            with pytest.raises(ValueError, match="is not a plain file name inside the checkpoint"):
                dcp_state.SafeReader(str(tmp_path / "real"), listed=listed).read_metadata()
