import torch

from vpipe_lab.runtime.engine.bandwidth import probe_update
from vpipe_lab.runtime.engine.device import Placement

CPU = Placement(torch.device("cpu"), "gloo")


def test_the_update_probe_times_the_users_optimizer_and_a_weight_copy() -> None:
    """The user's factory is stepped on a throwaway parameter (which it moves: the step really ran), and a copy is
    timed; without a factory, or with one that cannot take a bare parameter, only the copy is. (How long they take
    is a benchmark's business, not a test's.)"""
    made: list[torch.optim.Optimizer] = []

    def adam(params: object) -> torch.optim.Optimizer:
        made.append(torch.optim.Adam(params, lr=0.1))  # type: ignore[arg-type]
        return made[-1]

    timed = probe_update(adam, CPU, nbytes=1 << 20)
    assert timed["update_s_per_byte"] > 0 and timed["copy_s_per_byte"] > 0
    (param,) = made[0].param_groups[0]["params"]
    assert made[0].state[param]["step"] == 4 and float(param.detach()[0]) < 0  # one step to build state, three timed
    stage = [torch.zeros(96, 96), torch.zeros(96), torch.zeros(3000, 1000, dtype=torch.float64), torch.zeros(5)]
    probe_update(adam, CPU, like=stage, nbytes=1 << 20)  # the stage's own shapes, until 1 MiB is reached
    assert [(tuple(p.shape), p.dtype) for p in made[1].param_groups[0]["params"]] == [
        ((96, 96), torch.float32), ((96,), torch.float32), ((3000, 1000), torch.float64)]

    def picky(params: object) -> torch.optim.Optimizer:
        raise TypeError("this factory wants the model's named parameters")

    assert probe_update(None, CPU, nbytes=1 << 20)["update_s_per_byte"] == 0.0
    assert probe_update(picky, CPU, nbytes=1 << 20)["update_s_per_byte"] == 0.0
