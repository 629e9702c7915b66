"""Structured output: a grammar (JSON schema, regex, choice, Lark) masks the logits at every step.

`backend.py` turns a request's `StructuredOutputsParams` into an llguidance grammar, checks it (the front,
before queuing) and compiles it against the tokenizer (the engine core, on a worker thread, cached by
spec); `manager.py` holds each request's matcher in the core, bounds each compile's time, fills the step's
token bitmask, advances the matchers on every accepted token, and finds the tokens a grammar forces (the
only one its mask allows), which the core appends without sampling (fast-forward).
"""
