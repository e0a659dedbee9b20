"""The engine's front: what turns an editor's document and cursor into a prompt, shared by the
local and the remote engine. Documents and their anchors, FIM templates and prompt layouts,
context windows, other files' chunks (open buffers and the workspace), request checks and the
text stop rules. It knows tokenizers and text, never models, caches or forward passes."""
