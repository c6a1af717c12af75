"""What a stage holds along a chunked schedule's order (interleaved 1F1B, ZBV), for the cost model's peak memory.

A stage running several chunks holds, at each point of its order, some forwards awaiting their B per chunk (full
activations) and, under a split backward, some backwards awaiting their W per chunk (the weight step's inputs); right
before a B it also rebuilds that chunk's recomputed layer. Its peak is the largest of these states weighted by its
chunks' bytes per micro-batch (``costmodel.chunks_peak``), which a count of chunk-forwards times the largest chunk's
bytes overstates whenever the chunks differ.
"""

from __future__ import annotations

from collections.abc import Sequence

State = tuple[int, ...]  # (F-held per chunk ..., W-held per chunk ..., local index of the chunk whose B is next or -1)


def states(order: Sequence[tuple[str, int, int]], chunks: Sequence[int]) -> tuple[State, ...]:
    """The distinct states along ``order`` (("F" | "B" | "W", chunk, micro-batch) steps of one stage, whose chunks
    are ``chunks`` in model order), leaving out those another state with the same next B dominates."""
    n = len(chunks)
    index = {c: i for i, c in enumerate(chunks)}
    held = [0] * (2 * n)
    seen: set[State] = {(*held, -1)}
    split = any(op == "W" for op, _, _ in order)
    for op, c, _ in order:
        i = index[c]
        if op == "F":
            held[i] += 1
        elif op == "B":
            seen.add((*held, i))
            held[i] -= 1
            if split:
                held[n + i] += 1
        else:
            held[n + i] -= 1
        seen.add((*held, -1))

    def dominated(s: State) -> bool:
        return any(t != s and t[-1] == s[-1] and all(x >= y for x, y in zip(t[:-1], s[:-1])) for t in seen)

    return tuple(sorted(s for s in seen if not dominated(s)))
