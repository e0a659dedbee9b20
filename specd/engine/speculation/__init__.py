"""Speculative decoding: the loop (``loop``: draft, verify in one forward, accept, roll back),
verification (``verify``), the planner that chooses each step's drafts by what they cost and buy
(``planner``), the drafters (``drafters``: one module each, declaring what the planner needs, and
their registry), forward and acceptance costs, sampling and token healing's constraint. It drives
a ``specd.engine.caches.KVState`` and knows nothing of documents, prompts or the front."""
