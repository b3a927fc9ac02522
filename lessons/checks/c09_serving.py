"""Lesson 09's checks: `stream_deltas` on hand-made pieces, then against the deltas a real engine streams with stop
strings (RequestOutputKind.DELTA)."""

import functools

from course import ExerciseFailed, expect_equal, same_answer


@functools.cache
def _engine():
    """A small real engine, built once."""
    from minivllm import LLM
    return LLM(num_kv_blocks=64, max_num_seqs=16, seed=0).llm_engine


def _run(engine, requests):
    """Run `requests` ({id: (prompt, stop)}) greedily, streaming DELTA outputs: {id: (output token ids, deltas)}."""
    from minivllm import SamplingParams
    from minivllm.core.sampling_params import RequestOutputKind
    got = {rid: ([], []) for rid in requests}
    try:
        for rid, (prompt, stop) in requests.items():
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=16, stop=stop,
                                                      output_kind=RequestOutputKind.DELTA), request_id=rid)
        while engine.has_unfinished_requests():
            for out in engine.step():
                got[out.request_id][0].extend(out.outputs[0].token_ids)
                got[out.request_id][1].append(out.outputs[0].text)
    finally:
        for rid in requests:
            engine.abort_request(rid)
    return got


@functools.cache
def _streams():
    """The requests ({id: (prompt, stop)}) and what the engine streamed for each ({id: (the detokenizer's pieces,
    the deltas)}), run once: greedy, so every run of the check would see the same."""
    engine = _engine()
    prompts = {"fr": "The capital of France is", "py": "def fibonacci(n):", "story": "Once upon a time",
               "chat": engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of "
                                                             "France?"}], tokenize=False, add_generation_prompt=True)}
    plain = _run(engine, {name: (p, []) for name, p in prompts.items()})
    requests = {}
    for name, prompt in prompts.items():
        pieces = _pieces(engine.tokenizer, plain[name][0])
        text, boundary = "".join(pieces), len("".join(pieces[:3]))
        across = text[boundary - 2:boundary + 2]                  # the end of token 3 and the start of token 4
        inside = pieces[4][1:-1] or pieces[4]                     # inside token 5
        for i, stop in enumerate(([across], [inside], ["zebra crossing"], ["zebra crossing", inside, across])):
            requests[f"{name}-{i}"] = (prompt, stop)
    streamed = {rid: (_pieces(engine.tokenizer, token_ids), deltas)
                for rid, (token_ids, deltas) in _run(engine, requests).items()}
    return requests, streamed


def _pieces(tokenizer, token_ids):
    """The detokenizer's new text for each token, as the output processor gets it."""
    from minivllm.engine.output_processor import DetokState, detokenize_incrementally
    pieces, state = [], DetokState()
    for i in range(1, len(token_ids) + 1):
        piece, state = detokenize_incrementally(tokenizer, token_ids[:i], state)
        pieces.append(piece)
    return pieces


def check_stream_deltas(fn):
    expect_equal(fn(["Hel", "lo", "", " world"], []), ["Hel", "lo", "", " world"],
                 "no stop strings, pieces ['Hel', 'lo', '', ' world']")
    yield "no stop strings: every piece goes out as it comes"
    expect_equal(fn(["abc", "de", "f", "g"], ["END"]), ["a", "bc", "d", "efg"],
                 "stop=['END'], which never comes, pieces ['abc', 'de', 'f', 'g'] (the last len('END') - 1 = 2 "
                 "characters wait, until the last piece sends them)")
    expect_equal(fn(["Paris", ".", ""], ["..."]), ["Par", "i", "s."],
                 "stop=['...'], pieces ['Paris', '.', ''] (the last piece, empty here as an end-of-sequence "
                 "token's, still sends what was held back)")
    expect_equal(fn(["ab", "cd"], ["xyz", "q"]), ["", "abcd"],
                 "stop=['xyz', 'q'], pieces ['ab', 'cd'] (the longest stop string sets what is held back)")
    yield "held back: the last len(longest stop) - 1 characters wait; the last piece sends them"
    expect_equal(fn(["The", " capital", " is", " Paris", "."], [" Paris"]), ["", "The ca", "pit", "al is"],
                 "stop=[' Paris'], pieces ['The', ' capital', ' is', ' Paris', '.'] (the stream ends before the "
                 "stop string)")
    expect_equal(fn(["Hello", " wor", "ld", "!", " more"], ["world"]), ["H", "ello", " "],
                 "stop=['world'], pieces ['Hello', ' wor', 'ld', '!', ' more'] (a stop string split across two "
                 "pieces)")
    expect_equal(fn(["ST", "OP", "x"], ["STOP"]), ["", ""],
                 "stop=['STOP'], pieces ['ST', 'OP', 'x'] (a stop string at the very start)")
    yield "a stop string ends the stream just before it, also when it spans pieces"
    expect_equal(fn(["x", "abcdef", "g"], ["def", "bc"]), ["", "xa"],
                 "stop=['def', 'bc'], pieces ['x', 'abcdef', 'g'] (both complete in the same piece: the one that "
                 "starts first in the text wins, whatever the order of the list)")
    yield "several stop strings: the earliest in the text wins"
    # The real engine: greedy completions of a few prompts, first without stop strings, then with stop strings cut
    # from their own text (one inside a token, one across two tokens, one that never comes, and two at once); your
    # deltas, from the detokenizer's pieces of each request's tokens, must be the deltas the engine streamed.
    requests, streamed = _streams()
    for rid, (prompt, stop) in requests.items():
        pieces, expected = streamed[rid]
        actual = fn(list(pieces), list(stop))
        if not same_answer(actual, expected):
            raise ExerciseFailed(f"against the real engine, prompt {prompt!r} with stop={stop!r}: the detokenizer's "
                                 f"pieces {pieces}; the engine streamed {expected}, your function gives {actual}")
    yield f"{len(requests)} streams of the real engine (DELTA, with stop strings): your deltas are its deltas"
