"""specd-lsp: the LSP front end (published as the import package ``specd_lsp``).

It reaches the daemon only through ``specd.client`` and ``specd.protocol``; it never imports
``specd.engine`` or ``specd.daemon``.
"""
