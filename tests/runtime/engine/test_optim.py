"""The stage's one optimizer: a parameter group per unit, groups and state that leave and arrive with their unit."""

from __future__ import annotations

import torch

from vpipe_lab.runtime.engine.optim import UNIT, StageOptimizer


def decay_split(params):  # type: ignore[no-untyped-def]
    """The usual transformer recipe: no weight decay on biases and norms."""
    params = list(params)
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=1e-3)


def named(module: torch.nn.Module, prefix: str) -> list[tuple[str, torch.nn.Parameter]]:
    return [(f"{prefix}.{n}", p) for n, p in module.named_parameters()]


def test_each_unit_gets_the_factorys_groups_tagged_with_it() -> None:
    a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 2)
    opt = StageOptimizer(decay_split, torch.device("cpu"))
    opt.add_unit(0, named(a, "0"))
    opt.add_unit(1, named(b, "1"))
    assert opt.optimizer is not None and isinstance(opt.optimizer, torch.optim.AdamW)
    groups = [(g[UNIT], g["weight_decay"], len(g["params"])) for g in opt.optimizer.param_groups]
    assert groups == [(0, 0.1, 1), (0, 0.0, 1), (1, 0.1, 1), (1, 0.0, 1)]
    assert opt.unit_groups(1)[0]["params"] == ["1.weight"]


def test_removing_a_unit_drops_its_groups_and_state_and_keeps_a_tie_with_the_next_user() -> None:
    shared = torch.nn.Parameter(torch.randn(4, 4))
    own = torch.nn.Parameter(torch.randn(4))
    opt = StageOptimizer(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), torch.device("cpu"))
    opt.add_unit(0, [("w", shared), ("b", own)])
    opt.add_unit(2, [("w", shared)])  # a tie: already in unit 0's group
    assert len(opt.optimizer.param_groups) == 1  # type: ignore[union-attr]
    for p in (shared, own):
        p.grad = torch.ones_like(p)
    opt.step()
    opt.optimizer.param_groups[0]["lr"] = 0.05  # type: ignore[union-attr]
    before = opt.state(["w"], {"w": shared})["w"]["momentum_buffer"].clone()
    opt.remove_unit(0, stays={"w": 2})
    (group,) = opt.optimizer.param_groups  # type: ignore[union-attr]
    assert group[UNIT] == 2 and group["params"] == [shared] and group["lr"] == 0.05
    assert torch.equal(opt.state(["w"], {"w": shared})["w"]["momentum_buffer"], before)
    assert own not in opt.optimizer.state and not opt.holds(own)  # type: ignore[union-attr]


def test_an_arriving_unit_brings_its_options_and_state_and_steps_like_it_never_moved() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    copy = torch.nn.Linear(3, 2)
    copy.load_state_dict(layer.state_dict())
    here = StageOptimizer(lambda ps: torch.optim.Adam(ps, lr=0.1), torch.device("cpu"))
    here.add_unit(5, named(layer, "5"))
    for _ in range(2):
        layer(torch.ones(4, 3)).sum().backward()
        here.step()
        layer.zero_grad()
    here.optimizer.param_groups[0]["lr"] = 0.02  # type: ignore[union-attr]  # as a scheduler would
    groups = here.unit_groups(5)
    states = here.state(["5.weight", "5.bias"], dict(named(layer, "5")))
    copy.load_state_dict(layer.state_dict())
    there = StageOptimizer(lambda ps: torch.optim.Adam(ps, lr=0.1), torch.device("cpu"))
    there.add_unit(0, named(torch.nn.Linear(2, 2), "0"))  # the new stage holds another unit already
    there.add_unit(5, named(copy, "5"), groups, states)
    assert [g["lr"] for g in there.optimizer.param_groups] == [0.1, 0.02]  # type: ignore[union-attr]
    for module, opt in ((layer, here), (copy, there)):
        module(torch.ones(4, 3)).sum().backward()
        opt.step()
    assert torch.equal(layer.weight, copy.weight) and torch.equal(layer.bias, copy.bias)


def test_load_puts_back_saved_state_and_options() -> None:
    layer = torch.nn.Linear(2, 2)
    opt = StageOptimizer(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), torch.device("cpu"))
    opt.add_unit(0, named(layer, "0"))
    saved = {"0.weight": {"momentum_buffer": torch.full((2, 2), 3.0)}}
    opt.load(saved, [{"options": {"lr": 0.5}, "params": ["0.weight", "0.bias"]}], dict(named(layer, "0")))
    assert opt.optimizer.param_groups[0]["lr"] == 0.5  # type: ignore[union-attr]
    assert torch.equal(opt.optimizer.state[layer.weight]["momentum_buffer"], torch.full((2, 2), 3.0))  # type: ignore[union-attr]


def test_no_factory_or_no_trainable_parameters_means_no_optimizer() -> None:
    opt = StageOptimizer(None, torch.device("cpu"))
    opt.add_unit(0, named(torch.nn.Linear(2, 2), "0"))
    opt.step()
    assert opt.optimizer is None
    other = StageOptimizer(lambda ps: torch.optim.SGD(ps, lr=0.1), torch.device("cpu"))
    other.add_unit(0, [])
    assert other.optimizer is None


def test_the_schedule_continues_when_a_unit_moves_to_another_stage() -> None:
    """StepLR on two stages whose unit 1 moves from the first to the second at step 3: every group's learning rate
    follows the one-optimizer schedule (the moved group carries lr and initial_lr; both schedulers are rebuilt)."""
    def sgd(ps):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(ps, lr=1.0)

    def step_lr(opt):  # type: ignore[no-untyped-def]
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    a, b, c = (torch.nn.Linear(2, 2) for _ in range(3))
    plain = sgd(list(a.parameters()))
    expected = []
    sched = step_lr(plain)
    for _ in range(6):
        expected.append(plain.param_groups[0]["lr"])
        plain.step()
        sched.step()
    first = StageOptimizer(sgd, torch.device("cpu"), step_lr)
    second = StageOptimizer(sgd, torch.device("cpu"), step_lr)
    first.add_unit(0, named(a, "0"))
    first.add_unit(1, named(b, "1"))
    second.add_unit(2, named(c, "2"))
    seen: list[list[float]] = []
    for it in range(6):
        if it == 3:
            groups = first.unit_groups(1)
            first.remove_unit(1, {})
            second.add_unit(1, named(b, "1"), groups)
        for p in (*a.parameters(), *b.parameters(), *c.parameters()):
            p.grad = torch.zeros_like(p)
        lrs = [g["lr"] for o in (first, second) for g in o.optimizer.param_groups]  # type: ignore[union-attr]
        seen.append(lrs)
        first.step(it)
        second.step(it)
    for it, lrs in enumerate(seen[1:], 1):
        assert lrs == [expected[it]] * len(lrs), it
    assert first.lr() == second.lr() == expected[5] * (0.5 if 6 % 2 == 0 else 1.0)
