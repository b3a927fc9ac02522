"""Lesson 15's solution: the encoder cache's admission rule, how far a chunk of a prompt with images may run."""


def fit(ecm, req, start, num_tokens, out):
    """How many of the `num_tokens` tokens from position `start` of `req` may run this step: all of them, or the
    tokens before the first image in that range whose encoder output is neither kept for a request
    (`ecm.cached`) nor in the step's plan already nor fits. Plans the images it lets in:
    `out.encoder_plan[req.request_id]` becomes the list of them, in prompt order."""
    mine = out.encoder_plan[req.request_id] = []          # a plan left by an earlier call is replaced
    end = start + num_tokens
    for image in req.mm_features:
        if image.offset >= end:
            break                                         # this image, and every later one, is past the chunk
        if image.end <= start:
            continue                                      # the prompt ran past it already
        # What the step's plan needs: this request's images so far and those of the requests scheduled already
        # (a request that was planned but then not scheduled plans nothing).
        needed = {}
        for rid, images in out.encoder_plan.items():
            if rid == req.request_id or rid in out.num_scheduled_tokens:
                needed.update((f.mm_hash, f.length) for f in images)
        if image.mm_hash not in needed and image.mm_hash not in ecm.cached:
            needed[image.mm_hash] = image.length          # from here on it is pinned too
            new_rows = sum(rows for h, rows in needed.items() if h not in ecm.sizes)
            evictable = sum(rows for h, rows in ecm.freeable.items() if h not in needed)
            if new_rows > ecm.num_free_slots + evictable:
                return max(image.offset - start, 0)       # it waits for room; the tokens before it may run
        mine.append(image)
    return num_tokens
