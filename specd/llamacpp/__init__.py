"""llama.cpp beside specd: GGUF files of any pair specd loads (``export``), and llama.cpp run
in-process as the bench's peer, one llama-server-like slot (``runtime``)."""
