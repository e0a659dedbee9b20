"""The remote backend: specd's front before a serving engine's OpenAI-compatible endpoint.
``client`` speaks HTTP and the event stream; ``engine`` is the ``RemoteEngine``."""
