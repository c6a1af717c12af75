"""What a stage holds along a schedule's order, for the cost model's peak memory.

A stage running several chunks holds, at each point of its order, some forwards awaiting their B per chunk (full
activations) and, under a split backward, some backwards awaiting their W per chunk (the weight step's inputs); right
before a B it also rebuilds that chunk's recomputed layer. Its peak is the largest of these states weighted by its
chunks' bytes per micro-batch (``costmodel.chunks_peak``), which a count of chunk-forwards times the largest chunk's
bytes overstates whenever the chunks differ. A stage without chunks also holds what its transfers keep (``transfers``:
the tensors it sent, until the iteration's sends are waited for, and the receives it posted ahead).
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


# What a single-chunk stage's transfers hold at one point of its order (``transfers``): (input gradients sent,
# outputs sent whose backward is done, a receive of an input posted ahead, one of a gradient posted ahead, a received
# gradient in use)
Transfers = tuple[int, int, int, int, int]


def transfers(order: Sequence[tuple[str, int, int]], receives_input: bool, receives_grad: bool) -> tuple[Transfers, ...]:
    """What the transfers of one stage hold at each compute step of its ``order`` (("F" | "B" | "W", chunk,
    micro-batch) steps of a schedule without chunks), the dominated points left out: every tensor the stage sent (its
    input gradients back, its outputs forward once their backward no longer holds them) until the iteration's end
    waits for the sends (``Peer.flush`` in ``runtime/engine/comm.py``), the next receive of each kind, posted ahead
    with its buffer as soon as the one before arrived, and during a backward the gradient it received."""
    inputs = sum(op == "F" for op, _, _ in order) if receives_input else 0
    grads = sum(op == "B" for op, _, _ in order) if receives_grad else 0
    sent_in = sent_out = got_in = got_grad = 0
    latest: dict[tuple[int, int, int], Transfers] = {}
    for op, _, _ in order:
        got_in += op == "F" and receives_input
        got_grad += op == "B" and receives_grad
        flags = (int(got_in < inputs), int(got_grad < grads), int(op == "B"))
        latest[flags] = (sent_in, sent_out, *flags)  # what was sent only grows: the latest point dominates the rest
        # an output is held for its backward anyway (the profile counts it there), and by its send after it
        sent_out += op == "B"
        sent_in += op == "B"
    found = set(latest.values())

    def dominated(p: Transfers) -> bool:
        return any(q != p and all(x >= y for x, y in zip(q, p)) for q in found)

    return tuple(sorted(p for p in found if not dominated(p)))
