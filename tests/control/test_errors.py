from vpipe_lab.control.errors import BudgetError, WorkerError


def test_worker_error_names_stage_and_cause() -> None:
    err = WorkerError(1, "ValueError: bad", traceback="Traceback...\nValueError: bad")
    assert str(err).startswith("stage 1 failed: ValueError: bad") and "traceback of stage 1" in str(err)


def test_worker_error_says_where_as_far_as_it_is_known() -> None:
    assert str(WorkerError(0, "X: y", iteration=2, microbatch=1, action="the loss")).startswith(
        "stage 0 failed at iteration 2, micro-batch 1 (the loss): X: y")
    assert str(WorkerError(1, "X: y", iteration=4, action="the optimizer step")).startswith(
        "stage 1 failed at iteration 4 (the optimizer step): X: y")
    assert str(WorkerError(1, "X: y", iteration=0, action="building the stage")).startswith(
        "stage 1 failed at iteration 0 (building the stage)")


def test_budget_error_suggests_layers_or_repartition() -> None:
    fixable = BudgetError(0, used=1100, budget=1000, layers=[(3, 80), (1, 50)], iteration=4)
    assert "layer(s) 3, 1" in str(fixable) and "set_policy({3: 'recompute'})" in str(fixable)
    static = BudgetError(0, used=5000, budget=1000, layers=[(3, 80)], iteration=4)
    assert "set_partition" in str(static)


def test_a_budget_error_says_whether_the_iteration_was_dropped_or_taken() -> None:
    dropped = BudgetError(0, used=1100, budget=1000, layers=[(3, 80), (1, 50)], iteration=4)
    taken = BudgetError(0, used=1100, budget=1000, layers=[(3, 80), (1, 50)], iteration=4, taken=True)
    assert "dropped on every stage" in str(dropped) and not dropped.taken
    assert "PipeDream had already updated its weights" in str(taken) and "dropped" not in str(taken) and taken.taken
