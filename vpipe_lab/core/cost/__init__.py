"""What a plan costs: the cost model, the schedules' closed-form iteration times, the simulator's replay, and profiles
rescaled to another micro-batch size."""
