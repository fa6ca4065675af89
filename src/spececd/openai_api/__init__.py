"""An OpenAI-compatible HTTP API in front of the edge (``spececd api``): see
:mod:`spececd.openai_api.server`."""
