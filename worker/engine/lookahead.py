"""Slots ahead (`--num-lookahead-slots`): when to hold them, and when to give them back.

A call holds each sequence it samples for at least that many reserved slots
past its next token, to the end of the block that holds the last of them,
so the steps after it make no allocator call until a sequence runs out, a
request is admitted or a sample forks. Their tokens' values ride the next
Append the sequence sends anyway (slots it takes, a copy, samples that wait
to fork), or its finishing flush; a call that takes nothing for a sequence
sends nothing for it. In steady decoding a sequence so appears in about one
call a block, not in every one, and a block it fills is hashed (findable)
with that call: at most a block of tokens later than with a call per step.
Slots ahead are all or none,
taken only when the free blocks past the watermark hold them, what every
running sequence needs next and the blocks of a request that waits only for
the token budget; a step short of blocks gives them back (`Unreserve`)
before it preempts or leaves a request waiting. The block arithmetic is
`PoolPlan`'s; these functions decide who and when. The rules:
docs/architecture.md, "Steps without a call".
"""

from __future__ import annotations

from allocator_service.core import Append, Unreserve
from allocator_service.core.planner import after_append, reserve_for
from worker.engine.sequence import Sequence
from worker.engine.step_plan import StepPlan, Unreserved, priority_key


def plan_appends(plan: StepPlan, running: list[Sequence], lookahead: int, watermark: int) -> None:
    """The step makes a call: each running sequence that samples tops its
    slots up to `lookahead` past its next token, rounded up to the end of
    that slot's block; a running sequence sends the values it has not sent
    with an Append it sends anyway (slots it takes, an Unreserve, a copy, a
    parent whose samples wait to fork); then the admissions follow.
    Lookahead is all or none: only when the free blocks past the
    watermark hold every running sequence's lookahead and what each still
    needs for its known tokens and its next one (so a sequence that gets
    none now is not starved by those that did over the next steps), and
    never in a step that preempted or left a request waiting for blocks.
    Otherwise a sequence takes only the room of the blocks it takes anyway."""
    view = plan.view
    plan.ops.extend(op for _, op in plan.flushes)
    # (before the Appends: the blocks they free may serve them)
    plan.ops.extend(Unreserve(seq.alloc_id, u.slots) for seq, u in plan.unreserves.items())
    wants: dict[Sequence, int] = {}  # sampling sequence -> the slots it wants held
    # (not while samples wait to fork from it: a parent forks holding exactly its prompt)
    parents = {seq for seq in plan.running if _samples_wait(seq)}
    for seq, p in plan.running.items():
        end = seq.num_stored + p.n
        if (
            lookahead
            and end >= len(seq.token_ids)  # this step samples it
            and seq not in plan.unreserves
            and seq not in parents
        ):
            # whole blocks (slots of a block it takes anyway cost no block),
            # never past what the request can still compute
            want = view.blocks_for(end + lookahead) * view.block_size
            wants[seq] = min(want, seq.max_computed_tokens)
    extra_total = sum(
        view.short_of(plan.running[seq].cost.blocks, want) for seq, want in wants.items()
    )
    fits = (
        bool(wants)
        and not plan.short
        and extra_total <= (view.free - watermark - blocks_to_come(plan, running) - plan.queued)
    )
    for seq, p in plan.running.items():
        end = seq.num_stored + p.n
        held, reserved = seq.num_held, seq.num_reserved
        if (u := plan.unreserves.get(seq)) is not None:
            # It keeps the blocks up to `end` (`unreserve_ahead`): its
            # Append, after the Unreserve, sends values only, into slots
            # it keeps (built against what it holds now: it reserves none).
            op = append_op(seq, end, held)
            held, reserved = held - u.slots, reserved - u.slots
            target = held
        else:
            target = max(end, held)
            if seq in wants:
                want, blocks = wants[seq], p.cost.blocks
                if fits:
                    view.take_blocks(view.short_of(blocks, want))
                    target = max(target, want)
                else:
                    target = max(target, view.fit(blocks, want))
            op = append_op(seq, end, target)
        if target > seq.num_held or u is not None or p.must_call or (op.tokens and seq in parents):
            p.op = op
            p.held, p.reserved = after_append(held, reserved, len(op.tokens), op.reserve)
            plan.ops.append(op)
    plan.ops.extend(plan.admits)


def _samples_wait(seq: Sequence) -> bool:
    """Whether samples of `seq` wait to fork from it."""
    return any(c.fork_parent is seq and not c.is_finished for c in seq.children)


def blocks_to_come(plan: StepPlan, running: list[Sequence]) -> int:
    """Blocks the running sequences need after this step for what they
    will compute: their known tokens not computed yet (the rest of a
    chunked prompt, a recompute) and the next token; at least one each.
    Lookahead leaves these free."""
    total = 0
    for seq in running:
        p = plan.running.get(seq)
        blocks = p.cost.blocks if p is not None else len(seq.block_table)
        total += max(1, plan.view.short_of(blocks, len(seq.token_ids) + 1))
    return total


def unreserve_ahead(plan: StepPlan, running: list[Sequence], short: int) -> bool:
    """Make `short` more blocks free by giving back the slots running
    sequences hold past anything this step computes (lookahead slots):
    whole trailing blocks, the newest lowest-priority sequences' first,
    as preemption would pick them. All or nothing: whether that made the
    room (else nothing is given back). A sequence gives back the blocks
    past the one that holds the end of this step's tokens (for one not
    planned yet, of its known tokens and the one being sampled), and
    keeps any room in that block; what it gives back is reserved slots
    (past anything computed, so without values)."""
    view, found, picked = plan.view, 0, []
    for seq in sorted(running, key=priority_key, reverse=True):
        if found >= short:
            break
        if seq in plan.unreserves:
            continue
        p = plan.running.get(seq)
        end = seq.num_stored + p.n if p is not None else len(seq.token_ids) + (seq in plan.ahead)
        slots, blocks = view.unreserve(seq.block_table, seq.num_held, end)
        if blocks > 0:
            picked.append((seq, Unreserved(slots, len(seq.block_table) - blocks)))
            found += blocks
    if found < short:
        return False
    for seq, u in picked:
        plan.unreserves[seq] = u
        view.release(seq.block_table[u.keep :])
    plan.short = True  # blocks ran short: this step takes no lookahead back
    return True


def append_op(seq: Sequence, end: int, target: int) -> Append:
    """The Append that makes `seq` hold `target` slots (>= `end`, the end of
    what this step computes, and >= those it holds): first the values of the
    slots it holds without them (reserved before, or computed by steps that
    made no call), then those of the new slots up to `end` whose tokens are
    known (no value past what is computed by the end of this step: a block
    is findable once its values are in), and a reservation for the rest (the
    token the running step samples for it, with async scheduling, and the
    lookahead slots)."""
    tokens = seq.token_ids[seq.num_valued : min(end, len(seq.token_ids))]
    return Append(
        seq.alloc_id, tokens, reserve_for(seq.num_held, seq.num_reserved, len(tokens), target)
    )
