"""Speculative decoding: the loop (draft, verify in one forward, accept, roll back), the
planner that chooses each step's drafts by what they cost and buy, one module per drafter,
sampling and token healing's constraint. It drives a ``specd.engine.caches.KVState`` and
knows nothing of documents, prompts or the front."""
