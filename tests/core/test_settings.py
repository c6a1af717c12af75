"""A job's settings: each field's check names the value, how they combine is refused before anything starts, and the
job file's form round-trips."""

from dataclasses import fields

import pytest

from vpipe_lab.core.settings import SettingError, Settings, engine_refusal


def test_validated_resolves_the_chunks_and_gives_every_stage_its_budget() -> None:
    done = Settings(stages=3, schedule="interleaved-1f1b", microbatches=6, memory_budget=1 << 30).validated()
    assert done.virtual_stages == 2 and done.memory_budget == (1 << 30,) * 3
    assert Settings(schedule="zbv").validated().virtual_stages == 2
    assert Settings().validated().virtual_stages == 1 and Settings().validated().memory_budget is None
    assert Settings(memory_budget=[5, 6]).validated().memory_budget == (5, 6)
    assert done.validated() == done  # validating twice changes nothing
    with pytest.raises(SettingError, match=r"one positive int or 2 of them, got \(1, 2, 3\)"):
        Settings(memory_budget=(1, 2, 3)).validated()


@pytest.mark.parametrize(("changes", "match"), [
    ({"stages": 0}, "stages must be a whole number >= 1, got 0"),
    ({"microbatches": 10**12}, "microbatches must be a whole number from 1 to 16384"),
    ({"schedule": "zigzag"}, "unknown schedule 'zigzag': use one of gpipe, 1f1b"),
    ({"device": "tpu"}, "unknown device 'tpu': use one of auto, cpu, cuda"),
    ({"seed": 1.5}, "seed must be a whole number, got 1.5"),
    ({"memory_budget": True}, "memory_budget must be bytes per stage"),
    ({"clip_grad_norm": -1}, "clip_grad_norm must be a positive number"),
    ({"fused_wgrad": -2}, "fused_wgrad must be True, False or the smallest weight"),
    ({"log": "carrier-pigeon:coop"}, "log='carrier-pigeon:coop': use 'tensorboard:DIR'"),
    ({"timeout": None}, r"timeout=None: give the seconds to wait at most"),
    ({"telemetry": "yes"}, "telemetry must be True or False"),
    ({"auto_replan": "often"}, "auto_replan must be True, False or the options"),
    ({"host": ""}, "host must be a non-empty string"),
    ({"schedule": "zbv", "virtual_stages": 3}, "zbv runs 2 chunks per stage, not virtual_stages=3"),
    ({"schedule": "pipedream", "precision": "fp16"}, "precision='fp16'"),
    ({"max_restarts": 1, "engine": "torch"}, "max_restarts=1 needs engine='lab'"),
    ({"max_restarts": 1, "snapshot_every": 0}, "snapshot_every=0 takes none"),
    ({"snapshot_every": 2}, "snapshot_every=2: snapshots are for restarts"),
    ({"save_every": 2}, "save_every=2 needs run_dir"),
])
def test_a_setting_that_cannot_work_is_named_with_its_value(changes: dict[str, object], match: str) -> None:
    with pytest.raises(SettingError, match=match):
        Settings(**changes).validated()  # type: ignore[arg-type]


def test_the_job_files_form_round_trips_and_leaves_a_function_behind() -> None:
    settings = Settings(memory_budget=(1, 2), auto_replan={"every": 3}, log="wandb:proj").validated()
    assert Settings.from_json(settings.to_json()) == settings
    assert Settings(log=print).to_json()["log"] is None
    assert set(settings.to_json()) == {f.name for f in fields(Settings)}


def test_options_by_name_say_what_was_meant_and_where_a_door_takes_one_instead() -> None:
    assert Settings.of("worker").timeout == 300.0 and Settings.of("api").timeout == 120.0  # a rendezvous waits longer
    with pytest.raises(TypeError, match="unknown setting 'shedule': did you mean 'schedule'"):
        Settings.of("api", shedule="zbv")
    with pytest.raises(TypeError, match="stages is not set here: torchrun's process count"):
        Settings.of("worker", stages=2)


def test_the_torch_engine_says_what_it_cannot_run() -> None:
    assert engine_refusal("lab", 4, "fp16", "zbv") is None
    assert "precision='bf16' needs engine='lab'" in (engine_refusal("torch", 1, "bf16", "1f1b") or "")
    assert "unknown engine 'jax'" in (engine_refusal("jax", 1, "fp32", "1f1b") or "")
