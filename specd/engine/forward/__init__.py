"""Forward paths: ways to run a model over new tokens into its KV cache, behind one
``ForwardPath`` protocol (``specd.engine.forward.path``). transformers' own forward, the lean
static-cache forward (``lean``; CUDA graphs in ``graphs``) and llama.cpp's kernels
(``llamacpp``); ``choose`` picks one per model. Nothing here knows drafts, documents or
prompts."""
