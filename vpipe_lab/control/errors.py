"""Errors a Session raises about its workers."""

from __future__ import annotations

from vpipe_lab.core.errors import VpipeError
from vpipe_lab.core.report import human_bytes


class WorkerError(VpipeError):
    """A worker failed (exception, killed, out of memory); the others were stopped. Names the stage, where it was
    (``iteration``, ``microbatch``, ``action``: -1 and "" where unknown) and the cause."""

    def __init__(self, stage: int, cause: str, *, traceback: str = "", log_tail: str = "", exit_code: int | None = None,
                 checkpoint: str | None = None, iteration: int = -1, microbatch: int = -1, action: str = "") -> None:
        self.stage, self.cause, self.traceback, self.log_tail, self.exit_code = stage, cause, traceback, log_tail, exit_code
        self.checkpoint = checkpoint
        self.iteration, self.microbatch, self.action = iteration, microbatch, action
        text = f"stage {stage} failed{self.where}: {cause}"
        if checkpoint:
            text += (f"\nIt failed during a live migration. The last consistent state (from just before the migration) "
                     f"is saved at {checkpoint}: resume with vpipe_lab.launch(..., resume={checkpoint!r}).")
        if traceback:
            text += f"\n--- traceback of stage {stage} ---\n{traceback.rstrip()}"
        elif log_tail:
            text += f"\n--- last lines of stage {stage}'s log ---\n{log_tail.rstrip()}"
        super().__init__(text)

    @property
    def where(self) -> str:
        """" at iteration 3, micro-batch 1 (backward in unit 4 (h.2))", or less where less is known."""
        parts = [f"iteration {self.iteration}"] if self.iteration >= 0 else []
        if self.microbatch >= 0:
            parts.append(f"micro-batch {self.microbatch}")
        text = (" at " + ", ".join(parts)) if parts else ""
        return text + (f" ({self.action})" if self.action else "")


class BudgetError(VpipeError):
    """A stage went over its memory budget; that iteration was dropped on every stage (or, ``taken``, kept: PipeDream
    had made its updates) and training is paused."""

    def __init__(self, stage: int, used: int, budget: int, layers: list[tuple[int, int]], iteration: int,
                 taken: bool = False) -> None:
        self.stage, self.used, self.budget, self.layers, self.iteration = stage, used, budget, layers, iteration
        self.taken = taken
        over = used - budget
        picks, freed = [], 0
        for layer, nbytes in layers:
            if freed >= over:
                break
            picks.append(layer)
            freed += nbytes
        self.suggested = picks if freed >= over else []
        if picks and freed >= over:
            hint = (f"swap or recompute layer(s) {', '.join(map(str, picks))} (they hold {human_bytes(freed)} of "
                    f"activations), e.g. session.set_policy({{{picks[0]}: 'recompute'}})")
        else:
            hint = (f"its kept activations hold only {human_bytes(freed)}, so swap or recompute cannot close the gap: "
                    f"move layers to another stage (session.set_partition(...)) or raise the budget")
        super().__init__(
            f"stage {stage} needs {human_bytes(used)} but its budget is {human_bytes(budget)} "
            f"({human_bytes(over)} over) at iteration {iteration}; "
            + ("the iteration was dropped on every stage and training is paused with no state changed" if not taken
               else "PipeDream had already updated its weights in that iteration, so it counts, and training is paused")
            + f". To fix: {hint}; then session.resume()."
        )


class DataError(VpipeError):
    """A batch is not like the first one (keys, dtypes, dimensions): training paused before it ran, nothing changed."""

    def __init__(self, iteration: int, cause: str) -> None:
        self.iteration, self.cause = iteration, cause
        super().__init__(
            f"the batch of iteration {iteration} is bad data: {cause}. Training is paused before it, with nothing "
            f"changed: keep the state with session.save(path), fix the data, and launch(..., resume=path); "
            f"session.resume() reads the same batch again")


class NonFiniteLoss(VpipeError):
    """A micro-batch's loss was NaN or infinite: training paused before that iteration's optimizer step, nothing
    changed (``launch(nonfinite="pause")``, the default)."""

    def __init__(self, iteration: int, microbatch: int, stage: int, value: str, taken: bool = False) -> None:
        self.iteration, self.microbatch, self.stage, self.value = iteration, microbatch, stage, value
        where = ("PipeDream had already updated its weights in that iteration, so it counts, and training is paused"
                 if taken else "Training is paused before that iteration's optimizer step, with nothing changed")
        super().__init__(
            f"the loss of iteration {iteration}, micro-batch {microbatch} is {value} (computed on stage {stage}). "
            f"{where}: keep the state with session.save(path); session.resume() runs "
            f"{'on' if taken else 'the same batch again'}; launch(..., nonfinite='skip', resume=path) skips the step "
            f"of such iterations (a lower learning rate or clip_grad_norm often cures a diverging run)")


class SessionClosed(VpipeError):
    """The session was stopped; start a new one with launch()."""
