"""What each request field of the API does, one line each: the API reference (docs/api.md, written by
`python -m minivllm.docs_tables --write`) is generated from this and from protocol.ACCEPTED_FIELDS, which says which
route reads which field.

Owns: the words only. Which fields a route takes is protocol.py's (a field there without a line here fails
tests/test_api_reference.py); what a field does is the code that reads it. Must never import torch or the engine.
"""

from __future__ import annotations

FIELD_HELP = {
    # the request itself
    "model": "the served model's name (GET /v1/models) or its path; another name is a 404",
    "prompt": "completions: a string, a list of token ids, or a list of those (one choice each, up to 1,024); "
              "/tokenize: a string",
    "messages": "the chat: {role, content} objects (roles system, developer, user, assistant, tool; content a "
                "string or text and image_url parts); an assistant message may carry tool_calls and a tool message "
                "its tool_call_id, as OpenAI's API",
    "tokens": "/detokenize: the token ids to turn back into text",
    "user": "an id for the end user, at most 256 characters; checked, not used",
    "stream": "answer as server-sent events, one chunk per new piece of text",
    "stream_options": "with stream: include_usage adds a last chunk with the usage; continuous_usage_stats (with "
                      "include_usage) puts the running usage on every chunk too (vLLM's)",
    "n": "how many choices to sample per prompt (the beam width with use_beam_search)",
    "priority": "vLLM's: the scheduling priority, lower runs first (and is preempted last); any 64-bit integer, "
                "default 0",
    "cache_salt": "vLLM's: prefix-cache hits only among requests with the same salt (it enters the first block's "
                  "hash)",
    # length
    "max_tokens": "the most tokens to generate (completions: 16 by default; chat: the rest of the context); with "
                  "echo on completions, 0 returns the prompt alone",
    "max_completion_tokens": "chat: OpenAI's newer name for max_tokens (it wins when both are sent)",
    "min_tokens": "vLLM's: generate at least this many tokens before EOS or a stop string may end the answer",
    "truncate_prompt_tokens": "vLLM's: run on k of the prompt's tokens (-1: max_model_len of them); which k, "
                              "truncation_side says",
    "truncation_side": "vLLM's: with truncate_prompt_tokens, 'left' (the default) keeps the prompt's last k tokens, "
                       "'right' its first k",
    "ignore_eos": "vLLM's: keep generating past the end-of-sequence token",
    "stop": "a string or a list of strings that ends the answer (left out of it)",
    "stop_token_ids": "vLLM's: token ids that end the answer",
    "include_stop_str_in_output": "vLLM's: keep the stop string that ended the answer in its text",
    # sampling
    "temperature": "sampling temperature; 0 is greedy",
    "top_p": "nucleus sampling: the smallest set of tokens whose probability reaches top_p",
    "top_k": "vLLM's: sample among the k most likely tokens (-1 or 0: all)",
    "min_p": "vLLM's: drop tokens less likely than min_p times the most likely one",
    "seed": "a seed for this request's sampling",
    "presence_penalty": "penalise tokens that already appear in the answer, once each",
    "frequency_penalty": "penalise tokens by how often they already appear in the answer",
    "repetition_penalty": "vLLM's: penalise tokens seen in the prompt or the answer (above 1 penalises)",
    "logit_bias": "{token id: bias} added to those tokens' logits",
    "bad_words": "vLLM's: words (strings) the answer may not contain",
    "allowed_token_ids": "vLLM's: the only token ids the answer may use",
    "skip_special_tokens": "vLLM's: leave special tokens out of the text (true by default)",
    "use_beam_search": "vLLM's: a beam search of width n instead of sampling; the n best beams are the choices",
    "length_penalty": "vLLM's: with use_beam_search, how a beam's length weighs in its score",
    # logprobs
    "logprobs": "completions: the k most likely tokens at each position, with the chosen one's log-probability "
                "(0 to --max-logprobs, 20 by default; -1: the whole vocabulary, with --max-logprobs -1); chat: true to "
                "return log-probabilities",
    "top_logprobs": "chat: with logprobs true, how many of the most likely tokens each position lists (0 to "
                    "--max-logprobs, 20 by default; -1: the whole vocabulary, with --max-logprobs -1)",
    "echo": "completions: the prompt in front of each choice's text (and of its logprobs); chat (vLLM's): the last "
            "message's text in front of each choice when it has the answer's role, e.g. a continued message",
    "prompt_logprobs": "vLLM's: the log-probability of every prompt token and of its k most likely alternatives "
                       "(completions: in each choice; chat: at the top of the answer); not with stream",
    "return_token_ids": "vLLM's: the prompt's token ids (completions: prompt_token_ids in each choice; chat: at the "
                        "top; streamed: in the first chunk) and each choice's generated token_ids (streamed: each "
                        "chunk's own)",
    "return_tokens_as_token_ids": "vLLM's: logprobs tokens written 'token_id:N' (any token survives JSON); the "
                                  "server flag --return-tokens-as-token-ids makes it the default",
    # structured output
    "response_format": "{type: text}, {type: json_object} or {type: json_schema, json_schema: {name, schema}}: the "
                       "answer is grammar-constrained JSON",
    "structured_outputs": "vLLM's: {json | regex | choice | grammar | json_object: ...}, a grammar-constrained answer",
    "guided_json": "vLLM's older field: the answer follows this JSON schema",
    "guided_regex": "vLLM's older field: the answer matches this regular expression",
    "guided_choice": "vLLM's older field: the answer is one of these strings",
    "guided_grammar": "vLLM's older field: the answer follows this EBNF grammar",
    "guided_decoding_backend": "vLLM's older field: the grammar engine; only 'xgrammar' (or 'auto') here",
    # chat template and tools
    "add_generation_prompt": "end the rendered chat with the assistant's header (true by default)",
    "continue_final_message": "leave the last (assistant) message open for the model to continue",
    "chat_template": "the request's own Jinja chat template; refused unless the server runs with "
                     "--trust-request-chat-template",
    "add_special_tokens": "/tokenize: add the tokenizer's special tokens (true for a prompt, false for messages)",
    "tools": "chat (and /tokenize with messages): the functions the model may call, laid out by the chat template",
    "tool_choice": "chat: 'none', 'auto' (needs --enable-auto-tool-choice), 'required', or a named function; the "
                   "forced ones are grammar-constrained",
    "parallel_tool_calls": "chat: false keeps only the first tool call",
}
