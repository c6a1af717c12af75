from vpipe_lab.core.errors import InfeasiblePlan, PlanError, VpipeError


def test_infeasible_message_lists_remedies() -> None:
    err = InfeasiblePlan("stage 2 lacks 10 bytes.", stage=2, missing_bytes=10, suggestions=("more stages", "swap"))
    assert str(err) == "stage 2 lacks 10 bytes. What would help: more stages; swap."
    assert err.stage == 2 and err.missing_bytes == 10 and isinstance(err, VpipeError)


def test_plan_error_is_a_value_error() -> None:
    assert issubclass(PlanError, ValueError)
