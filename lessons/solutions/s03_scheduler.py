"""Lesson 03's solution: one scheduling step under a token budget, as Scheduler.schedule plans it."""


def schedule_step(running, waiting, max_num_batched_tokens, max_num_seqs):
    """How many tokens each request computes this step: {request_id: tokens}, for the scheduled ones only.

    `running`: (request_id, tokens still to compute) in the running queue's order, at most max_num_seqs of
    them; `waiting`: (request_id, prompt tokens) in the waiting queue's order. The KV pool is never short."""
    budget = max_num_batched_tokens
    scheduled = {}
    # 1. Running requests: those with one token left (decodes) first, then prefill chunks, each in queue order
    #    (sorted() is stable). Each takes what it needs, cut to what is left of the budget.
    for request_id, need in sorted(running, key=lambda r: r[1] > 1):
        if budget == 0:
            break
        scheduled[request_id] = min(need, budget)
        budget -= scheduled[request_id]
    # 2. Waiting requests, in order, while there is budget and a seat; a prompt too long for what is left of the
    #    budget is chunked too. A waiting request never jumps the queue.
    seats = max_num_seqs - len(running)
    for request_id, need in waiting:
        if budget == 0 or seats == 0:
            break
        scheduled[request_id] = min(need, budget)
        budget -= scheduled[request_id]
        seats -= 1
    return scheduled
