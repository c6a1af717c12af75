"""Each command's body: its defaults, and what the workers need of it survives the trip."""

from vpipe_lab.wire.codec import decode
from vpipe_lab.wire.commands import (
    Apply,
    Command,
    Evaluate,
    Pause,
    Ping,
    Profile,
    Resume,
    Run,
    Save,
    SetModel,
    State,
    Stop,
    Telemetry,
)


def test_every_command_round_trips_with_its_defaults() -> None:
    commands: list[Command] = [Run(), Run(iterations=5), Pause(), Resume(), Stop(), Ping(), State(), Profile(reset=True),
                               Telemetry(spans=False), Apply({"kind": "plan"}, version=2, checkpoint="/c"),
                               Save("/ck", name="n", keep=3), SetModel("/m.pkl", plan=None, mapping={"1": 0}),
                               Evaluate("job:", batches=2)]
    for cmd in commands:
        assert decode(cmd.message()) == cmd
    assert Run().iterations is None and Evaluate("job:").batches == 1 and Telemetry().spans is True
