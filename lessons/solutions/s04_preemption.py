"""Lesson 04's solution: choose the victim of a preemption and send it back to the waiting queue (recompute)."""


def preempt(running, waiting):
    """One recompute preemption. `running` and `waiting` are lists of Seq (checks/c04_preemption.py) in queue
    order; `waiting` is sorted by (priority, arrival). Returns (running, waiting, freed): the two queues after
    the preemption, and the victim's blocks in the order they are freed."""
    victim = max(running, key=lambda s: (s.priority, s.arrival))      # lowest priority, then latest arrival
    back = victim._replace(status="preempted", num_computed_tokens=0, block_table=())   # its KV is dropped
    i = 0
    while i < len(waiting) and (waiting[i].priority, waiting[i].arrival) < (back.priority, back.arrival):
        i += 1                                                        # its place by (priority, arrival)
    return ([s for s in running if s.request_id != victim.request_id], waiting[:i] + [back] + waiting[i:],
            list(reversed(victim.block_table)))                       # tail blocks first
