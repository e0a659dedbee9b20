"""``specd train-draft``: a small draft model distilled for any target, sharing its tokenizer.

One concern per module: ``corpus`` (which files, tokenized into windows, what is held out),
``teacher`` (the target, resolved from any name specd serves, run once over the corpus into
its top-k next-token distributions), ``student`` (the draft's shape, its start from the
target's embeddings, its saved folder and GGUF file), ``head`` (``--head``: a feature head's
vocabulary, loss, step and agreement), ``report`` (agreement on held-out code, step costs per
forward path, TRAINING.md) and ``train`` (settings, the time-bounded loop, its checkpoint, the
command). It may import the engine and ``specd.llamacpp``, never the daemon,
the socket API, the CLI or the bench.
"""
